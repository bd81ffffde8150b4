"""The TCP backend's bulk payload moves (kv_transfer/tcp.py): a blocking socket with a kernel
timeout (SO_SNDTIMEO / SO_RCVTIMEO), one call for the whole payload. They must move every
byte, end in TimeoutError when the peer stops, and hand the socket back as asyncio needs
it (non-blocking, no kernel timeout left). A deadline already spent ends them at once, and
the owner refuses a request whose timeout is not a positive number."""
from __future__ import annotations

import asyncio
import math
import socket
import struct
import threading

import pytest

from xllm_py.config import TransferConfig
from xllm_py.kv_transfer import create_backend
from xllm_py.kv_transfer.base import split_addr
from xllm_py.kv_transfer.kv_storage import KVCacheStorage
from xllm_py.kv_transfer.tcp import _blocking_recv_into, _blocking_sendall, recv_msg, send_msg

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


@pytest.mark.parametrize("timeout", [0.0, 1e-7, -0.5])
def test_a_deadline_already_spent_times_out_at_once(pair, timeout):
    a, b = pair
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            _blocking_recv_into(b, memoryview(bytearray(PAYLOAD)), timeout)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=receive, daemon=True)  # (a thread that never returns: daemon)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a spent deadline left the receive waiting without limit"
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError), errors
    assert _restored(b)
    with pytest.raises(TimeoutError):
        _blocking_sendall(a, memoryview(bytes(64 << 20)), timeout)
    assert _restored(a)


async def test_the_owner_refuses_a_request_without_a_positive_timeout():
    storage = KVCacheStorage(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    owner = create_backend("tcp", storage, TransferConfig(timeout_s=5.0))
    owner.start()
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(split_addr(owner.address))
    sock.setblocking(False)
    try:
        await send_msg(loop, sock, {"op": "hello", "key": ""})
        assert (await asyncio.wait_for(recv_msg(loop, sock), 5))["ok"]
        for bad in (0, -1.0, math.nan, "soon"):
            await send_msg(loop, sock, {"op": "pull", "runs": [[0, 0, 1]], "timeout": bad})
            rep = await asyncio.wait_for(recv_msg(loop, sock), 5)
            assert not rep["ok"] and "timeout must be a positive number" in rep["error"], bad
        # the connection still serves a request with a timeout
        await send_msg(loop, sock, {"op": "pull", "runs": [[0, 0, 1]], "timeout": 5.0})
        rep = await asyncio.wait_for(recv_msg(loop, sock), 5)
        assert rep == {"ok": True, "nbytes": storage.block_bytes}
    finally:
        sock.close()
        owner.close_sync()
