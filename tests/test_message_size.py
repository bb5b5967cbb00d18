"""A link's chunk size: halved after an attempt that broke under way carrying fewer than four chunks, doubled
back after a transfer without a cut, from 16 KiB to 1 MiB, never growing within one transfer."""

from __future__ import annotations

import pytest

from fedwire.flow_control import MessageSize, check_chunk_bytes

KIB = 1024


def test_halves_after_a_poor_attempt_and_doubles_back_after_a_clean_one() -> None:
    size = MessageSize()
    assert size.next() == 1024 * KIB
    size.cut(0, 1024 * KIB)  # nothing arrived: 1 MiB → 512 KiB
    size.cut(3 * 512 * KIB, 512 * KIB)  # three chunks of 512 KiB: fewer than four
    assert size.bytes == 256 * KIB
    size.cut(4 * 256 * KIB, 256 * KIB)  # four whole chunks: the size held
    assert size.bytes == 256 * KIB
    for _ in range(10):
        size.cut(0, size.bytes)
    assert size.bytes == 16 * KIB  # the floor
    for _ in range(10):
        size.completed()
    assert size.bytes == 1024 * KIB  # the ceiling


def test_a_transfer_never_grows_its_size_when_another_on_the_link_completes() -> None:
    """Clients sharing a channel share the size; a transfer resuming at 16 KiB must not be asked to go on at 32
    KiB (its resume offset would be off that grid) because a sibling finished a clean transfer meanwhile."""
    link = MessageSize()
    mine = link.next()
    link.cut(0, mine)
    mine = link.next(mine)
    assert mine == 512 * KIB
    link.completed()  # the sibling
    assert link.bytes == 1024 * KIB and link.next(mine) == 512 * KIB
    mine = link.cut(0, mine)  # and a cut halves the transfer's own size, whatever the sibling did
    link.completed()
    assert mine == 256 * KIB and link.next(mine) == 256 * KIB
    link.cut(0, 64 * KIB)  # a cut of another transfer at a smaller size lowers the link's size for all
    assert link.next(mine) == 32 * KIB


def test_every_size_a_client_can_reach_divides_every_larger_one() -> None:
    """A resume offset on an earlier attempt's grid is on every later, smaller one's."""
    size, seen = MessageSize(), []
    while not seen or seen[-1] != size.bytes:
        seen.append(size.bytes)
        size.cut(0, size.bytes)
    assert seen == [2**k for k in range(20, 13, -1)]
    assert all(check_chunk_bytes(s) == s for s in seen)


@pytest.mark.parametrize("bad", [0, -16384, 1000, 8192, 3 * 16384, 2 * 1024 * KIB])
def test_sizes_off_the_ladder_are_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="a power of two from 16384 to 1048576"):
        check_chunk_bytes(bad)
