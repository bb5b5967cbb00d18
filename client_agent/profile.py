"""The capability profile a device registers with: declared in TOML, or measured on the spot.

The server turns the profile into a tier (:func:`fedcore.tiers.assign_tier`): the largest γ
whose forward MACs per sample and training memory fit. A measured profile times a
forward+backward pass of a reference convolution of known size, so ``compute_macs`` is
"how large a model this device trains within ``budget_ms`` per sample", and reads the memory
the kernel reports available.
"""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import fields
from pathlib import Path

from fedcore.tiers import CapabilityProfile

__all__ = ["declared_profile", "measured_profile"]


def declared_profile(path: str | Path, num_samples: int) -> CapabilityProfile:
    """A profile from a TOML file with CapabilityProfile's keys; ``num_samples`` is always the local data's."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    known = {f.name for f in fields(CapabilityProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown profile keys {sorted(unknown)}; known: {', '.join(sorted(known))}")
    # the sample count comes from the data the agent trains on, never from a declaration: the server
    # bounds every update's weight by what its client registered with
    data["num_samples"] = num_samples
    try:
        return CapabilityProfile(**data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else physical memory from sysconf; None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def measured_profile(
    num_samples: int,
    *,
    budget_ms: float = 20.0,
    memory_fraction: float = 0.5,
    device_name: str | None = None,
    repeats: int = 3,
    device: str = "cpu",
) -> CapabilityProfile:
    """Time a reference conv's training step on the ``device`` the agent trains on (``auto`` as training
    resolves it) and size the compute budget to ``budget_ms`` per sample; the memory is that device's."""
    import torch
    from torch import nn

    from fedcore.training import resolve_device

    dev = resolve_device(device)

    def settle() -> None:  # a GPU runs asynchronously: time the work, not its launch
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    conv = nn.Conv2d(32, 32, 3, padding=1).to(dev)
    x = torch.randn(8, 32, 32, 32, device=dev)
    macs = 8 * 32 * 32 * 32 * 32 * 9  # batch × H × W × out × in × k²
    conv(x).sum().backward()  # warm-up
    settle()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        conv(x).sum().backward()
        settle()
        best = min(best, time.perf_counter() - t0)
    # `best` trained `macs` forward MACs (forward + backward): a model of M MACs per sample trains one
    # sample in M · best / macs seconds, so it fits the budget when M ≤ macs / best · budget
    compute = macs / best * budget_ms / 1000.0
    memory = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_memory_bytes()
    return CapabilityProfile(
        device_name=device_name or os.uname().nodename,
        compute_macs=compute,
        memory_bytes=None if memory is None else int(memory * memory_fraction),
        num_samples=num_samples,
    )
