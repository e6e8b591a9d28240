"""The README's Python quickstarts run as scripts, as written (on the real SmolLM2), and print what
their comments promise: each ``print(...)  # text`` line's ``text`` must appear in the script's
output, in order."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parents[2] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
PROMISE = re.compile(r"^print\(.*\)\s+# (.+)$")


def promises(block: str) -> list[str]:
    return [match.group(1).strip() for line in block.splitlines() if (match := PROMISE.match(line))]


def test_readme_has_four_quickstarts_each_promising_output():
    assert len(BLOCKS) == 4
    assert all(promises(block) for block in BLOCKS)


def test_a_broken_promise_is_found():
    assert promises("x = 1\nprint(x)  # 1\nprint(x)\n") == ["1"]


@pytest.mark.integration
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_quickstart_runs_as_a_script_and_prints_what_it_promises(index, tmp_path):
    script = tmp_path / f"quickstart_{index}.py"  # nnsight reads a trace's source from its file
    script.write_text(BLOCKS[index])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout
    position = 0
    for promise in promises(BLOCKS[index]):
        found = output.find(promise, position)
        assert found >= 0, f"quickstart {index} does not print {promise!r}; it printed:\n{output}"
        position = found + len(promise)
