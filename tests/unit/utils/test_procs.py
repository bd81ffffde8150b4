"""free_port: ports for children to listen on that nothing else takes in the meantime."""
from __future__ import annotations

import socket

from xllm_py.utils import procs


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [procs.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)  # bind(0) may hand the same port out twice
    assert all(1024 <= p < procs._ephemeral_low() for p in ports)
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        real = procs._rng.randrange
        first = [True]

        def pick(lo: int, hi: int) -> int:  # the busy port first, then as usual
            if first[0]:
                first[0] = False
                return taken
            return real(lo, hi)

        monkeypatch.setattr(procs._rng, "randrange", pick)
        port = procs.free_port()
        assert not first[0] and port != taken
