"""PD through the KV tiers, PULL and PUSH, on a random Llama and a hybrid Gemma 3 (window
6, blocks of 4) against transformers, behind the service: a prompt whose blocks the
prefill's pool evicted is loaded from its tiers and only the rest computed, the decode
takes the KV over as always, the greedy tokens are transformers'; usage counts the
loaded tokens as cached; the decode's copy of the conversation goes down its own tiers
(for a next turn routed to it); a third engine (a second prefill) finds the prompt in the
shared store. Every pool ends empty."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration.cluster_harness import Harness, labelled, wait_drained
from tests.integration.test_kv_tiers import FAMILIES
from tests.integration.test_tensor_parallel import _hf_greedy
from tests.integration.tp_models import VOCAB, build_hf_model
from tests.waiting import wait_until_sync

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCK = 4
MODEL = "random"


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"pd-{request.param}")
    hf = build_hf_model(transformers, request.param, path)
    g = torch.Generator().manual_seed(21)
    prompts = {mode: torch.randint(0, VOCAB, (50,), generator=g).tolist()
               for mode in ("PULL", "PUSH")}  # (one store for both: a prompt each)
    fillers = [torch.randint(0, VOCAB, (60,), generator=g).tolist() for _ in range(3)]
    return path, prompts, fillers, {m: _hf_greedy(hf, p)[0] for m, p in prompts.items()}


def _complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    r = httpx.post(url + "/v1/completions", timeout=60, trust_env=False, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _tier(url: str, name: str, tier: str) -> int:
    n = labelled(url, f"xllm_kv_tier_{name}_blocks_total", f'tier="{tier}"')
    assert n >= 0, f"xllm_kv_tier_{name}_blocks_total{{tier={tier}}} not in {url}/metrics"
    return n


@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
def test_a_prefill_loads_the_evicted_prefix_and_hands_it_over(checkpoint, mooncake_store, mode,
                                                             etcd_server, tmp_path):
    path, prompts, fillers, expected = checkpoint
    prompt, expected = prompts[mode], expected[mode]
    h = Harness(etcd_server.endpoint, f"tiers-pd-{mode}-{path.name}/", tmp_path)
    common = ["--model", str(path), "--block-size", str(BLOCK), "--num-blocks", "40",
              "--kv-cache-transfer-mode", mode, "--kv-store", mooncake_store.master_addr]
    tiers = {"kv_host_tier_mb": 64, "kv_disk_tier_mb": 0}
    try:
        svc = h.service(extra=["--model", str(path), "--served-model-name", MODEL])
        prefill = h.engine("PREFILL", "prefill", extra=common, settings=tiers)
        decode = h.engine("DECODE", "decode", extra=common, settings=tiers)
        for p in (prefill, decode):
            p.wait_ready(120)
        svc.wait_ready(60, path="/readiness")
        assert _complete(svc.http_url, prompt) == (expected, 0)
        for f in fillers:  # the prefill's pool (40 blocks) lets the prompt go
            _complete(svc.http_url, f)
        hits = _tier(prefill.http_url, "hit", "host")
        full = (len(prompt) - 1) // BLOCK * BLOCK
        assert _complete(svc.http_url, prompt) == (expected, full)
        assert _tier(prefill.http_url, "hit", "host") > hits
        # the decode wrote its copy (the prompt it took over, the tokens it made) down
        wait_until_sync(lambda: _tier(decode.http_url, "written", "host") > 0, 10)
        # another prefill, on the same store, computes none of it
        other = h.engine("PREFILL", "prefill-2", extra=common)
        other.wait_ready(120)
        prefill.terminate()
        wait_until_sync(lambda: labelled(svc.http_url, "xllm_service_instances",
                                         'state="ACTIVE"') == 2, 30, step_s=0.2)
        assert _complete(svc.http_url, prompt) == (expected, full)
        assert _tier(other.http_url, "hit", "store") > 0
        import asyncio

        asyncio.run(wait_drained([other.http_url, decode.http_url], 10))
    finally:
        h.stop()
