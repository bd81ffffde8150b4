"""Prompt logprobs and logit_bias through HTTP on real processes, against Hugging Face
transformers (log_softmax of its float32 logits), on the three model families (tiny random
Llama / Qwen2 / Qwen3 checkpoints) and the three paths: a MIX engine's own API, and a
service over a PREFILL + DECODE pair in PULL and in PUSH mode (the prefill computes the
prompt logprobs; its first output reaches the service through Generations).

Each path is checked with one test that covers a fresh prompt, a prompt whose prefix is in
the prefix cache, and a prompt longer than the step budget (a chunked prefill), with
`echo` + `logprobs` (OpenAI format) and `prompt_logprobs` (vLLM's) in one request, and
max_tokens 0 (score only)."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster_harness import Harness
from tests.integration.test_prompt_logprobs import FAMILIES, TOL, _hf_logprobs, _prompt, build_checkpoint
from xllm_py.utils.procs import engine_args, free_port, spawn

pytestmark = pytest.mark.integration

TOP_K = 4
BUDGET = 16  # max_num_batched_tokens: a longer prompt is prefilled in chunks
PATHS = ("MIX", "PULL", "PUSH")


def _common(path: str) -> list[str]:
    return ["--model", path, "--dtype", "float32", "--block-size", "4", "--num-blocks", "256",
            "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "4"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, etcd_server, tmp_path_factory):
    """(hf model, {path: base url}) of one family: a MIX engine, and a service with a
    PREFILL + DECODE pair for each KV transfer mode."""
    name = request.param
    ckpt = tmp_path_factory.mktemp(f"ckpt-{name}")
    hf = build_checkpoint(name, ckpt)
    logs = tmp_path_factory.mktemp(f"logs-{name}")
    harnesses = {mode: Harness(etcd_server.endpoint, f"scoring-{name}-{mode}/", logs)
                 for mode in ("PULL", "PUSH")}
    common = _common(str(ckpt))
    port = free_port()
    mix = spawn(f"mix-{name}", "xllm_py.engine", engine_args("MIX", port, extra=common), logs,
                http_url=f"http://127.0.0.1:{port}")
    harnesses["PULL"].procs.append(mix)
    try:
        urls, services = {"MIX": mix.http_url}, []
        engines = [mix]
        for mode, h in harnesses.items():
            pd = [*common, "--kv-cache-transfer-mode", mode]
            services.append(h.service(name=f"svc-{name}-{mode}", extra=["--model", str(ckpt)]))
            engines += [h.engine("PREFILL", f"prefill-{name}-{mode}", extra=pd),
                        h.engine("DECODE", f"decode-{name}-{mode}", extra=pd)]
            urls[mode] = services[-1].http_url
        for p in engines:
            p.wait_ready(240)
        for s in services:
            s.wait_ready(60, path="/readiness")
        yield hf, urls
    finally:
        for h in harnesses.values():
            h.stop()


def _post(url: str, body: dict) -> dict:
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _score(url: str, prompt: list[int], max_tokens: int) -> dict:
    return _post(url, {"prompt": [prompt], "max_tokens": max_tokens, "echo": True,
                       "logprobs": TOP_K, "prompt_logprobs": TOP_K, "temperature": 0,
                       "return_token_ids": True})


def _assert_prompt_matches_hf(hf, prompt: list[int], choice: dict, what: str) -> None:
    ref = _hf_logprobs(hf, prompt)
    lp = choice["logprobs"]
    got = lp["token_logprobs"][:len(prompt)]
    assert got[0] is None and lp["top_logprobs"][0] is None, what
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None, what
    for j in range(1, len(prompt)):
        want = ref[j - 1, prompt[j]].item()
        assert got[j] is not None and abs(got[j] - want) < TOL, f"{what}: token {j}"
        entry = plp[j]
        assert abs(entry[str(prompt[j])]["logprob"] - want) < TOL, f"{what}: token {j}"
        ranked = sorted((v["rank"], int(t), v["logprob"]) for t, v in entry.items()
                        if v["rank"] is not None and v["rank"] <= TOP_K)
        values, ids = ref[j - 1].topk(TOP_K)
        assert [t for _, t, _ in ranked] == ids.tolist(), f"{what}: top-k of token {j}"
        assert max(abs(v - r) for (_, _, v), r in zip(ranked, values.tolist())) < TOL
        # the OpenAI format's top_logprobs: the same values, keyed by token text
        assert len(lp["top_logprobs"][j]) >= 1


@pytest.mark.parametrize("path", PATHS)
def test_prompt_logprobs_equal_hf(family, path):
    hf, urls = family
    url = urls[path]
    # a fresh prompt, scored while generating
    fresh = _prompt(6, seed=11)
    out = _score(url, fresh, max_tokens=2)["choices"][0]
    _assert_prompt_matches_hf(hf, fresh, out, "fresh")
    assert len(out["token_ids"]) == 2 and len(out["logprobs"]["token_logprobs"]) == 8
    # a prompt whose first 16 tokens are cached, longer than the step budget (chunked),
    # scored without generating (max_tokens 0)
    prefix = _prompt(16, seed=12)
    _post(url, {"prompt": [prefix + _prompt(3, seed=13)], "max_tokens": 1, "temperature": 0})
    long = prefix + _prompt(2 * BUDGET + 5, seed=14)
    scored = _score(url, long, max_tokens=0)
    choice = scored["choices"][0]
    _assert_prompt_matches_hf(hf, long, choice, "prefix hit + chunked")
    assert (choice["finish_reason"], choice["token_ids"]) == ("length", [])
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["usage"]["prompt_tokens"] == len(long)
    # the prefix was in the cache: a plain request for the same prompt hits it
    plain = _post(url, {"prompt": [long], "max_tokens": 3, "temperature": 0})
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.parametrize("path", PATHS)
def test_logit_bias_changes_greedy_output(family, path):
    hf, urls = family
    url = urls[path]
    prompt = _prompt(9, seed=15)
    ref = _hf_logprobs(hf, prompt)[-1]
    best, second = ref.topk(2).indices.tolist()
    forced = int(ref.argmin())

    def tokens(bias: dict | None) -> list[int]:
        body = {"prompt": [prompt], "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        if bias is not None:
            body["logit_bias"] = {str(t): b for t, b in bias.items()}
        return _post(url, body)["choices"][0]["token_ids"]

    assert tokens(None)[0] == best
    # +100 makes the least likely token the greedy one, on prefill and decode alike
    assert tokens({forced: 100}) == [forced] * 3
    assert tokens({best: -100})[0] == second
    resp = httpx.post(url + "/v1/completions", json={"prompt": [prompt], "logit_bias": {"5": 101}},
                      timeout=30, trust_env=False)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("path", PATHS)
def test_stop_reason_and_routes_on_real_processes(family, path):
    """stop_reason crosses the proto (PD: decode's output relayed by the service); the
    model, tokenizer and version routes answer on an engine and on the service alike."""
    _, urls = family
    url = urls[path]
    for seed in range(16, 40):  # a prompt whose greedy run has a new token after the first
        body = {"prompt": [_prompt(7, seed=seed)], "max_tokens": 6, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        free = _post(url, body)["choices"][0]
        assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
        tokens = free["token_ids"]
        # a token generated after the first (on decode in PD) that did not come before
        k = next((i for i in range(1, 6) if tokens[i] not in tokens[:i]), None)
        if k is not None:
            break
    assert k is not None, "every greedy run repeats its first token"
    stopped = _post(url, {**body, "stop_token_ids": [tokens[k]]})["choices"][0]
    assert stopped["token_ids"] == tokens[:k + 1]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", tokens[k])

    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        assert http.get(f"/v1/models/{model}").json()["id"] == model
        missing = http.get("/v1/models/no-such-model")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith(
            "hello world")
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["count"] > 1
        assert http.get("/version").json()["version"]
