"""fuzz_opaque_root_container_entry_replaced: a root that runs opaque (it counts its calls, a Python
side effect) calls its ModuleList's blocks; the script replaces one entry (``m.c0[0] = B0()``)
between calls. The opaque root runs with its children swapped for their graphs' dispatchers, found
through the ModuleList's registry when it was extracted, and no guard covered that registry: a
PatchableGraph kept calling the old block's graph (found by tests/corpus/test_fuzz.py, seed 25,
shrunk by hand: the seed's programs also set ``m.alpha`` and threaded a transformers cache).

Program(blocks=(Block(arity=1, body=0, inner=None, alpha=False),), children=(Child(kind='list', blocks=(0, 0)),), stmts=(Stmt(kind='loop', args=(0, 0), child=0, style='pos'), Stmt(kind='counter', args=(1,), child=0, style='pos')), output=('one', (2,)), script=(Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='swap_child', grad=True, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0), Step(kind='call', grad=False, input_grad=False, rows=2, child=0, entry=0, block=0, value=2.0)), modes=('train',))
"""


import torch
from torch import nn

from corpus import Call, Edit, Entry
from corpus.program_parts import ProgramRoot


class B0(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Root(ProgramRoot):
    def __init__(self):
        super().__init__()  # the state every program's root has (corpus.program_parts)
        self.c0 = nn.ModuleList([B0(), B0()])

    def forward(self, v0):
        v1 = v0
        for b in self.c0:
            v1 = b(v1)
        self.calls += 1
        v2 = v1 * self.calls
        return v2


def edit0(m):
    m.c0[0] = B0()


def script():
    return [
        Call((torch.randn(2, 4),), grad=False),
        Call((torch.randn(2, 4),), grad=False),
        Edit(edit0),
        Call((torch.randn(2, 4),), grad=False),
    ]


ENTRIES = [Entry('fuzz_opaque_root_container_entry_replaced', Root, script, item=48, modes=('train',),
                 attrs=lambda m: m.calls)]
