"""Listen addresses (``HOST:PORT``) of the aggregator and the dashboard, and whether one is loopback.

A module of its own, free of torch, so the dashboard (and its image) can validate its settings
without importing the aggregator's method.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "split_listen"]

_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as ``(host, port)``: the listen address of the aggregator and the dashboard."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen must be HOST:PORT (e.g. 127.0.0.1:50051 or [::]:50051), got {listen!r}")
    if int(port) > 65535:
        raise ValueError(f"listen's port must be 0–65535 (0: any free port), got {listen!r}")
    return host.strip("[]"), int(port)


def is_loopback(listen: str) -> bool:
    """Whether ``HOST:PORT`` only accepts connections from this machine."""
    host, _ = split_listen(listen)
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
