"""A MIX instance with TP 2 (two worker processes joined by gloo) generates what TP 1 and
Hugging Face transformers generate, token for token, with logprobs within 1e-4: the three
families, a batch of prompts crossing KV block boundaries, then a prefix-cache hit. The
engine process takes ``--tensor-parallel-size`` on its command line."""
from __future__ import annotations

import threading

import httpx
import pytest
import torch

from tests.integration.tp_models import FAMILIES, VOCAB, build_hf_model
from xllm_py.config import CacheConfig, EngineConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams
from xllm_py.utils.procs import engine_args, free_port, spawn

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

TOL = 1e-4
BLOCK = 4
MAX_TOKENS = 10


class _Sink:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.last = None

    def emit(self, output) -> None:
        for delta in output.outputs:
            self.token_ids += delta.token_ids
            self.logprobs += [lp.logprob for lp in delta.logprobs or []]
        if output.finished:
            self.last = output
            self.done.set()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 13, 21, 4)]


def _submit_all(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[_Sink]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    sinks = [_Sink() for _ in prompts]
    for i, (p, s) in enumerate(zip(prompts, sinks)):
        engine.submit(EngineRequest(f"{tag}{i}", p, params, s))
    for s in sinks:
        assert s.done.wait(120), "request timed out"
        assert not s.last.failed, s.last.error_message
        assert len(s.token_ids) == MAX_TOKENS == len(s.logprobs)
    return sinks


def _generate(model_dir, tp: int) -> tuple[list[_Sink], dict]:
    """The batch, then (after it finished) a prompt sharing the first one's 12 tokens."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp,
                                    num_threads=1, cache=CacheConfig(block_size=BLOCK,
                                                                     num_blocks=96)))
    engine.start()
    try:
        prompts = _prompts()
        sinks = _submit_all(engine, prompts, "batch")
        hits_before = engine.stats()["prefix_hit_tokens"]
        sinks += _submit_all(engine, [prompts[1][:12] + [1, 2, 3]], "hit")
        stats = engine.stats()
        stats["hits"] = stats["prefix_hit_tokens"] - hits_before
        return sinks, stats
    finally:
        engine.stop()


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1_and_transformers(family, tmp_path):
    hf = build_hf_model(transformers, family, tmp_path)
    tp1, stats1 = _generate(tmp_path, 1)
    tp2, stats2 = _generate(tmp_path, 2)
    prompts = _prompts()
    prompts.append(prompts[1][:12] + [1, 2, 3])
    for prompt, a, b in zip(prompts, tp1, tp2):
        ref_tokens, ref_logprobs = _hf_greedy(hf, prompt)
        assert b.token_ids == a.token_ids == ref_tokens
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < TOL
        assert max(abs(x - y) for x, y in zip(b.logprobs, ref_logprobs)) < TOL
    for stats in (stats1, stats2):
        assert stats["hits"] == 12  # three full blocks of the shared prefix
        assert stats["kv_blocks_used"] == 0


def test_engine_process_takes_the_flag(tmp_path):
    """``python -m xllm_py.engine --tensor-parallel-size 2`` over HTTP, against TP 1."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(100, 131))]
    ref, _ = _generate_tiny(prompts)
    port = free_port()
    proc = spawn("engine-tp2", "xllm_py.engine",
                 engine_args("MIX", port, extra=["--tensor-parallel-size", "2",
                                                 "--block-size", str(BLOCK)]),
                 tmp_path, http_url=f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready(240)
        for prompt, (tokens, logprobs) in zip(prompts, ref):
            r = httpx.post(f"{proc.http_url}/v1/completions", trust_env=False, timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == tokens
            got = choice["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(got, logprobs)) < TOL
        assert "tensor parallel: 2 ranks" in proc.log_tail(200)
    finally:
        assert proc.terminate() == 0
    assert "rank 1: stop" in proc.log_tail(200)  # the worker was told to stop, not killed


def _generate_tiny(prompts: list[list[int]]) -> tuple[list[tuple[list[int], list[float]]], dict]:
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(block_size=BLOCK)))
    engine.start()
    try:
        sinks = _submit_all(engine, prompts, "ref")
        return [(s.token_ids, s.logprobs) for s in sinks], engine.stats()
    finally:
        engine.stop()
