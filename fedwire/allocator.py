"""glibc's allocator, set for processes that stream a model in 1 MiB messages.

A fetch or push is a stream of ≈1 MiB gRPC messages, and each is a few buffers of about that
size (gRPC's receive slices, the ``bytes`` handed to the deserializer) that live until the next
message. By default glibc gives such blocks fresh pages (its mmap threshold starts at 128 KiB)
or returns the top of the heap to the kernel as soon as 2-4 MiB of it is free, so every message
faults its pages in, zeroed, again: a page fault per 4 KiB of every message. With blocks up to
:data:`MMAP_THRESHOLD` served from the heap and up to :data:`TRIM_THRESHOLD` of free heap kept,
the next message reuses the last one's pages, and what still faults is mostly the model's own
new arrays (``benchmarks/transport.py`` prints page faults per fetch).

The cost is memory a process keeps after a transfer: at most ``TRIM_THRESHOLD`` of free heap
per malloc arena. glibc gives each new thread an arena of its own, up to 8 per core, and each
keeps its own free heap and fragments: a server's pool of RPC threads multiplies both. Python
threads allocate under the GIL, so :data:`ARENA_MAX` arenas cost no contention. Where a process
has just freed a model's worth of blocks (the aggregator after storing an update, after a
close's fold), :func:`release_free_memory` hands the free pages back at once.

Entry points call :func:`reuse_message_buffers` once (``fedatoms aggregator serve``,
``fedatoms client run``, the simulation's workers); a library import never changes its host's
allocator. ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_ARENA_MAX`` in the
environment win: an operator who set them keeps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

__all__ = ["ARENA_MAX", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "release_free_memory", "reuse_message_buffers"]

log = logging.getLogger("fedwire.allocator")

# above a message's buffers (≤ 1 MiB of chunk data, plus headers), and no higher than numpy's
# huge-page threshold (4 MiB): arrays that large keep their own mappings, which numpy asks to back
# with huge pages (8 MiB here made resnet18's 4.7 MB tensors fault in 4 KiB pages: 5,000 faults)
MMAP_THRESHOLD = 4 << 20
# several messages in flight (HTTP/2's flow-control window) plus the one being copied out
TRIM_THRESHOLD = 16 << 20
# the main arena and one more: threads that hold the GIL seldom contend for malloc's locks
ARENA_MAX = 2

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def reuse_message_buffers() -> bool:
    """Set glibc's mmap and trim thresholds (unless the environment sets them); ``False`` when the
    C library is not glibc (musl, macOS), whose allocators have neither knob."""
    libc = _glibc()
    if libc is None:
        log.info("event=allocator_unchanged reason=not_glibc library=%s", ctypes.util.find_library("c"))
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    chosen = {}
    for param, value, env in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"),
        (_M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX"),
    ):
        key = env.strip("_").lower().removeprefix("malloc_")
        if env in os.environ:
            chosen[key] = f"{os.environ[env]}(environment)"
            continue
        if mallopt(param, value) != 1:
            raise OSError(f"mallopt({param}, {value}) failed")
        chosen[key] = str(value)
    log.info("event=allocator_set %s", " ".join(f"{k}={v}" for k, v in chosen.items()))
    return True


def release_free_memory() -> None:
    """Give the kernel back every whole free page of the heap (glibc's ``malloc_trim(0)``), after work
    that freed a model's worth of blocks; nothing where the C library is not glibc."""
    global _RELEASE
    if _RELEASE is None:
        libc = _glibc()
        _RELEASE = libc.malloc_trim if libc is not None else (lambda pad: 0)
    _RELEASE(0)


_RELEASE: Any = None  # glibc's malloc_trim, looked up once


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc; ``None`` for musl (whose mallopt does nothing), macOS, or none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018  # glibc only
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return None
    return libc
