"""The capability profile a device registers with: declared in TOML, or measured on the spot.

The server turns the profile into a tier (:func:`fedcore.tiers.assign_tier`): the largest γ
whose forward MACs per sample and training memory fit. A measured profile times a
forward+backward pass of a reference convolution of known size, so ``compute_macs`` is
"how large a model this device trains within ``budget_ms`` per sample", and reads the memory
the kernel reports available, bounded by the memory cgroup's limit (a container's, a systemd unit's MemoryMax).
"""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import fields
from pathlib import Path, PurePosixPath

from fedcore.tiers import CapabilityProfile

__all__ = ["available_memory_bytes", "cgroup_headroom_bytes", "declared_profile", "measured_profile"]


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


def available_memory_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this process can still take: the smaller of MemAvailable (/proc/meminfo; else physical memory
    from sysconf) and its memory cgroup's headroom (limit − usage); None when unknown. A container limited to
    512 MiB on a 24 GB host is killed at 512 MiB, whatever the host has available."""
    host: int | None = None
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    if host is None:
        try:
            host = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            pass
    cgroup = cgroup_headroom_bytes(proc, cgroup_root)
    if host is None or cgroup is None:
        return cgroup if host is None else host
    return min(host, cgroup)


def cgroup_headroom_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit − usage of the tightest memory cgroup this process is in (its own or an ancestor's: a limit set
    above applies too), from ``proc``/self/cgroup; cgroup v2 (memory.max, memory.current) or v1's memory
    controller (memory.limit_in_bytes, memory.usage_in_bytes). None when no limit is set or none is readable."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    places = []  # (the hierarchy's mount, the cgroup's path in it, its limit file, its usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and path.startswith("/"):
            places.append((cgroup_root, path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            places.append((cgroup_root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    headroom: int | None = None
    for mount, path, limit_file, usage_file in places:
        here = PurePosixPath(path)
        for group in (here, *here.parents):  # a container sees its own cgroup as the mount's root
            directory = mount / str(group).lstrip("/")
            try:
                limit_text = (directory / limit_file).read_text().strip()
                usage = int((directory / usage_file).read_text())
            except (OSError, ValueError):
                continue
            try:
                limit = int(limit_text)
            except ValueError:  # v2's "max": no limit here
                continue
            if limit >= 1 << 60:  # v1's "no limit" (its largest page count, in bytes)
                continue
            left = max(0, limit - usage)
            headroom = left if headroom is None else min(headroom, left)
    return headroom


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
