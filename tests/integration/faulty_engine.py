"""python -m tests.integration.faulty_engine FAULT ENGINE_ARGS...: an engine process (the
main of python -m xllm_py.engine) with a fault installed, for the failure tests. Test
code only: the engine itself has no fault switch.

  fail-transfers            every KV move this engine makes (a prefill's push, a decode's
                            pull) fails as a broken transfer does (BAD_GATEWAY); its other
                            RPCs to peers go through
  exit-at-first-generation  a DECODE exits (status EXIT_STATUS) when a hand-over reaches
                            it (FirstGeneration: between AddNewRequests and the take-over,
                            the window a crash may hit)
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

from xllm_py.engine.__main__ import main
from xllm_py.engine.pd.handlers import DecodeHandler
from xllm_py.engine.pd.role import PDRole
from xllm_py.pd_messages import HandOver, KVMove
from xllm_py.status import Status, StatusError

logger = logging.getLogger(__name__)

EXIT_STATUS = 17


class FailingTransfers:
    """PDPeers (engine/pd/peers.py) whose KV moves fail; every other call goes to the
    real ones."""

    def __init__(self, peers) -> None:
        self._peers = peers

    def __getattr__(self, name: str):
        return getattr(self._peers, name)

    async def push_kv(self, move: KVMove) -> None:
        raise StatusError(Status.BAD_GATEWAY, "KV push failed: injected fault")

    async def pull_kv(self, move: KVMove) -> None:
        raise StatusError(Status.BAD_GATEWAY, "KV pull failed: injected fault")


def fail_transfers() -> None:
    """Every PDRole built in this process moves KV through FailingTransfers."""
    build = PDRole.__init__
    signature = inspect.signature(build)

    def init(*args, **kwargs) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["peers"] = FailingTransfers(bound.arguments["peers"])
        build(*bound.args, **bound.kwargs)

    PDRole.__init__ = init


def exit_at_first_generation() -> None:
    async def first_generation(self, handovers: list[HandOver]) -> list[str]:
        logger.error("fault installed: exiting at FirstGeneration")
        os._exit(EXIT_STATUS)

    DecodeHandler.first_generation = first_generation


FAULTS = {"fail-transfers": fail_transfers, "exit-at-first-generation": exit_at_first_generation}

if __name__ == "__main__":
    FAULTS[sys.argv[1]]()
    sys.exit(main(sys.argv[2:]))
