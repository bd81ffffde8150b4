"""Our Llama/Qwen2/Qwen3/Gemma 3 against transformers on random tiny checkpoints (float32,
CPU). The Gemma 3 cases have sliding windows shorter than a few blocks, so every prompt
here crosses them: chunks straddle the window, decode steps read only the window's blocks."""

from __future__ import annotations

import copy
import pathlib
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xllm_py.model import cpu_kernels  # noqa: E402
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions  # noqa: E402
from xllm_py.model.loader import load_model  # noqa: E402
from xllm_py.model.packed import pack_linears  # noqa: E402
from xllm_py.model.tiny import build_tokenizer_files  # noqa: E402

pytestmark = pytest.mark.integration  # the real model, against transformers

VOCAB = 1024
BLOCK_SIZE = 4
NUM_BLOCKS = 128
TOL = 1e-4  # max abs logit error, float32

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, initializer_range=0.05,
               eos_token_id=None, bos_token_id=None, pad_token_id=None)

CASES = {
    # llama3 rope scaling with a short original context so the scaled bands matter
    "llama-tied-llama3": lambda: transformers.LlamaConfig(
        **_COMMON, tie_word_embeddings=True, rope_theta=500.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-untied": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
    "qwen3-untied-hd32": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32,
                                                          tie_word_embeddings=False),
    "qwen3-tied": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
    # a window of 6 tokens at block size 4; the attention scale off head_dim ** -0.5
    "gemma3-window6": lambda: transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma3-window17-untied": lambda: transformers.Gemma3TextConfig(
        **_COMMON, head_dim=32, sliding_window=17, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(name, hf_model, our_model, our_config) for one family case."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CASES[request.param]()).eval()
    with torch.no_grad():  # make norms and biases non-trivial so a mis-mapped one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    build_tokenizer_files(pathlib.Path(path))
    t0 = time.perf_counter()
    ours, cfg = load_model(path)
    print(f"\n[{request.param}] load_model: {time.perf_counter() - t0:.3f} s")
    return request.param, hf, ours, cfg


class _Runner:
    """Drives our model with a paged cache: per-sequence block tables, ragged steps."""

    def __init__(self, model, cfg, block_size: int = BLOCK_SIZE, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.caches = allocate_kv_caches(cfg.num_layers, NUM_BLOCKS, block_size, cfg.num_kv_heads,
                                         cfg.head_dim, dtype=next(model.parameters()).dtype)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(NUM_BLOCKS - 1, generator=g).add(1).tolist()  # keep block 0 unused
        self.tables: dict[int, list[int]] = {}

    def step(self, chunks: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
        """chunks: (seq_id, start_pos, token_ids) -> logits [T, vocab] for every new token."""
        seqs = []
        for sid, start, ids in chunks:
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < start + len(ids):
                table.append(self.free.pop())
            seqs.append((start, len(ids), list(table)))
        md = AttentionMetadata.build(seqs, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.cat([c[2] for c in chunks]), build_positions(seqs), md,
                                self.caches)
            return self.model.compute_logits(hidden)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def test_logits_ragged_batch_and_one_by_one(pair):
    name, hf, ours, cfg = pair
    prompts = _prompts([1, 5, 17, 40])
    ref = [_hf_logits(hf, p) for p in prompts]

    batched = _Runner(ours, cfg).step([(i, 0, p) for i, p in enumerate(prompts)])
    err_batch = (batched - torch.cat(ref)).abs().max().item()
    err_single = 0.0
    for i, p in enumerate(prompts):
        single = _Runner(ours, cfg, seed=i + 10).step([(0, 0, p)])
        err_single = max(err_single, (single - ref[i]).abs().max().item())
    print(f"[{name}] max |logit err| ragged batch {err_batch:.2e}, one by one {err_single:.2e}")
    assert err_batch < TOL
    assert err_single < TOL


@pytest.fixture(params=["torch", "engine"])
def ours_path(request, pair):
    """The model as loaded on the torch path, or as the engine runs it on CPU: linear
    weights packed for oneDNN and the native kernels (xllm_py/model/cpu_kernels.py)."""
    name, hf, ours, cfg = pair
    if request.param == "torch":
        with cpu_kernels.disabled():
            yield name, hf, ours, cfg
        return
    packed = copy.deepcopy(ours)
    pack_linears(packed)
    yield name, hf, packed, cfg


def test_chunked_prefill_mixed_with_decode(ours_path):
    name, hf, ours, cfg = ours_path
    long, short = _prompts([37, 6], seed=2)
    ref_long = _hf_logits(hf, long)
    ref_short = _hf_logits(hf, short)
    runner = _Runner(ours, cfg)
    # step 1: first chunk of `long` + full prefill of `short[:5]`
    out1 = runner.step([(0, 0, long[:16]), (1, 0, short[:5])])
    # step 2: second chunk of `long` (start 16) + a decode step of `short` (position 5)
    out2 = runner.step([(0, 16, long[16:30]), (1, 5, short[5:6])])
    # step 3: last chunk (start 30, crosses block boundaries at block_size 4)
    out3 = runner.step([(0, 30, long[30:])])
    got_long = torch.cat([out1[:16], out2[:14], out3])
    got_short = torch.cat([out1[16:], out2[14:]])
    err = max((got_long - ref_long).abs().max().item(), (got_short - ref_short).abs().max().item())
    one_chunk = _Runner(ours, cfg, seed=3).step([(0, 0, long)])
    print(f"[{name}] chunked prefill max |logit err| {err:.2e}")
    assert err < TOL
    assert (one_chunk - got_long).abs().max().item() < TOL


def test_greedy_generation_matches_hf_generate(ours_path):
    name, hf, ours, cfg = ours_path
    prompts = _prompts([7, 3, 12], seed=4)
    num_new = 64
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    assert all(len(e) == num_new for e in expected)

    runner = _Runner(ours, cfg)
    logits = runner.step([(i, 0, p) for i, p in enumerate(prompts)])
    ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    generated = [[t] for t in logits[ends].argmax(-1).tolist()]
    lengths = [len(p) for p in prompts]
    for _ in range(num_new - 1):  # all-decode batches (max_query_len == 1)
        step = [(i, lengths[i] + len(generated[i]) - 1, torch.tensor([generated[i][-1]]))
                for i in range(len(prompts))]
        nxt = runner.step(step).argmax(-1).tolist()
        for i, t in enumerate(nxt):
            generated[i].append(t)
    assert generated == expected
    assert len(set(expected[0])) > 1  # not a single repeated token


def test_bf16_load_runs(pair):
    name, hf, ours, cfg = pair
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        build_tokenizer_files(pathlib.Path(d))
        model16, _ = load_model(d, dtype="bfloat16")
    assert next(model16.parameters()).dtype == torch.bfloat16
    prompt = _prompts([21], seed=5)[0]
    runner = _Runner(model16, cfg)
    logits = torch.cat([runner.step([(0, 0, prompt[:20])]),  # prefill, then one decode step
                        runner.step([(0, 20, prompt[20:])])])
    assert logits.dtype == torch.float32
    ref = _hf_logits(hf, prompt)
    err = (logits - ref).abs().max().item()
    # transformers' own bfloat16 run is the yardstick of what bf16 costs (Gemma's four norms
    # a layer cost more than the other families' two)
    hf_err = (_hf_logits(copy.deepcopy(hf).to(torch.bfloat16), prompt) - ref).abs().max().item()
    print(f"[{name}] bf16 max |logit err| vs fp32 reference {err:.2e} (transformers bf16 "
          f"{hf_err:.2e})")
    assert torch.isfinite(logits).all()
    assert err < max(0.1, 1.5 * hf_err)


def test_long_prompt_dense_prefill_matches_hf(ours_path, monkeypatch):
    """A prompt long enough for the dense (SDPA) prefill path on CPU, whole and chunked
    (a dense causal chunk, a 28-token one after it on the dense path with a mask, then a
    12-token one on the paged kernel), against HF."""
    from xllm_py.model import attention

    name, hf, ours, cfg = ours_path
    calls = []
    real = attention.dense_chunk_attention
    monkeypatch.setattr(attention, "dense_chunk_attention",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prompt = _prompts([300], seed=6)[0]
    ref = _hf_logits(hf, prompt)
    whole = _Runner(ours, cfg).step([(0, 0, prompt)])
    runner = _Runner(ours, cfg, seed=7)
    chunked = torch.cat([runner.step([(0, 0, prompt[:260])]),
                         runner.step([(0, 260, prompt[260:288])]),
                         runner.step([(0, 288, prompt[288:])])])
    err = max((whole - ref).abs().max().item(), (chunked - ref).abs().max().item())
    print(f"[{name}] 300-token prompt max |logit err| {err:.2e}, dense chunks {calls}")
    assert err < TOL
    engine_path = cpu_kernels.available()
    # a sliding layer reads only its window before the 28-token chunk: too short for dense
    full = sum(1 for i in range(cfg.num_layers) if not cfg.layer_window(i))
    tile = attention.WINDOW_TILE

    def tiles(n: int, w: int) -> list[int]:  # a fresh chunk's calls: by tiles past a window
        return [n] if not w or n <= w + tile else [min(tile, n - a) for a in range(0, n, tile)]

    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert calls == ([c for w in windows for c in tiles(300, w)]
                     + [c for w in windows for c in tiles(260, w)] + [28] * full
                     if engine_path else [])
