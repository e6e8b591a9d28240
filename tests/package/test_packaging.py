"""Packaging: the package installs without extras in a fresh venv and its main-job command runs.

Slow (a fresh venv gets torch and every runtime dependency), hence ``integration``. It installs
the way the README's commands and ``.ci/run`` do: ``torch==2.13.0`` first (pip's configured
find-links hold the local CPU wheel), then the package, with pip's own cache.
"""

import os
import subprocess
import sys

import pytest

from utils import REPO

pytestmark = pytest.mark.integration


def _run(command, cwd, env):
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_fresh_venv_without_extras_runs_the_demo_command_and_imports_the_loader(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, bindir = venv / "bin" / "python", venv / "bin"
    # nothing of this checkout or of the test run's interpreter may leak in
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}")
    # --no-compile: byte-compiling every installed file (torch's thousands) took most of the time;
    # the modules this test imports are compiled as they are imported
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", "torch==2.13.0"], tmp_path, env)
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", "-e", REPO], tmp_path, env)  # no extras

    usage = _run([bindir / "nnbridge", "demo", "--help"], tmp_path, env)
    assert usage.startswith("usage: nnbridge demo")
    located = _run([python, "-c", "import accelerate, gguf, nnbridge, nnbridge.models; print(nnbridge.__file__)"],
                   tmp_path, env)
    assert located.strip() == str(REPO / "nnbridge" / "__init__.py"), "the installed package is this checkout"
    assert "pytest" not in _run([python, "-m", "pip", "list"], tmp_path, env), "no test extra installed"
