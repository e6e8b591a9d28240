"""Bridging and unbridging a model again and again keeps the process's memory flat (issue 48,
item 7): 50 bridge -> call -> unbridge cycles of a tiny GPT-2 grow the resident set by < 10 MB.

Measured in a fresh process (nothing another test left behind is collected meanwhile), with the
user's default caches (no disk cache: every cycle exports), after three warm-up cycles (one-time
imports and caches) and a ``gc.collect()`` before each reading."""

import linecache
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CYCLES, LIMIT_MB = 50, 10.0

pytestmark = pytest.mark.integration  # end to end: 50 bridge/unbridge cycles in a second process

SCRIPT = r"""
import gc, sys
import torch
import nnbridge
from transformers import GPT2Config, GPT2LMHeadModel

def rss_mb():
    gc.collect()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, attn_implementation="eager",
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 100, (1, 8))
expected = model(ids).logits

def cycle():
    nnbridge.bridge(model, ids)
    assert torch.equal(model(ids).logits, expected)
    nnbridge.unbridge(model)

for _ in range(3):
    cycle()
before = rss_mb()
for _ in range(int(sys.argv[1])):
    cycle()
print(rss_mb() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_bridge_unbridge_cycles_keep_rss_flat():
    env = {key: value for key, value in os.environ.items()
           if key not in ("NNBRIDGE_CACHE", "NNBRIDGE_EXTRACTION_CACHE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(CYCLES)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = float(done.stdout.strip().splitlines()[-1])
    assert growth < LIMIT_MB, f"{CYCLES} bridge/call/unbridge cycles grew RSS by {growth:.1f} MB"



def test_source_files_read_while_extracting_leave_linecache(monkeypatch):
    """Export formats each node's stack trace from the model's source lines, which ``linecache``
    would keep for the life of the process; they are dropped when extraction ends, and entries it
    held before stay."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2 import modeling_gpt2

    import nnbridge
    from nnbridge.extract import source_lines

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50,
                                       attn_implementation="eager")).eval()
    ids = torch.randint(0, 50, (1, 4))
    expected = model(ids).logits
    linecache.getlines(__file__)
    linecache.cache.pop(modeling_gpt2.__file__, None)
    held_at_the_end: list[bool] = []  # whether the model's source was in linecache when extraction ended
    original = source_lines._read_from_file

    def read_from_file(entry: object) -> bool:
        held_at_the_end.append(modeling_gpt2.__file__ in linecache.cache)
        return original(entry)

    monkeypatch.setattr(source_lines, "_read_from_file", read_from_file)
    nnbridge.bridge(model, ids)
    try:
        assert modeling_gpt2.__file__ not in linecache.cache
        assert any(held_at_the_end), "extraction read no source file: nothing is tested"
        assert __file__ in linecache.cache
        assert torch.equal(model(ids).logits, expected)
    finally:
        nnbridge.unbridge(model)
