"""Whether an error is the device running out of memory: the agent then stops with one line and exit code 6
rather than restarting into the same failure (the tier is fixed at enrollment)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

__all__ = ["out_of_memory"]


#: what torch says when an allocation failed: c10's CPU allocator, and ENOMEM's strerror (a failed mmap)
_ALLOCATION_FAILED = ("DefaultCPUAllocator: can't allocate memory", "Cannot allocate memory")
#: oneDNN's error for any primitive it could not create; its status (out of memory, unimplemented…) is lost
_ONEDNN_FAILED = "could not create a primitive"


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: MemoryError, torch's OutOfMemoryError (a GPU's), or an error
    that says so. oneDNN's "could not create a primitive" does not say why, so it counts only when this process is
    at a memory limit that fails allocations (where a new primitive's memory is what could not be had)."""
    if isinstance(exc, MemoryError | getattr(torch, "OutOfMemoryError", MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(m in text for m in _ALLOCATION_FAILED) or (_ONEDNN_FAILED in text and _at_memory_limit())


def _at_memory_limit(margin: float = 0.1) -> bool:
    """Within ``margin`` of a limit (at least 64 MiB) that makes an allocation fail rather than the OOM killer act:
    RLIMIT_DATA on VmData, RLIMIT_AS on VmSize, strict overcommit's CommitLimit on Committed_AS (Linux)."""
    import resource

    def kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
        found = {}
        with contextlib.suppress(OSError, ValueError, IndexError), open(path) as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1]) * 1024
        return found

    def near(limit: int, used: int | None) -> bool:
        return used is not None and limit - used < max(64 * 2**20, margin * limit)

    status = kib("/proc/self/status", ("VmData", "VmSize"))
    for which, key in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        soft = resource.getrlimit(which)[0]
        if soft != resource.RLIM_INFINITY and near(soft, status.get(key)):
            return True
    with contextlib.suppress(OSError):
        if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
            meminfo = kib("/proc/meminfo", ("CommitLimit", "Committed_AS"))
            if "CommitLimit" in meminfo and near(meminfo["CommitLimit"], meminfo.get("Committed_AS")):
                return True
    return False
