"""Network helpers every part may use (stdlib only, no torch): a free TCP port."""

from __future__ import annotations

import socket

_WILDCARDS = ("0.0.0.0", "::", "")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (a wildcard host is probed on 127.0.0.1): for a rendezvous,
    an engine or a weight-update group when the config gives no port."""
    host = "127.0.0.1" if host in _WILDCARDS else host
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
