"""``python -m benchmarks``: see ``bench_suite.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts import each other as top-level modules

from bench_suite import main  # noqa: E402

sys.exit(main())
