"""KVStream: one PUSH request's prompt KV moving to its decode while later chunks compute.

A long prompt is computed in chunks (chunked prefill); after each step that computed a
chunk, the connector (connector.py, a step observer of the prefill's engine) reports the
request's block table and tokens computed. Every block wholly computed is final: the
engine never writes it again while the request runs. The stream pushes those blocks into
the decode's blocks set aside for them, one push at a time per request (a pump task that
takes whatever became final meanwhile, so a slow link coalesces chunks instead of
queueing pushes), and every push holds one of the side's ``slots``: the pushes in flight
are bounded, and they run on the event loop and the transfer backend's thread, never on
the engine thread. At the first token the hand-over awaits the stream and pushes only
what it did not: the last chunk's blocks.

Whatever may have made a pushed block stale sends the whole prompt again at the hand-over
(``in_place`` answers 0): a preemption (its blocks were freed, maybe reused), a failed
push, or a table whose pushed part changed. The decode reads none of its blocks before
FirstGeneration, which comes after the last push, so a partially filled block is never
read. A hybrid model streams its KV group 0 (full attention: every prompt block, the
first part of the hand-over's blocks, handover_block_ids); its sliding groups' blocks,
the window's, are only known at the end of the prompt and go with the last push.

States (its flags) and what moves them:

  from                 event                                        to
  STREAMING            computed(): blocks became final              STREAMING (the pump
                                                                    pushes them)
  STREAMING            preempted(), a changed table, a failed push  STALE (no more pushes)
  STREAMING | STALE    settle() (cancel, failure, the hand-over)    STOPPED (the push in
                       or finish() (the first token)                flight awaited)

finish() answers the blocks in place: those pushed, 0 from STALE.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

# (our blocks, the decode's blocks): one push of the side's peers
Push = Callable[[list[int], list[int]], Awaitable[None]]


class KVStream:
    def __init__(self, request_id: str, push: Push, decode_blocks: list[int],
                 first_block: int, block_size: int, slots: asyncio.Semaphore,
                 spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        """``first_block``: the prompt's first block the decode lacks (the blocks before
        it the decode had cached); ``decode_blocks[i]`` receives our block
        ``first_block + i``."""
        self.request_id = request_id
        self._push = push
        self._decode_blocks = decode_blocks
        self._first = first_block
        self._block_size = block_size
        self._slots = slots
        self._spawn = spawn
        self._src: list[int] = []  # our blocks final so far, in the decode's order
        self._pushed = 0  # decode_blocks[:_pushed] written
        self._stale = False  # something may have made a pushed block wrong: all go again
        self._stopped = False
        self._task: asyncio.Task | None = None

    @property
    def pushed(self) -> int:
        return self._pushed

    def computed(self, table: list[int], num_computed: int) -> None:
        """A step computed the prompt up to ``num_computed`` tokens; ``table``: its blocks."""
        if self._stale or self._stopped:
            return
        final = min(num_computed // self._block_size - self._first, len(self._decode_blocks))
        if final <= len(self._src):
            return
        if table[self._first:self._first + len(self._src)] != self._src:
            self._go_stale("its block table changed")  # the blocks behind the pushed ones
            return
        self._src = list(table[self._first:self._first + final])
        if self._task is None or self._task.done():
            self._task = self._spawn(self._pump())

    def preempted(self) -> None:
        """The engine freed the request's blocks: what was pushed may be stale."""
        self._go_stale("preempted")

    def _go_stale(self, why: str) -> None:
        if not self._stale:
            logger.info("KV stream of request %s: %s after %d blocks; the hand-over sends "
                        "every block", self.request_id, why, self._pushed)
        self._stale = True

    async def _pump(self) -> None:
        while not (self._stale or self._stopped) and self._pushed < len(self._src):
            lo, hi = self._pushed, len(self._src)
            try:
                async with self._slots:
                    await self._push(self._src[lo:hi], self._decode_blocks[lo:hi])
            except Exception as exc:  # the hand-over pushes everything again, and fails there
                logger.info("KV stream of request %s stopped after %d blocks: %s",
                            self.request_id, self._pushed, exc)
                self._stale = True
                return
            self._pushed = hi

    async def settle(self) -> None:
        """Wait for the push in flight (no more start)."""
        self._stopped = True
        if self._task is not None:
            await asyncio.shield(self._task)

    async def finish(self, handover_src: list[int]) -> int:
        """At the first token: wait for the pushes, then how many of the hand-over's
        blocks (``handover_src``, ours in the decode's order) are in place: a prefix of
        them, 0 when anything may be stale."""
        await self.settle()
        if self._stale or handover_src[:self._pushed] != self._src[:self._pushed]:
            return 0
        return self._pushed
