"""fuzz_class_swap_after_no_grad_extraction: ``module.__class__ = Sub`` on a ModuleList entry after an extraction made under
no_grad, then another no_grad call: the graphs held the old class's code (no guard on a module's
class; found and shrunk by tests/corpus/test_fuzz.py, fixed in nnbridge/bridge/guards.py).

Program(blocks=(Block(arity=1, body=0, inner=None, alpha=False),), children=(Child(kind='list', blocks=(0, 0, 0)),), stmts=(Stmt(kind='loop', args=(0, 0), child=0, style='pos'),), output=('one', (1,)), script=(Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='swap_class', grad=True, input_grad=False, rows=2, child=0, entry=2, block=0, value=2.0), Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0)), modes=('train',))
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
        self.c0 = nn.ModuleList([B0(), B0(), B0()])

    def forward(self, v0):
        v1 = v0
        for b in self.c0:
            v1 = b(v1)
        return v1


def edit0(m):
    m.c0[2].__class__ = B0Alt


def script():
    return [
        Call((torch.randn(2, 4),), grad=False),
        Edit(edit0),
        Call((torch.randn(2, 4),), grad=False),
    ]


ENTRIES = [Entry('fuzz_class_swap_after_no_grad_extraction', Root, script, item=48, modes=('train',))]
