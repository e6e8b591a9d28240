import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# -- threads per xdist worker ------------------------------------------------------------------------
# Each worker's torch would start one intra-op thread per core, so two workers on a 2-core machine
# run four busy threads on two cores. Measured: two processes each running 40 forwards of an
# 8-layer Llama (width 512, 64 tokens) took 2.09 / 2.30 s with two threads each and 1.49 / 1.49 s
# with one (0.96 s alone); test_ioi_demo took 124 s in the full run and 23 s alone. So a worker gets
# its share of the cores; OMP_NUM_THREADS carries it to the processes tests start (notebook kernels,
# second processes, the fresh-venv demo). Results do not depend on it: every test compares runs made
# in its own process.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    torch.set_num_threads(_share)
    os.environ["OMP_NUM_THREADS"] = str(_share)

# -- the extraction cache ---------------------------------------------------------------------------
# A developer's $NNBRIDGE_CACHE must never serve extractions to tests. The tests share one disk
# cache of their own instead, fresh for each run (a directory under pytest's base temp, the same
# for every xdist worker of the run): a model and call exported by one test is loaded by the next.
# A test that counts exports, tests caching or needs a cold extraction is marked
# ``no_extraction_cache`` (a whole module with ``pytestmark``): it runs with the cache off.
#
# Where the developer keeps dequantized real models (nnbridge.models also caches in
# $NNBRIDGE_CACHE), read before the variable is replaced.
_WEIGHTS_CACHE = Path(os.environ.get("NNBRIDGE_CACHE") or Path.home() / ".cache" / "nnbridge")
os.environ["NNBRIDGE_EXTRACTION_CACHE"] = "0"  # until pytest_configure has made the run's cache
os.environ.pop("NNBRIDGE_CACHE", None)
NO_CACHE_MARKER = "no_extraction_cache"


def _run_cache(config: pytest.Config) -> Path:
    """This run's cache directory (``$NNBRIDGE_CACHE`` of the tests): shared by the xdist workers,
    whose base temps are ``<the controller's base temp>/popen-gwN``."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    directory = base / "nnbridge-cache"
    directory.mkdir(exist_ok=True)
    # dequantized real models are not extractions: keep using the developer's copy when there is one
    # (a link made by the controller, or by the first worker; the others find it)
    for entry in ("SmolLM2-135M-Instruct",):
        source, link = _WEIGHTS_CACHE / entry, directory / entry
        if (source / "model.safetensors").exists() and not os.path.lexists(link):
            try:
                link.symlink_to(source, target_is_directory=True)
            except FileExistsError:
                pass
    return directory


@pytest.hookimpl(trylast=True)  # after pytest's own has made config._tmp_path_factory
def pytest_configure(config):
    config.addinivalue_line("markers", f"{NO_CACHE_MARKER}: runs with the test run's extraction cache off "
                                       "(the test counts exports, tests caching or needs a cold extraction)")
    os.environ["NNBRIDGE_CACHE"] = str(_run_cache(config))


def pytest_unconfigure(config):
    """The run's cache goes with the run (a dequantized SmolLM2 and every exported bundle: about a
    gigabyte). The controller removes it, after its workers have ended; a link to the developer's
    weights is removed, never followed."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(config, "_tmp_path_factory"):
        return
    directory = config._tmp_path_factory.getbasetemp() / "nnbridge-cache"  # type: ignore[attr-defined]
    shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Cache on or off for ``item``, before any of its fixtures (module-scoped ones included) runs."""
    if item.get_closest_marker(NO_CACHE_MARKER):
        os.environ["NNBRIDGE_EXTRACTION_CACHE"] = "0"
    else:
        os.environ.pop("NNBRIDGE_EXTRACTION_CACHE", None)


# -- the cyclic garbage collector ---------------------------------------------------------------------
# A worker holds about a million container objects once torch, transformers, nnsight and every test
# module are imported, and each full (generation-2) collection walks all of them: the tests'
# extractions allocate enough to start one every second or so. Measured on
# tests/inplace/test_bridge.py alone (one process, gc.callbacks timing every collection): 39
# full collections took 9.3 s of a 39.8 s run. Once collection is over, whatever exists (imports,
# collected test items) is moved to the permanent generation (``gc.freeze``), which collections
# skip: 3.8 s of 35.2 s. Objects the tests make are collected as before, so tests of what is freed
# (weakrefs, ``gc.get_objects`` counts, RSS) see the same objects; the frozen ones live to the end
# of the process anyway.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    import gc

    gc.collect()
    gc.freeze()


# -- xdist scheduling (``--dist loadscope``, see pyproject's addopts) ---------------------------------
# One work unit per test file (module-scoped fixtures are built once), except the corpus
# (test_corpus.py, a third of the tests, no module-scoped fixture), which goes out one corpus entry
# at a time (its front-ends and modes together, so they share the entry's cached exports) and keeps
# both workers busy to the end. Units go out largest first: the files that load the real models (a
# quarter of the suite's time; two first ``load_smollm2`` calls at once are safe, see
# ``nnbridge.models.publish_directory``), then by number of tests.
_REAL_MODELS = {"tests/models/test_integration.py", "tests/package/test_readme.py", "tests/package/test_notebooks.py"}
_PER_ENTRY = "tests/corpus/test_corpus.py"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if file == _PER_ENTRY and "[" in nodeid:  # test_x[entry-front_end-mode]
                return f"{file}::{nodeid.split('[', 1)[1].split('-', 1)[0]}"
            return file

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_ordered", False):  # the first assignment: the queue is full
                units = list(self.workqueue.items())
                self.workqueue.clear()
                for scope, work in sorted(units, key=lambda unit: (unit[0] not in _REAL_MODELS, -len(unit[1]))):
                    self.workqueue[scope] = work
                self._ordered = True
            super()._assign_work_unit(node)

    return Scheduling(config, log)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def options(request):
    """Fresh ``ExtractionOptions`` for one extraction mode; use it through ``utils.opaque_and_compiled``."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(f"{request.node.name} takes 'options': decorate it with @opaque_and_compiled")
    return request.param()


@pytest.fixture
def exports(monkeypatch):
    """The number of torch.export runs extraction makes in the test (a list with one count)."""
    from nnbridge.dispatch import extraction

    count = [0]
    real = extraction.export_module

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(extraction, "export_module", counted)
    return count
