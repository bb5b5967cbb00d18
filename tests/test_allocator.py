"""fedwire.allocator: which mallopt calls ``reuse_message_buffers`` makes, what it leaves alone, what it returns.

The C library is replaced by a recorder, so these tests assert our calls, not glibc's behaviour.
The expected parameters are glibc's ``<malloc.h>`` numbers written out: ``M_TRIM_THRESHOLD`` is
−1, ``M_MMAP_THRESHOLD`` is −3 and ``M_ARENA_MAX`` is −8; the values are 4 MiB = 4,194,304 and
16 MiB = 16,777,216 bytes, and 2 arenas. The last tests ask the real glibc what it did.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from fedwire import allocator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
FOUR_MIB, SIXTEEN_MIB = 4_194_304, 16_777_216
ALL = [(M_MMAP_THRESHOLD, FOUR_MIB), (M_TRIM_THRESHOLD, SIXTEEN_MIB), (M_ARENA_MAX, 2)]


class FakeLibc:
    """A C library whose ``mallopt`` records its calls and answers ``result`` (1 is glibc's success)."""

    def __init__(self, glibc: bool = True, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return result

        self.mallopt = mallopt
        self.malloc_trim = lambda pad: 1
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.36"


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    return fake


def test_sets_the_mmap_then_the_trim_threshold_then_the_arenas(libc: FakeLibc) -> None:
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == ALL


def test_a_second_call_sets_the_same_values_again(libc: FakeLibc) -> None:
    assert allocator.reuse_message_buffers() is True
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == 2 * ALL


@pytest.mark.parametrize(
    ("variable", "skipped"),
    [
        ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD),
        ("MALLOC_ARENA_MAX", M_ARENA_MAX),
    ],
)
def test_an_operators_environment_setting_is_left_alone(
    libc: FakeLibc, monkeypatch: pytest.MonkeyPatch, variable: str, skipped: int
) -> None:
    monkeypatch.setenv(variable, "131072")
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == [c for c in ALL if c[0] != skipped]


def test_every_variable_set_means_no_call(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == []


def test_a_c_library_that_is_not_glibc_is_left_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    musl = FakeLibc(glibc=False)  # musl has a mallopt, but it does nothing
    monkeypatch.setattr(ctypes, "CDLL", lambda name: musl)
    assert allocator.reuse_message_buffers() is False
    assert musl.calls == []


def test_no_loadable_c_library_is_left_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert allocator.reuse_message_buffers() is False


def test_a_refused_setting_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = FakeLibc(result=0)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: refusing)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(OSError, match=r"mallopt\(-3, 4194304\) failed"):
        allocator.reuse_message_buffers()


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs a Linux/glibc host"
)
def test_the_real_glibc_accepts_every_setting() -> None:
    """In a fresh interpreter (the setting lasts for the process): the real mallopt answers 1 to each."""
    code = "from fedwire.allocator import reuse_message_buffers; print(reuse_message_buffers())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "True"


ARENAS = """
import ctypes, sys, threading
from fedwire.allocator import reuse_message_buffers
if sys.argv[1] == "set":
    reuse_message_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
together = threading.Barrier(8)
def allocate():
    block = libc.malloc(1 << 16)  # a thread's first malloc picks its arena
    together.wait()  # all alive at once: none hands its arena on to the next
    libc.free(block)
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()  # glibc's own report, on stderr: an "Arena N:" block per arena
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs a Linux/glibc host"
)
def test_eight_threads_share_two_arenas_instead_of_one_each() -> None:
    """glibc gives each new thread an arena of its own up to 8 per core; after ``reuse_message_buffers`` there
    are two, whatever the number of threads (counted by glibc's ``malloc_stats``)."""

    def arenas(mode: str) -> int:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
        run = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True, env=env)
        return sum(line.startswith("Arena ") for line in run.stderr.splitlines())

    assert arenas("set") == 2
    assert arenas("default") > 2


RELEASE = """
import ctypes
from fedwire.allocator import release_free_memory, reuse_message_buffers
reuse_message_buffers()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
blocks = [libc.malloc(256 << 10) for _ in range(64)]  # 16 MiB from the heap (under the mmap threshold)
for b in blocks:
    ctypes.memset(b, 1, 256 << 10)
for b in blocks[::2]:  # 32 holes between live blocks: none can merge into the heap's top and be trimmed
    libc.free(b)
freed = rss_kib()
release_free_memory()
print(freed - rss_kib())
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs a Linux/glibc host"
)
def test_freed_heap_blocks_go_back_to_the_kernel_only_when_released() -> None:
    """8 MiB freed in holes between live blocks stay resident (glibc keeps them for reuse);
    release_free_memory returns at least 6 MiB of them (the process's own VmRSS, before and after)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    run = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True, env=env)
    assert int(run.stdout) >= 6 * 1024
