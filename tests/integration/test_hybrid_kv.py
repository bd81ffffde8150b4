"""The hybrid KV cache (engine/hybrid_kv.py) on a small random Gemma 3 whose window (6
tokens) is shorter than two blocks of 4, against transformers: greedy tokens of a MIX
engine whose prompt chunks straddle the window, then a prefix-cache hit past the window,
and a hit whose blocks head the free queue of a small pool;
a PD pair (PULL and PUSH, equal and different TP) gives the same tokens while its hand-overs move only the
sliding layers' window; every pool returns to 0 blocks."""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from tests.integration.cluster_harness import Harness, client, wait_drained
from tests.integration.test_tensor_parallel import _hf_greedy, _submit_all
from tests.integration.tp_models import VOCAB, save_random_checkpoint
from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
from xllm_py.engine.llm_engine import LLMEngine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

BLOCK = 4
WINDOW = 6
LAYERS = ["sliding_attention", "sliding_attention", "full_attention",
          "sliding_attention", "sliding_attention", "full_attention"]


def _config():
    return transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=len(LAYERS), num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, intermediate_size=128, vocab_size=VOCAB,
        initializer_range=0.05, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        max_position_embeddings=256, sliding_window=WINDOW, layer_types=LAYERS,
        query_pre_attn_scalar=16, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _bytes_moved(url: str) -> int:
    """xllm_kv_transfer_bytes_total of an engine, summed over its labels."""
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return int(sum(float(v) for v in re.findall(
        r"^xllm_kv_transfer_bytes_total\{[^}]*\} (\S+)$", text, re.M)))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 23, 37)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(model dir, the prompts and a prompt sharing 28 tokens of the last, HF greedy)."""
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    hf = save_random_checkpoint(transformers, _config(), path)
    prompts = _prompts()
    prompts.append(prompts[3][:28] + [1, 2, 3])
    return path, prompts, [_hf_greedy(hf, p)[0] for p in prompts]


def test_mix_chunks_and_hit_past_the_window_equal_transformers(gemma):
    path, prompts, expected = gemma
    engine = LLMEngine(EngineConfig(
        model=str(path), num_threads=1, cache=CacheConfig(block_size=BLOCK, num_blocks=200),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10)))  # chunks straddle the window
    engine.start()
    try:
        assert engine.kv_groups.group_windows == (0, WINDOW, WINDOW)
        assert engine.storage.num_layers == 2  # two cache tensors, not six
        got = [s.token_ids for s in _submit_all(engine, prompts[:4], "batch")]
        hits = engine.stats()["prefix_hit_tokens"]
        got += [s.token_ids for s in _submit_all(engine, prompts[4:], "hit")]
        stats = engine.stats()
        assert got == expected
        assert stats["prefix_hit_tokens"] - hits == 28  # 7 blocks, past the window of 6
        assert stats["kv_blocks_used"] == 0
    finally:
        engine.stop()


def test_hit_at_the_free_queue_head_is_not_handed_out_again(gemma):
    """A pool of 40 blocks of 4, one request at a time: A's blocks are freed before C's,
    so A's cached ones head the free queue when B (A's 16 tokens and 8 more) hits them;
    B's new blocks must not be taken from its own hit (they would be written over while
    read as the prefix: wrong tokens). Every answer is transformers' greedy one."""
    path = gemma[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(5)
    a, c, new = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (16, 16, 8))
    prompts = {"a": a, "c": c, "b": a + new}
    engine = LLMEngine(EngineConfig(
        model=str(path), num_threads=1, cache=CacheConfig(block_size=BLOCK, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=1)))
    engine.start()
    try:
        got = {k: _submit_all(engine, [p], k)[0].token_ids for k, p in prompts.items()}
        assert engine.stats()["prefix_hit_tokens"] == 16  # B took A's 4 blocks
        assert got == {k: _hf_greedy(hf, p)[0] for k, p in prompts.items()}
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("mode,p_tp,d_tp", [("PULL", 1, 1), ("PUSH", 1, 1), ("PULL", 2, 1),
                                            ("PUSH", 1, 2)])
def test_pd_hands_over_the_window_and_equals_transformers(etcd_server, tmp_path, gemma, mode,
                                                          p_tp, d_tp):
    path, prompts, expected = gemma
    h = Harness(etcd_server.endpoint, f"hybrid-{mode}{p_tp}{d_tp}/", tmp_path)
    common = ["--model", str(path), "--block-size", str(BLOCK), "--num-blocks", "200",
              "--kv-cache-transfer-mode", mode]
    try:
        svc = h.service(extra=["--model", str(path)])
        prefill = h.engine("PREFILL", "prefill", extra=[*common, "--tp", str(p_tp)])
        decode = h.engine("DECODE", "decode", extra=[*common, "--tp", str(d_tp)])
        for p in (prefill, decode):
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        c = client(svc)
        for prompt, tokens in zip(prompts[:4], expected):
            r = c.completions.create(model=path.name, prompt=prompt, max_tokens=len(tokens),
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == tokens, f"{len(prompt)} tokens"
        asyncio.run(wait_drained([prefill.http_url, decode.http_url], timeout_s=20))
        # per prompt: its blocks for the full group, the window's (<= 2) for each of two
        # sliding groups; a whole-context layout would move 3 x its blocks
        blocks = decode.log_path.read_text(errors="replace").count("PD decode took over")
        assert blocks == 4
        moved = _bytes_moved(decode.http_url if mode == "PULL" else prefill.http_url)
        block_bytes = 2 * 2 * BLOCK * 1 * 16 * 4  # K and V, 2 slots, 1 head of 16, float32
        full = sum(-(-len(p) // BLOCK) for p in prompts[:4])
        sliding = sum(len(range(max(0, len(p) - WINDOW + 1) // BLOCK, -(-len(p) // BLOCK)))
                      for p in prompts[:4])
        # (one KV head: every decode rank holds it, and receives it)
        assert moved == (full + 2 * sliding) * block_bytes * d_tp < 3 * full * block_bytes * d_tp
    finally:
        h.stop()
