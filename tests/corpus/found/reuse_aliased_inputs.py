"""fuzz_reuse_aliased_inputs: a ModuleList of identical blocks whose first block receives one tensor twice
(``h = b(h, a)`` with ``h is a``): issue 48 item 1, layer reuse served it from a graph exported for
distinct inputs (shrunk by tests/corpus/test_fuzz.py).

Program(blocks=(Block(arity=2, body=0, inner=None, alpha=False),), children=(Child(kind='list', blocks=(0, 0, 0)),), stmts=(Stmt(kind='loop', args=(0, 0), child=0, style='pos'),), output=('one', (1,)), script=(Step(kind='call', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0)), modes=('train',))
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

    def forward(self, x, a):
        return self.lin(x + a)


class B0Alt(B0):
    def forward(self, x, a):
        return super().forward(x, a) * 2.0


class Root(ProgramRoot):
    def __init__(self):
        super().__init__()  # the state every program's root has (corpus.program_parts)
        self.c0 = nn.ModuleList([B0(), B0(), B0()])

    def forward(self, v0):
        v1 = v0
        for b in self.c0:
            v1 = b(v1, v0)
        return v1


def script():
    return [
        Call((torch.randn(2, 4),)),
        Call((torch.randn(2, 4),)),
    ]


ENTRIES = [Entry('fuzz_reuse_aliased_inputs', Root, script, item=48, modes=('train',))]
