"""A GPU machine as far as choosing a device goes, on a machine without a GPU: which device a computation ran on.

Under :func:`pretend_cuda` ``torch.cuda.is_available()`` says yes, so ``auto`` picks CUDA, and whatever then
puts a tensor there fails (no driver): a training or an evaluation that finishes ran on the device it was
told, not on ``auto``'s choice. Nothing of this project's own is replaced, only torch's answer about the
hardware. On a machine with a real GPU the pretence is the truth and proves nothing: :data:`NEEDS_NO_GPU`.
"""

from __future__ import annotations

import pytest
import torch

#: read once, before any test pretends
REAL_CUDA = torch.cuda.is_available()
NEEDS_NO_GPU = pytest.mark.skipif(REAL_CUDA, reason="a real GPU: auto's CUDA would work, and prove nothing")
#: what using CUDA raises where there is none: no driver (a CUDA build of torch), or no CUDA compiled in
NO_CUDA_ERRORS = (RuntimeError, AssertionError)


def pretend_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the test ends, torch says CUDA is available (``auto`` resolves to it); using it still fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
