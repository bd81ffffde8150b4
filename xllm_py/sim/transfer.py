"""SimKVTransferBackend ('sim'): moves SimKVStorage blocks between engines over TCP.

One connection per operation. A frame is a 4-byte big-endian length and a JSON header,
followed by ``nbytes`` of payload where the header says so:
  pull: {"op": "pull", "runs"} -> {"ok", "nbytes"} + the peer's src blocks
  push: {"op": "push", "runs", "nbytes"} + our src blocks -> {"ok"}
  link: {"op": "ping"} -> {"ok"}
Every header carries the owner's transfer key ("key", base.py); without it the answer is
{"ok": false, "denied": true}. The serving side checks its own block ids (base.KVTransferBackend._check_remote_runs) and
refuses bad ones with {"ok": false, "invalid": true, "error"}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct

from xllm_py.kv_transfer.base import (NOT_LINKED, KVTransferBackend, Run, TransferError,
                                      runs_to_ids, split_addr)
from xllm_py.kv_transfer.factory import BackendKind, register_backend

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20


async def _send(writer: asyncio.StreamWriter, header: dict, payload: bytes = b"") -> None:
    body = json.dumps(header).encode()
    writer.write(_LEN.pack(len(body)) + body + payload)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> dict:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_HEADER:
        raise TransferError(f"sim: header of {n} bytes")
    return json.loads(await reader.readexactly(n))


class SimKVTransferBackend(KVTransferBackend):
    name = "sim"

    def __init__(self, storage, default_timeout_s: float = 30.0, host: str = "127.0.0.1",
                 port: int = 0, access_key: str | None = None) -> None:
        super().__init__(storage, default_timeout_s, access_key)
        self._host, self._port = host, port
        self._server: asyncio.AbstractServer | None = None

    async def _start_impl(self) -> str:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self._host}:{port}"

    async def _call(self, peer_addr: str, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        host, port = split_addr(peer_addr)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await _send(writer, {**header, "key": self.peer_key(peer_addr)}, payload)
            reply = await _recv(reader)
            if not reply.get("ok"):
                raise TransferError(f"sim: {reply.get('error', 'refused')}",
                                    invalid_argument=bool(reply.get("invalid")),
                                    denied=bool(reply.get("denied")))
            data = await reader.readexactly(reply.get("nbytes", 0))
            return reply, data
        finally:
            writer.close()

    async def _link_impl(self, peer_addr: str) -> None:
        await self._call(peer_addr, {"op": "ping"})

    async def _unlink_impl(self, peer_addr: str) -> None:
        pass  # (no connection is kept)

    async def _pull_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        _, data = await self._call(peer_addr, {"op": "pull", "runs": runs})
        self.storage.write_blocks(runs_to_ids(runs)[1], data)

    async def _push_impl(self, peer_addr: str, runs: list[Run], timeout: float) -> None:
        payload = self.storage.read_blocks(runs_to_ids(runs)[0])
        await self._call(peer_addr, {"op": "push", "runs": runs, "nbytes": len(payload)},
                         payload)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = await _recv(reader)
            if not self.admits(req.get("key")):
                await _send(writer, {"ok": False, "denied": True, "error": NOT_LINKED})
                return
            op = req.get("op")
            if op == "ping":
                await _send(writer, {"ok": True})
                return
            runs = [tuple(r) for r in req.get("runs", [])]
            checked = self._check_remote_runs(runs, side="src" if op == "pull" else "dst")
            if isinstance(checked, str):
                await _send(writer, {"ok": False, "invalid": True, "error": checked})
                return
            src, dst = checked
            if op == "pull":
                data = self.storage.read_blocks(src)
                await _send(writer, {"ok": True, "nbytes": len(data)}, data)
            elif op == "push":
                data = await reader.readexactly(int(req.get("nbytes", -1)))
                self.storage.write_blocks(dst, data)
                await _send(writer, {"ok": True})
            else:
                await _send(writer, {"ok": False, "error": f"unknown op {op!r}"})
                return
            self._stats["served"] += 1
        except (asyncio.IncompleteReadError, ConnectionError, ValueError,
                json.JSONDecodeError) as exc:
            logger.warning("sim transfer: bad request from a peer: %s", exc)
        finally:
            writer.close()

    async def _close_impl(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


register_backend(BackendKind.SIM, SimKVTransferBackend)
