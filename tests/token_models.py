"""Token-id models and data for the tests of integer inputs (``input_dtype = "int64"``): what a user federating a
next-token or text model writes, an ``nn.Embedding`` looking up LongTensor ids. Importable as ``token_models``
(the tests' folder is on ``sys.path``; spawned agents inherit it)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCAB = 12
SEQ = 8
CLASSES = 4


class TokenLSTM(nn.Module):
    """Embedding + LSTM + a linear head on the last step: a next-character model in miniature."""

    def __init__(self, num_classes: int = CLASSES, vocab: int = VOCAB, emb: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.head(h[:, -1])


def lstm(num_classes: int = CLASSES) -> nn.Module:
    return TokenLSTM(num_classes)


def embed_mlp(num_classes: int = 5, vocab: int = 50, emb: int = 8, seq: int = 6, hidden: int = 16) -> nn.Module:
    """Embedding, flattened, then two linears: its MACs per sample are the linears' alone (a lookup multiplies
    nothing), ``seq·emb·hidden + hidden·num_classes``."""
    return nn.Sequential(
        nn.Embedding(vocab, emb), nn.Flatten(), nn.Linear(seq * emb, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def _split(x: torch.Tensor, y: torch.Tensor) -> tuple[TensorDataset, TensorDataset]:
    k = int(0.8 * len(x))
    return TensorDataset(x[:k], y[:k]), TensorDataset(x[k:], y[k:])


def ids(n: int = 1000) -> tuple[TensorDataset, TensorDataset]:
    """LongTensor ids of ``SEQ`` tokens; the label is the last token's class (``token % CLASSES``), skewed so that
    one class is the majority: a model that reads its input beats the majority rate, one that does not cannot."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    heavy = torch.rand(n, generator=g) < 0.3
    x[heavy, -1] = 0  # class 0 more often than the others
    return _split(x, x[:, -1] % CLASSES)


def ids_as_floats() -> tuple[TensorDataset, TensorDataset]:
    """The same ids as float32 tensors: data a model of integer inputs refuses."""
    (x, y), (xt, yt) = (ds.tensors for ds in ids())
    return TensorDataset(x.float(), y), TensorDataset(xt.float(), yt)


def mlp(num_classes: int = CLASSES) -> nn.Module:
    """A model of float features of ``SEQ`` values: what token ids are refused for."""
    return nn.Sequential(nn.Linear(SEQ, 16), nn.ReLU(), nn.Linear(16, num_classes))
