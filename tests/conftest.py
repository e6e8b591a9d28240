import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# a developer's $NNBRIDGE_CACHE must not serve extractions to tests (test_disk_cache turns it on)
os.environ["NNBRIDGE_EXTRACTION_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def options(request):
    """Fresh ``ExtractionOptions`` for one extraction mode; use it through ``utils.opaque_and_compiled``."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(f"{request.node.name} takes 'options': decorate it with @opaque_and_compiled")
    return request.param()
