"""Ports handed out to servers that bind them later: free now, and never the same one twice
in a process (a launcher draws all of its services' ports before any binds)."""

from __future__ import annotations

import random

import pytest

from libs import nats_server


class Repeating:
    """Draws `port` `times` times first, then at random."""

    def __init__(self, port: int, times: int) -> None:
        self.port, self.times = port, times

    def randint(self, low: int, high: int) -> int:
        self.times -= 1
        return self.port if self.times >= 0 else random.randint(low, high)


def test_a_port_is_handed_out_once_even_when_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = nats_server.free_port()  # free now, and not bound by anyone yet
    monkeypatch.setattr(nats_server, "_random", Repeating(first, times=5))
    assert nats_server.free_port() != first
