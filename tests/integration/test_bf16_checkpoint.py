"""A checkpoint stored in bfloat16 (the tiny builder's ``dtype="bfloat16"``), served by the
engine on CPU with its linear weights held as bfloat16 panels, against transformers in
float32 on the same files: the same greedy tokens, logits within float32 rounding."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from xllm_py.config import CacheConfig, EngineConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.engine.model_runner import ModelRunner
from xllm_py.engine.scheduler import ScheduledSeq
from xllm_py.model import cpu_kernels
from xllm_py.model.attention import allocate_kv_caches
from xllm_py.model.loader import load_model
from xllm_py.model.packed import PackedLinear, pack_linears
from xllm_py.model.tiny import build_model_dir
from xllm_py.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not cpu_kernels.linear_available(),
                       reason="bfloat16 panels need the native linear kernels"),
]

GEN_LEN = 12
TOL = 1e-4  # max abs logit error, float32 (as test_model_hf_parity)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("bf16"), hidden_size=128, num_layers=3,
                           num_heads=4, num_kv_heads=2, intermediate_size=256, seed=11,
                           dtype="bfloat16")


@pytest.fixture(scope="module")
def hf_model(bf16_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(bf16_dir), dtype=torch.float32).eval()


def _prompts(vocab: int) -> list[list[int]]:
    """Prompt lengths 5..70: one prefill step of 184 tokens (linear_large), decode batches
    of 4 and a lone prompt (one-row kernel)."""
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 37, 70, 72)]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN, eos_token_id=None,
                          pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


class _Collect:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.done = threading.Event()
        self.error = ""

    def emit(self, output) -> None:
        for delta in output.outputs:
            self.token_ids.extend(delta.token_ids)
        if output.finished:
            self.error = output.error_message
            self.done.set()


def test_engine_greedy_equals_hf_float32(bf16_dir, hf_model):
    engine = LLMEngine(EngineConfig(model=str(bf16_dir),
                                    cache=CacheConfig(enable_prefix_caching=False)))
    panels = {m._panels.dtype for m in engine.model.modules() if isinstance(m, PackedLinear)}
    assert panels == {torch.bfloat16}
    prompts = _prompts(hf_model.config.vocab_size)
    engine.start()
    try:
        params = SamplingParams(max_tokens=GEN_LEN, temperature=0.0, ignore_eos=True)
        sinks = [_Collect() for _ in prompts]
        for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
            engine.submit(EngineRequest(f"r{i}", list(prompt), params, sink))
        for sink in sinks:
            assert sink.done.wait(120), "engine request did not finish"
            assert not sink.error
        lone = _Collect()
        engine.submit(EngineRequest("lone", list(prompts[0]), params, lone))
        assert lone.done.wait(120) and not lone.error
    finally:
        engine.stop()
    expected = [_hf_greedy(hf_model, p) for p in prompts]
    assert [s.token_ids for s in sinks] == expected
    assert lone.token_ids == expected[0]


def test_logits_close_to_hf_float32(bf16_dir, hf_model):
    """Prefill and decode logits of the bfloat16-panel model against one HF forward over
    the same tokens."""
    model, cfg = load_model(str(bf16_dir))
    pack_linears(model)
    block_size = 8
    caches = allocate_kv_caches(cfg.num_layers, 64, block_size, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, caches, block_size)
    prompt = _prompts(cfg.vocab_size)[2]
    tokens = prompt + _hf_greedy(hf_model, prompt)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([tokens])).logits[0]
        table = list(range(1, (len(tokens) + block_size - 1) // block_size + 1))
        ours = [runner.execute([ScheduledSeq("s", prompt, 0, table, True)])[0]]
        for pos in range(len(prompt), len(tokens) - 1):
            ours.append(runner.execute([ScheduledSeq("s", [tokens[pos]], pos, table, True)])[0])
    ours_t = torch.stack(ours)
    ref_t = ref[len(prompt) - 1:len(tokens) - 1]
    assert (ours_t - ref_t).abs().max().item() < TOL
    assert ours_t.argmax(-1).tolist() == tokens[len(prompt):]
