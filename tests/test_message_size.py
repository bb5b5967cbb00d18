"""A client's chunk size on a link that breaks: halved after a cut attempt that carried fewer than four chunks,
doubled back after a transfer without a cut, from 16 KiB to 1 MiB, always on a grid every later size shares."""

from __future__ import annotations

import pytest

from fedwire.flow_control import MessageSize, check_chunk_bytes

KIB = 1024


def test_halves_after_a_poor_attempt_and_doubles_back_after_a_clean_one() -> None:
    size = MessageSize()
    assert size.bytes == 1024 * KIB
    size.cut(0)  # nothing arrived: 1 MiB → 512 KiB
    size.cut(3 * 512 * KIB)  # three chunks of 512 KiB: fewer than four
    assert size.bytes == 256 * KIB
    size.cut(4 * 256 * KIB)  # four whole chunks: the size held
    assert size.bytes == 256 * KIB
    for _ in range(10):
        size.cut(0)
    assert size.bytes == 16 * KIB  # the floor
    for _ in range(10):
        size.completed()
    assert size.bytes == 1024 * KIB  # the ceiling


def test_every_size_a_client_can_reach_divides_every_larger_one() -> None:
    """A resume offset on an earlier attempt's grid is on every later, smaller one's."""
    size, seen = MessageSize(), []
    while not seen or seen[-1] != size.bytes:
        seen.append(size.bytes)
        size.cut(0)
    assert seen == [2**k for k in range(20, 13, -1)]
    assert all(check_chunk_bytes(s) == s for s in seen)


@pytest.mark.parametrize("bad", [0, -16384, 1000, 8192, 3 * 16384, 2 * 1024 * KIB])
def test_sizes_off_the_ladder_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="a power of two from 16384 to 1048576"):
        check_chunk_bytes(bad)
