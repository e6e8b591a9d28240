"""The README's Python quickstarts run as written (on the real SmolLM2)."""

import re
import runpy
from pathlib import Path

import pytest

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_three_quickstarts():
    assert len(BLOCKS) == 3


@pytest.mark.integration
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_quickstart_runs(index, tmp_path):
    script = tmp_path / f"quickstart_{index}.py"  # nnsight reads a trace's source from its file
    script.write_text(BLOCKS[index])
    runpy.run_path(str(script), run_name="__main__")
