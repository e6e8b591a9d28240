"""fuzz_class_swap_of_a_shared_child: ``module.__class__ = Sub`` on a child shared under two names
(``self.c1 = self.c0``), which a root whose forward enters ``torch.no_grad()`` (opaque: its own code
runs) calls; then a direct call of the child outside any forward (found by tests/corpus/test_fuzz.py
with NNBRIDGE_FUZZ_SEED=9). bridge and pg equal eager. Through nnsight the calls kept running the old
class's forward, as plain nnsight 0.8.1's do (its envoys keep the class's forward they found when
built); through nnbridge.NNsight each call now runs the forward of the module's class at the call
(nnbridge/compat/nnsight/source.py's follow_classes; plain nnsight's numbers are checked in
tests/envoys/test_module_only_traces.py).

Program(blocks=(Block(arity=2, body=2, inner='pos', alpha=True), Block(arity=2, body=0, inner='kw_rev', alpha=True)), children=(Child(kind='block', blocks=(0,)), Child(kind='shared', blocks=(0,))), stmts=(Stmt(kind='add', args=(0, 0), child=0, style='pos'), Stmt(kind='dropout', args=(1,), child=0, style='pos'), Stmt(kind='nograd', args=(1, 2), child=1, style='mixed'), Stmt(kind='add', args=(3, 2), child=0, style='pos')), output=('one', (4,)), script=(Step(kind='call', grad=False, input_grad=False, rows=3, child=0, entry=0, block=0, value=2.0), Step(kind='swap_class', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=True, input_grad=True, rows=3, child=0, entry=0, block=0, value=2.0), Step(kind='direct', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=True, input_grad=True, rows=3, child=0, entry=0, block=0, value=2.0)), modes=('eval',))
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
        self.inner = Inner()
        self.alpha = 1.5

    def forward(self, x, a):
        x = self.inner(x, a)
        return self.lin(x) + self.lin(a) * self.alpha


class B0Alt(B0):
    def forward(self, x, a):
        return super().forward(x, a) * 2.0


class B1(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = Inner()
        self.alpha = 1.5

    def forward(self, x, a):
        x = self.inner(q=a, p=x)
        return self.lin(x + a) * self.alpha


class B1Alt(B1):
    def forward(self, x, a):
        return super().forward(x, a) * 2.0


class Root(ProgramRoot):
    def __init__(self):
        super().__init__()  # the state every program's root has (corpus.program_parts)
        self.c0 = B0()
        self.c1 = self.c0  # shared

    def forward(self, v0):
        v1 = v0 + v0
        v2 = F.dropout(v1, 0.25, self.training)
        with torch.no_grad():
            v3 = self.c1(v1, a=v2)
        v4 = v3 + v2
        return v4


def edit0(m):
    m.c0.__class__ = B0Alt


def edit1(m):
    m.seen = m.c0(torch.ones(2, 4), torch.ones(2, 4)).detach()


def script():
    return [
        Call((torch.randn(3, 4),), grad=False),
        Edit(edit0),
        Call((torch.randn(3, 4, requires_grad=True),)),
        Edit(edit1),
        Call((torch.randn(3, 4, requires_grad=True),)),
    ]


ENTRIES = [Entry('fuzz_class_swap_of_a_shared_child', Root, script, item=48, modes=('eval',), attrs=lambda m: m.__dict__.get('seen'))]
