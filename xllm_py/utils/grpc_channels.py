"""ChannelPool: one grpc.aio channel per peer address, reused for every call."""
from __future__ import annotations

import grpc


class ChannelPool:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, addr: str) -> grpc.aio.Channel:
        channel = self._channels.get(addr)
        if channel is None:
            channel = grpc.aio.insecure_channel(addr)
            self._channels[addr] = channel
        return channel

    async def drop(self, addr: str) -> None:
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
