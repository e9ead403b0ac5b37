"""``slimectl.contract.net.free_port``: a port below the kernel's ephemeral range where it can be read (a port the
kernel handed out and freed can be taken by any outgoing connection before its user binds it), free to bind."""

from __future__ import annotations

import socket

from slimectl.contract.net import BELOW_EPHEMERAL, _ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    for port in ports:
        if low is not None and low - BELOW_EPHEMERAL >= 1024:
            assert low - BELOW_EPHEMERAL <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert len(ports) > 1  # drawn, not one fixed port


def test_a_taken_port_is_never_returned():
    low = _ephemeral_low() or 32768
    taken = []
    try:
        for port in range(low - BELOW_EPHEMERAL, low - BELOW_EPHEMERAL + 200):  # the first 200 it may draw from
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
                taken.append(s)
            except OSError:
                s.close()
        held = {s.getsockname()[1] for s in taken}
        for _ in range(50):
            assert free_port() not in held
    finally:
        for s in taken:
            s.close()
