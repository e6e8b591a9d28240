"""ExtractionOptions.progress: a bar naming the extraction's stages on stderr; automatic by default."""

import pytest
import torch

from nnbridge import ExtractionOptions, PatchableGraph
from nnbridge.extract import progress
from nnbridge.extract.progress import AUTO_MODULES, shows_progress
from utils import assert_same

pytestmark = pytest.mark.no_extraction_cache  # a cold extraction: it exports and writes the cache


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def big() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.ReLU() for _ in range(AUTO_MODULES)))


class Terminal:
    """A stderr that says it is a terminal."""

    def __init__(self):
        self.written = []

    def isatty(self):
        return True

    def write(self, text):
        self.written.append(text)

    def flush(self):
        pass


def test_automatic_progress_needs_a_terminal_and_a_long_extraction(monkeypatch):
    assert not shows_progress(None, big())  # pytest's capture is no terminal
    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    assert shows_progress(None, big())
    assert not shows_progress(None, Small())  # expected to be quick
    assert not shows_progress(False, big())
    monkeypatch.undo()
    assert shows_progress(True, Small())


def test_progress_true_names_the_stages_on_stderr(capfd):
    model, x = Small(), torch.randn(2, 4)
    capfd.readouterr()
    pg = PatchableGraph(model, x, options=ExtractionOptions(progress=True))
    out, err = capfd.readouterr()
    assert out == ""
    assert "extracting Small" in err
    for stage in ("exporting", "writing the cache", "building graphs"):
        assert stage in err
    assert err.index("exporting") < err.index("writing the cache") < err.index("building graphs")
    assert_same(pg(x), model(x))


@pytest.mark.parametrize("setting", [None, False])
def test_no_progress_off_a_terminal_or_when_off(capfd, setting):
    model, x = Small(), torch.randn(2, 4)
    capfd.readouterr()
    PatchableGraph(model, x, options=ExtractionOptions(progress=setting))
    assert capfd.readouterr() == ("", "")


def test_the_default_is_automatic():
    assert ExtractionOptions().progress is None
