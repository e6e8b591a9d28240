"""A benchmark measurement in a new Python process (cold imports, its own peak RSS).

Example::

    result = run_json("import json; print(json.dumps({'x': 1}))", NNBRIDGE_EXTRACTION_CACHE="0")
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_json(code: str, **env: str) -> dict:
    """Run ``code`` in a new ``python -c`` with this checkout on ``PYTHONPATH`` and ``env`` added
    to the environment; the JSON object its last stdout line prints.

    Raises:
        RuntimeError: the process failed (the message holds the end of its stderr).
    """
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
