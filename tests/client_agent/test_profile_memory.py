"""`--measure` declares half the memory this process can take: the host's MemAvailable, bounded by its memory
cgroup's headroom. In a container with memory.max = 512 MiB on a 24 GB host it declared GBs, and was given a tier
whose training the kernel then killed.

The /proc and /sys/fs/cgroup files are written here, laid out as the kernel lays them out; each expected number
is worked out by hand from them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from client_agent.profile import available_memory_bytes

MiB = 2**20
HOST_AVAILABLE = 24 * 1024 * MiB  # MemAvailable of a 24 GiB host


def _proc(tmp_path: Path, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       32000000 kB\nMemFree:        1000000 kB\nMemAvailable:   {HOST_AVAILABLE // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _group(root: Path, path: str, **files: int | str) -> None:
    directory = root / path
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_a_container_limited_to_512_mib_counts_its_limit_not_the_host(tmp_path: Path) -> None:
    """cgroup v2 in a container: its own cgroup is the mount's root ("0::/")."""
    root = tmp_path / "cgroup"
    _group(root, "", memory_max=512 * MiB, memory_current=100 * MiB)
    assert available_memory_bytes(_proc(tmp_path, "0::/\n"), root) == 412 * MiB  # 512 - 100


def test_a_limit_on_an_ancestor_cgroup_bounds_it_too(tmp_path: Path) -> None:
    """A systemd unit with MemoryMax = 1 GiB in a slice limited to 800 MiB that others use: the slice's 100 MiB
    left is what this process can take."""
    root = tmp_path / "cgroup"
    _group(root, "system.slice", memory_max=800 * MiB, memory_current=700 * MiB)
    _group(root, "system.slice/fedatoms-client.service", memory_max=1024 * MiB, memory_current=300 * MiB)
    proc = _proc(tmp_path, "0::/system.slice/fedatoms-client.service\n")
    assert available_memory_bytes(proc, root) == 100 * MiB


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    """v1, in a container: /proc/self/cgroup names the host's path, the mount holds the container's group."""
    root = tmp_path / "cgroup"
    _group(root, "memory", memory_limit_in_bytes=512 * MiB, memory_usage_in_bytes=200 * MiB)
    _group(root, "cpu")
    proc = _proc(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert available_memory_bytes(proc, root) == 312 * MiB


@pytest.mark.parametrize(
    ("cgroup", "files"),
    [
        ("0::/user.slice\n", {"user.slice": {"memory_max": "max", "memory_current": 5 * MiB}}),  # v2: no limit
        ("4:memory:/\n0::/\n", {"memory": {"memory_limit_in_bytes": 9223372036854771712, "memory_usage_in_bytes": 1}}),
        ("0::/\n", {"": {"memory_max": 64 * 1024 * MiB, "memory_current": 1024 * MiB}}),  # more than the host has
        ("0::/\n", {}),  # no cgroup files at all (a host's root cgroup, another OS's layout)
    ],
)
def test_without_a_tighter_limit_the_host_memory_counts(tmp_path: Path, cgroup: str, files: dict) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    for path, values in files.items():
        _group(root, path, **values)
    assert available_memory_bytes(_proc(tmp_path, cgroup), root) == HOST_AVAILABLE
