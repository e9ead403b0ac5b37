"""Network helpers every part may use (stdlib only, no torch): a free TCP port."""

from __future__ import annotations

import socket

_WILDCARDS = ("0.0.0.0", "::", "")


#: How many ports below the kernel's ephemeral range :func:`free_port` draws from.
BELOW_EPHEMERAL = 10000


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (a wildcard host is probed on 127.0.0.1): for a rendezvous,
    an engine or a weight-update group when the config gives no port. Drawn below the kernel's ephemeral range
    where it can be read: a port the kernel handed out (port 0) and that is free again can be taken by any
    outgoing connection before its user binds it (a rendezvous failed with EADDRINUSE that way)."""
    import random

    host = "127.0.0.1" if host in _WILDCARDS else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low is not None and low - BELOW_EPHEMERAL >= 1024:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(low - BELOW_EPHEMERAL, low)
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    return _bind_any(host, family)


def _bind_any(host: str, family: int = socket.AF_INET) -> int:
    """A port the kernel picks free on ``host`` (port 0), closed again at once."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
