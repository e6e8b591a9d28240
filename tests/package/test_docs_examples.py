"""Every Python example on the documentation site runs as a script, as written, and prints what its
comments promise (each ``print(...)  # text`` line's ``text`` appears in the output, in order), as
the README's quickstarts do (``test_readme.py``). The examples build tiny random models: no
download."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # end to end: every documentation example runs as a script

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXAMPLES = [(page.name, index, code) for page in sorted(DOCS.glob("*.md"))
            for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]
PROMISE = re.compile(r"^print\(.*\)\s+# (.+)$")


def promises(code: str) -> list[str]:
    return [match.group(1).strip() for line in code.splitlines() if (match := PROMISE.match(line))]


def test_each_front_end_guide_has_a_checked_example():
    pages = {page for page, _, code in EXAMPLES if promises(code)}
    assert {"graphpatch.md", "hooks.md", "nnsight.md", "node-paths.md", "save-load.md"} <= pages


@pytest.mark.parametrize("page, index, code", EXAMPLES, ids=[f"{page}-{index}" for page, index, _ in EXAMPLES])
def test_example_runs_as_a_script_and_prints_what_it_promises(page, index, code, tmp_path):
    script = tmp_path / f"{page.removesuffix('.md').replace('-', '_')}_{index}.py"  # nnsight reads a trace's source
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    position = 0
    for promise in promises(code):
        found = done.stdout.find(promise, position)
        assert found >= 0, f"{page} example {index} does not print {promise!r}; it printed:\n{done.stdout}"
        position = found + len(promise)
