"""fuzz_callable_object_replaced: a callable object (not a module) called in forward and replaced after
extraction: issue 48 item 2, not guarded (shrunk by tests/corpus/test_fuzz.py).

Program(blocks=(Block(arity=1, body=0, inner=None, alpha=False),), children=(Child(kind='block', blocks=(0,)),), stmts=(Stmt(kind='call', args=(0,), child=0, style='pos'), Stmt(kind='read', args=(1,), child=0, style='act')), output=('one', (2,)), script=(Step(kind='call', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='act_replace', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=3.0), Step(kind='call', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0)), modes=('train',))
"""


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from corpus import Call, Edit, Entry
from corpus.program_parts import HParams, Inner, ProgramRoot, Swish


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

    def forward(self, v0):
        v1 = self.c0(v0)
        v2 = self.act(v1)
        return v2


def edit0(m):
    m.act = Swish(3.0)


def script():
    return [
        Call((torch.randn(2, 4),)),
        Edit(edit0),
        Call((torch.randn(2, 4),)),
    ]


ENTRIES = [Entry('fuzz_callable_object_replaced', Root, script, item=48, modes=('train',))]
