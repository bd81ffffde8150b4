"""The service relays what a prompt-scoring request needs: the prefill's prompt logprobs
(once, even when n is split into sub-requests that each computed them) and stop_reason."""
from __future__ import annotations

import asyncio

from tests.unit.service.test_service_relay import backend, info
from xllm_py.config import InstanceRole
from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob
from xllm_service.router import Route
from xllm_service.sub_request import SubRequest


async def test_merge_relays_prompt_logprobs_once_and_keeps_stop_reason():
    b = backend()
    route = Route(info("p", InstanceRole.PREFILL), info("d", InstanceRole.DECODE))
    queue: asyncio.Queue = asyncio.Queue()
    subs = [SubRequest(f"r-{i}", i, route, queue) for i in range(2)]
    plp = [None, TokenLogprob(7, -1.25, [(3, -0.5), (7, -1.25)])]
    for i, sub in enumerate(subs):  # each sub's first output (from its prefill) has them
        queue.put_nowait((sub, RequestOutput(
            f"r-{i}", outputs=[CompletionDelta(0, token_ids=[5])], prompt_token_ids=[1, 7],
            prompt_logprobs=plp)))
    for i, (sub, reason) in enumerate(zip(subs, ["\n", 42])):
        queue.put_nowait((sub, RequestOutput(f"r-{i}", finished=True, outputs=[CompletionDelta(
            0, token_ids=[6], finish_reason="stop", stop_reason=reason)])))
    merged = [out async for out in b._merge("r", subs, queue)]
    assert [o.prompt_logprobs for o in merged] == [plp, None, None, None]
    assert [o.prompt_token_ids for o in merged] == [[1, 7], None, None, None]
    assert [(d.index, d.stop_reason) for o in merged[2:] for d in o.outputs] == [(0, "\n"), (1, 42)]
    assert merged[-1].finished
