"""fuzz_cached_length_read_twice: cached layers reading their cache's length (``cache.get_seq_length``) looped over twice
in one forward, then a decode step: the length the second loop reads is the cache's length when the
call began plus what the first loop wrote, so unflatten gives the second invocations' graphs an extra
input (a cache tensor of the root's, for its size); their graphs dropped another, unused extra input
that the root's graph still passed, so each argument landed one place off (a TypeError where eager
runs). Found by running programs of the fuzzer's grammar through its check (``run_case`` of
tests/corpus/test_fuzz.py), reduced by hand.

Program(blocks=(Block(arity=1, body=0, inner=None, alpha=False),), children=(Child(kind='block', blocks=(0,)), Child(kind='cached', blocks=(2, 2, 0))), stmts=(Stmt(kind='call', args=(0,), child=0, style='pos'), Stmt(kind='cached', args=(1,), child=1, style='pos'), Stmt(kind='cached', args=(2,), child=1, style='pos')), output=('one', (3,)), script=(Step(kind='call', grad=True, input_grad=False, rows=3, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0)), modes=('eval',))
"""


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corpus import Call, Edit, Entry
from corpus.program_parts import CachedLayer, HParams, Inner, ProgramRoot, Swish, new_cache


class B0(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class B0Alt(B0):
    def forward(self, x):
        return super().forward(x) * 2.0


class Root(ProgramRoot):
    def __init__(self):
        super().__init__()  # the state every program's root has (corpus.program_parts)
        self.c0 = B0()
        self.c1 = nn.ModuleList([CachedLayer(0, 'length'), CachedLayer(1, 'length')])

    def forward(self, v0, cache):
        v1 = self.c0(v0)
        v2 = v1
        for b in self.c1:
            v2 = b(v2, cache)
        v3 = v2
        for b in self.c1:
            v3 = b(v3, cache)
        return v3


def script():
    cache = new_cache(2, sliding=False)
    return [
        Call((torch.randn(3, 4), cache)),
        Call((torch.randn(2, 4), cache), grad=False),
    ]


ENTRIES = [Entry('fuzz_cached_length_read_twice', Root, script, item=48, modes=('eval',))]
