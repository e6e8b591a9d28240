"""The documentation site builds with MkDocs, warnings as errors (broken links, missing pages,
docstrings that do not match their signatures in the API reference)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.integration  # end to end: a second process (mkdocs)
def test_docs_build_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
