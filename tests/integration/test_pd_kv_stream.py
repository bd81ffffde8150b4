"""KV streamed during the prefill (engine/pd/kv_stream.py), through a real cluster (service,
PREFILL and DECODE processes, etcd, tcp and ucx transfer, PUSH): prompts long enough to
span several chunks of the prefill's step budget give the greedy tokens of a MIX engine
chunking the same way; their finished chunks' blocks were pushed before the first token
(more than one push, the hand-over left with the rest) and every block exactly once; a
prompt under the threshold is handed over in one push; no pool keeps a block."""
from __future__ import annotations

import asyncio
import re

import pytest

from tests.integration.cluster_harness import Harness, client, metric, wait_drained
from tests.integration.test_tensor_parallel import MAX_TOKENS, _submit_all
from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
from xllm_py.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.integration

BLOCK = 8
CHUNK = 32  # the step budget: a 200-token prompt is 7 chunks
MIN_TOKENS = 64  # streams from here
PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(200)], [(11 * i) % 400 + 2 for i in range(130)],
           list(range(40, 63))]
_HANDED = re.compile(r"PD prefill handed request (\S+) to \S+: (\d+) blocks \((\d+) streamed")
_PUSH = re.compile(r"kv push req=(\S*) peer=\S+ blocks=(\d+)")


def _mix_reference() -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(block_size=BLOCK),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK,
                                                              max_num_seqs=8)))
    engine.start()
    try:
        return [s.token_ids for s in _submit_all(engine, PROMPTS, "ref")]
    finally:
        engine.stop()


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_streamed_prompts_equal_mix_and_move_each_block_once(etcd_server, tmp_path, backend):
    ref = _mix_reference()
    h = Harness(etcd_server.endpoint, f"pd-stream-{backend}/", tmp_path)
    common = ["--block-size", str(BLOCK), "--kv-cache-transfer-mode", "PUSH",
              "--kv-transfer-backend", backend, "--num-blocks", "128",
              "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8"]
    try:
        svc = h.service()
        prefill = h.engine("PREFILL", "prefill", extra=common,
                           settings={"kv_stream_min_tokens": MIN_TOKENS})
        decode = h.engine("DECODE", "decode", extra=common)
        for p in (prefill, decode):
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        c = client(svc)
        for prompt, tokens in zip(PROMPTS, ref):
            r = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == tokens, f"{len(prompt)} tokens"
        asyncio.run(wait_drained([prefill.http_url, decode.http_url], timeout_s=20))
        plog = prefill.log_path.read_text(errors="replace")
        handed = {rid: (int(n), int(streamed)) for rid, n, streamed in _HANDED.findall(plog)}
        pushes: dict[str, list[int]] = {}
        for rid, n in _PUSH.findall(plog):
            pushes.setdefault(rid, []).append(int(n))
        assert len(handed) == len(PROMPTS), plog[-3000:]
        by_len = {}
        for rid, (n, streamed) in handed.items():
            by_len[n] = (streamed, pushes[rid])
            assert sum(pushes[rid]) == n  # every block of the hand-over once
        print(f"\n{backend}: blocks handed -> (streamed before the first token, pushes) {by_len}")
        for prompt in PROMPTS:
            n = (len(prompt) + BLOCK - 1) // BLOCK
            streamed, sizes = by_len[n]
            if len(prompt) >= MIN_TOKENS:  # chunks went ahead; the last push is the rest
                assert 0 < streamed < n and len(sizes) >= 2 and sizes[-1] == n - streamed
            else:
                assert (streamed, sizes) == (0, [n])
        for e in (prefill, decode):
            assert metric(e.http_url, "xllm_kv_cache_blocks_used") == 0
    finally:
        h.stop()
