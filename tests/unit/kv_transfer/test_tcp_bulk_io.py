"""The TCP backend's bulk payload moves (kv_transfer/tcp.py): a blocking socket with a kernel
timeout (SO_SNDTIMEO / SO_RCVTIMEO), one call for the whole payload. They must move every
byte, end in TimeoutError when the peer stops, and hand the socket back as asyncio needs
it (non-blocking, no kernel timeout left)."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from xllm_py.kv_transfer.tcp import _blocking_recv_into, _blocking_sendall

PAYLOAD = 8 << 20  # far more than the socket buffers hold: the calls must wait for the peer


@pytest.fixture
def pair():
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
    for s in (a, b):
        s.setblocking(False)  # as the backend's asyncio sockets are
    yield a, b
    a.close()
    b.close()


def _kernel_timeouts(sock: socket.socket) -> tuple[bytes, bytes]:
    size = struct.calcsize("@ll")
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, size),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, size))


def _restored(sock: socket.socket) -> bool:
    zero = struct.pack("@ll", 0, 0)
    return not sock.getblocking() and _kernel_timeouts(sock) == (zero, zero)


def test_a_payload_larger_than_the_buffers_arrives_whole(pair):
    a, b = pair
    data = bytes(range(256)) * (PAYLOAD // 256)
    got = bytearray(PAYLOAD)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            _blocking_recv_into(b, memoryview(got), 10.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    _blocking_sendall(a, memoryview(data), 10.0)
    t.join(30)
    assert not t.is_alive() and not errors
    assert got == data
    assert _restored(a) and _restored(b)


def test_a_send_the_peer_never_reads_times_out(pair):
    a, _ = pair
    with pytest.raises(TimeoutError):
        _blocking_sendall(a, memoryview(bytes(64 << 20)), 0.2)
    assert _restored(a)


def test_a_receive_the_peer_stops_feeding_times_out(pair):
    a, b = pair
    a.sendall(b"x" * 1000)  # part of the payload, then nothing
    with pytest.raises(TimeoutError):
        _blocking_recv_into(b, memoryview(bytearray(PAYLOAD)), 0.2)
    assert _restored(b)


def test_a_peer_closing_mid_payload_is_a_connection_error(pair):
    a, b = pair
    a.setblocking(True)
    a.sendall(b"x" * 1000)
    a.close()
    with pytest.raises(ConnectionError):
        _blocking_recv_into(b, memoryview(bytearray(PAYLOAD)), 5.0)
