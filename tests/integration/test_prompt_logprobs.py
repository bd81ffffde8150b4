"""Prompt logprobs, max_tokens 0 and logit_bias through LLMEngine on real (tiny, random)
Llama / Qwen2 / Qwen3 checkpoints, against Hugging Face transformers: every prompt token's
logprob (log_softmax of HF's float32 logits) and its top-k, with a prefix-cache hit and
across a chunked prefill."""
from __future__ import annotations

import pathlib
import time

import pytest
import torch

from tests.integration.tp_models import save_random_checkpoint
from tests.unit.sinks import DoneSink
from xllm_py.config import CacheConfig, EngineConfig, SchedulerConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

VOCAB = 1024
TOL = 1e-4
TOP_K = 5

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, initializer_range=0.05,
               eos_token_id=None, bos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True),
}


def build_checkpoint(family: str, path: pathlib.Path):
    """The hf model of one family, random weights with non-trivial norms, saved (with a
    tokenizer) in `path`. Also used by test_http_scoring.py."""
    return save_random_checkpoint(transformers, FAMILIES[family](), path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(hf model, checkpoint dir) of one family."""
    path = tmp_path_factory.mktemp(request.param)
    return build_checkpoint(request.param, path), str(path)


def _engine(path: str, max_num_batched_tokens: int = 256) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=path, cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                                  batch_window_ms=0)))
    engine.start()
    return engine


def _submit(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> DoneSink:
    sink = DoneSink()
    engine.submit(EngineRequest(rid, prompt, params, sink))
    return sink


def _wait(*sinks: DoneSink, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for sink in sinks:
        assert sink.done.wait(max(0.0, deadline - time.monotonic())), "request did not finish"
        assert not sink.outputs[-1].failed, sink.outputs[-1].error_message


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row j is log_softmax of HF's float32 logits at position j."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_match_hf(hf, prompt: list[int], got) -> None:
    ref = _hf_logprobs(hf, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        entry = got[j]
        assert entry.token_id == prompt[j]
        assert abs(entry.logprob - ref[j - 1, prompt[j]].item()) < TOL, f"token {j}"
        values, ids = ref[j - 1].topk(TOP_K)
        assert [t for t, _ in entry.top] == ids.tolist(), f"top-k of token {j}"
        assert max(abs(v - r) for (_, v), r in zip(entry.top, values.tolist())) < TOL


def _prompt_logprobs(sink: DoneSink):
    first = sink.outputs[0]
    assert all(o.prompt_logprobs is None for o in sink.outputs[1:])
    return first.prompt_logprobs


def test_prompt_logprobs_equal_hf_with_and_without_a_prefix_hit(checkpoint):
    hf, path = checkpoint
    engine = _engine(path)
    try:
        prefix = _prompt(16, seed=1)
        warm = _submit(engine, "warm", prefix + _prompt(3, seed=2),
                       SamplingParams(max_tokens=2, temperature=0.0))
        _wait(warm)  # its 4 full prefix blocks are in the prefix cache now
        prompt = prefix + _prompt(7, seed=3)
        scored = _submit(engine, "scored", prompt,
                         SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP_K))
        _wait(scored)
        plain = _submit(engine, "plain", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        _wait(plain)
    finally:
        engine.stop()
    _assert_match_hf(hf, prompt, _prompt_logprobs(scored))
    # the scoring request recomputed the cached prefix; the same prompt without logprobs
    # then hits every full block of it (5 blocks of 4: the scoring request cached them too)
    assert scored.outputs[-1].num_cached_tokens == 0
    assert plain.outputs[-1].num_cached_tokens == 20
    assert plain.outputs[0].prompt_logprobs is None
    tokens = lambda sink: [t for o in sink.outputs for d in o.outputs for t in d.token_ids]  # noqa: E731
    assert tokens(scored) == tokens(plain)  # scoring changes nothing of the generation


def test_prompt_logprobs_equal_hf_across_a_chunked_prefill(checkpoint):
    hf, path = checkpoint
    engine = _engine(path, max_num_batched_tokens=8)  # 8-token chunks, decodes in between
    try:
        long_prompt = _prompt(29, seed=4)
        short_prompt = _prompt(5, seed=5)
        other = _submit(engine, "other", short_prompt,
                        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2))
        scored = _submit(engine, "scored", long_prompt,
                         SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_K))
        _wait(other, scored)
    finally:
        engine.stop()
    _assert_match_hf(hf, long_prompt, _prompt_logprobs(scored))
    short = _prompt_logprobs(other)
    ref = _hf_logprobs(hf, short_prompt)
    assert [abs(e.logprob - ref[j, short_prompt[j + 1]].item()) < TOL for j, e in
            enumerate(short[1:])] == [True] * 4
    assert all(len(e.top) == 2 for e in short[1:])


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(checkpoint):
    hf, path = checkpoint
    engine = _engine(path)
    try:
        prompt = _prompt(11, seed=6)
        sink = _submit(engine, "score", prompt,
                       SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=TOP_K, n=2))
        echo_only = _submit(engine, "echo", prompt, SamplingParams(max_tokens=0, echo=True))
        _wait(sink, echo_only)
        assert engine.scheduler.kv.block_pool.num_used_blocks == 0
    finally:
        engine.stop()
    (out,) = sink.outputs
    assert out.finished and out.num_generated_tokens == 0 and out.num_prompt_tokens == 11
    assert [(d.token_ids, d.finish_reason) for d in out.outputs] == [([], "length")] * 2
    _assert_match_hf(hf, prompt, out.prompt_logprobs)
    (echoed,) = echo_only.outputs
    assert echoed.prompt_logprobs is None and echoed.num_generated_tokens == 0
    assert echoed.outputs[0].finish_reason == "length"


def test_logit_bias_makes_and_removes_the_greedy_token(checkpoint):
    hf, path = checkpoint
    prompt = _prompt(9, seed=7)
    ref = _hf_logprobs(hf, prompt)[-1]
    best, second = ref.topk(2).indices.tolist()
    forced = int(ref.argmin())
    engine = _engine(path)
    try:
        def first_tokens(params: SamplingParams, rid: str) -> list[int]:
            sink = _submit(engine, rid, prompt, params)
            _wait(sink)
            return [t for o in sink.outputs for d in o.outputs for t in d.token_ids]

        greedy = dict(max_tokens=4, temperature=0.0)
        assert first_tokens(SamplingParams(**greedy), "plain")[0] == best
        assert first_tokens(SamplingParams(**greedy, logit_bias={forced: 100}), "up") == [forced] * 4
        assert first_tokens(SamplingParams(**greedy, logit_bias={best: -100}), "down")[0] == second
        # sampled: the biased-up token every time; the removed one is never drawn
        sampled = dict(max_tokens=4, temperature=1.0, seed=5)
        assert first_tokens(SamplingParams(**sampled, logit_bias={str(forced): 100}),
                            "s-up") == [forced] * 4
        two = dict(max_tokens=1, temperature=1.0, top_k=2)  # draws from the two best
        drawn = {first_tokens(SamplingParams(**two, seed=s), f"two{s}")[0] for s in range(8)}
        assert drawn == {best, second}
        drawn = {first_tokens(SamplingParams(**two, seed=s, logit_bias={best: -100}),
                              f"two-down{s}")[0] for s in range(8)}
        assert drawn == set(ref.topk(3).indices.tolist()[1:])
        # a token id outside the vocabulary: that request alone gets a 400
        bad = _submit(engine, "bad", prompt, SamplingParams(logit_bias={VOCAB: 1.0}))
        assert bad.done.wait(30)
        assert bad.outputs[-1].error_code == 400 and "logit_bias" in bad.outputs[-1].error_message
    finally:
        engine.stop()
