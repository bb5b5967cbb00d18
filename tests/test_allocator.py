"""fedwire.allocator: which mallopt calls ``reuse_message_buffers`` makes, what it leaves alone, what it returns.

The C library is replaced by a recorder, so these tests assert our calls, not glibc's behaviour.
The expected parameters are glibc's ``<malloc.h>`` numbers written out: ``M_TRIM_THRESHOLD`` is
−1 and ``M_MMAP_THRESHOLD`` is −3; the values are 4 MiB = 4,194,304 and 16 MiB = 16,777,216 bytes.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from fedwire import allocator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
FOUR_MIB, SIXTEEN_MIB = 4_194_304, 16_777_216


class FakeLibc:
    """A C library whose ``mallopt`` records its calls and answers ``result`` (1 is glibc's success)."""

    def __init__(self, glibc: bool = True, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return result

        self.mallopt = mallopt
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.36"


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    return fake


def test_sets_the_mmap_then_the_trim_threshold(libc: FakeLibc) -> None:
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == [(M_MMAP_THRESHOLD, FOUR_MIB), (M_TRIM_THRESHOLD, SIXTEEN_MIB)]


def test_a_second_call_sets_the_same_values_again(libc: FakeLibc) -> None:
    assert allocator.reuse_message_buffers() is True
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == 2 * [(M_MMAP_THRESHOLD, FOUR_MIB), (M_TRIM_THRESHOLD, SIXTEEN_MIB)]


@pytest.mark.parametrize(
    ("variable", "left_call"),
    [
        ("MALLOC_MMAP_THRESHOLD_", (M_TRIM_THRESHOLD, SIXTEEN_MIB)),
        ("MALLOC_TRIM_THRESHOLD_", (M_MMAP_THRESHOLD, FOUR_MIB)),
    ],
)
def test_an_operators_environment_setting_is_left_alone(
    libc: FakeLibc, monkeypatch: pytest.MonkeyPatch, variable: str, left_call: tuple[int, int]
) -> None:
    monkeypatch.setenv(variable, "131072")
    assert allocator.reuse_message_buffers() is True
    assert libc.calls == [left_call]


def test_both_variables_set_means_no_call(libc: FakeLibc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
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
def test_the_real_glibc_accepts_both_settings() -> None:
    """In a fresh interpreter (the setting lasts for the process): the real mallopt answers 1 to both."""
    code = "from fedwire.allocator import reuse_message_buffers; print(reuse_message_buffers())"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "True"
