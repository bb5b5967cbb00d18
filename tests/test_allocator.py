"""fedwire.allocator: a process that set it reuses the pages of 1 MiB message buffers.

Each case runs in its own interpreter, since the setting lasts for the whole process. The
pattern is a fetch's: several ≈1 MiB buffers alive at once (messages in flight), freed, then again.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt is Linux/glibc only"
)

_MESSAGES = r"""
import json, resource, sys
from fedwire.allocator import reuse_message_buffers
tuned = reuse_message_buffers() if sys.argv[1] == "tuned" else None
payload = memoryview(bytes(1 << 20))
def fetch():
    kept = [bytes(payload) for _ in range(8)]  # messages in flight, copied out of gRPC
    del kept
fetch()  # the first fetch grows the heap: its faults are not the point
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    fetch()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str, **env: str) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run(
        [sys.executable, "-c", _MESSAGES, mode], capture_output=True, text=True, check=True, env=environ
    )
    return json.loads(out.stdout)


PAGES_PER_FETCH = 8 * (1 << 20) // 4096  # every page of every message faulted in again


def test_tuned_process_reuses_message_pages() -> None:
    tuned = _faults("tuned")
    assert tuned["tuned"] is True
    assert tuned["faults"] < PAGES_PER_FETCH // 10, tuned  # 5 fetches: next to no fresh pages


def test_default_allocator_faults_every_message_in_again() -> None:
    """The reason for the setting: without it this pattern faults most pages of every fetch."""
    default = _faults("default")
    assert default["faults"] > 5 * PAGES_PER_FETCH // 2, default


def test_environment_settings_win() -> None:
    """An operator's MALLOC_MMAP_THRESHOLD_ is kept: here glibc's default 128 KiB, so the pages fault again."""
    kept = _faults("tuned", MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    assert kept["tuned"] is True
    assert kept["faults"] > 5 * PAGES_PER_FETCH // 2, kept
