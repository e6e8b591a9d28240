"""Recurrent layers (cuDNN-free CPU kernels; dropout between layers in train mode)."""

from __future__ import annotations

import torch
from torch import nn

from . import Entry, calls


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, num_layers=2, batch_first=True, dropout=0.25)
        self.head = nn.Linear(6, 2)

    def forward(self, x, state=None):
        out, (h, c) = self.lstm(x, state)
        return self.head(out), (h, c)


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 5, batch_first=True, bidirectional=True)

    def forward(self, x):
        out, h = self.gru(x)
        return out.sum(-1), h


class CellLoop(nn.Module):
    """An LSTMCell stepped in a Python loop over time."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)

    def forward(self, x):
        h = c = torch.zeros(x.shape[0], 4)
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1)


ENTRIES = [
    Entry("lstm", LSTMNet, calls(lambda: (torch.randn(2, 5, 4),),
                                 lambda: (torch.randn(2, 5, 4), (torch.randn(2, 2, 6), torch.randn(2, 2, 6))))),
    Entry("gru", GRUNet, calls(lambda: (torch.randn(2, 5, 4),))),
    Entry("lstm_cell_loop", CellLoop, calls(lambda: (torch.randn(2, 4, 3),))),
]
