"""The hostile-input findings, each against real processes (a service with a
MIX engine, a DECODE engine reached over its DisaggPDService). Each failed at 8a99c92:
1. integers that do not fit the wire were 500s on the service;
2. Infinity temperature / repetition_penalty were 500s;
3. best_of had no cap (100000 hung, 2^31 wedged an engine);
4. a 20 MB body blocked the event loop (/health stalled for its parse);
5. AddNewRequests with a negative prompt id was UNKNOWN and leaked its block; ids at or
   above the vocabulary failed a later engine step (and a healthy request with it);
6. FirstGeneration with a first token out of the vocabulary failed an engine step; none
   at all was UNKNOWN and leaked the request's blocks;
7. a duplicate request id to Generate was dropped without an error. (The other half of
   7, a non-streaming hang-up's InvalidStateError, is tests/unit/api/test_api_generations.py.)
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from tests.integration.cluster_harness import Harness
from tests.integration.hostile_harness import (
    blocks_used,
    disagg_request,
    handover,
    log_count,
    post,
    start_cluster,
    start_collector,
    step_failures,
    tiny_vocab_size,
    wait_blocks_free,
)
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

PROMPT = [1, 45, 99, 173, 201, 330]  # token ids of the tiny vocabulary


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    h = Harness(etcd_server.endpoint, "hostile/", tmp_path_factory.mktemp("hostile"))
    try:
        yield start_cluster(h, "hostile-decode/")
    finally:
        h.stop()


def _vocab(cluster) -> int:
    return tiny_vocab_size()


def _assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


@pytest.mark.parametrize("field, value", [
    ("seed", 18446744073709551621), ("seed", -(2 ** 63) - 1), ("seed", 2 ** 63),
    ("top_k", 2 ** 31), ("stop_token_ids", [2 ** 31]), ("best_of", 2 ** 31),
    ("max_tokens", 2 ** 31), ("n", 2 ** 31),
])
def test_integers_that_do_not_fit_the_wire_are_400(cluster, field, value):
    for url in (cluster.service.http_url, cluster.mix.http_url):
        resp = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                              field: value})
        _assert_400(resp, field)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p",
                                   "frequency_penalty"])
def test_infinity_and_nan_are_400(cluster, field):
    for url in (cluster.service.http_url, cluster.mix.http_url):
        for literal in ("Infinity", "-Infinity", "NaN", "1e39"):
            body = '{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "%s": %s}' % (field, literal)
            _assert_400(post(url, "/v1/completions", body), field)


def test_best_of_is_capped(cluster):
    for url in (cluster.service.http_url, cluster.mix.http_url):
        for best_of in (100000, 2 ** 31 - 1):
            resp = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi",
                                                  "max_tokens": 2, "best_of": best_of},
                        timeout=10)
            _assert_400(resp, "best_of")
        # fan-out: prompts x n
        resp = post(url, "/v1/completions", {"model": "tiny", "prompt": ["a"] * 64, "n": 8,
                                              "max_tokens": 2}, timeout=10)
        _assert_400(resp, "n")
    assert blocks_used(cluster.mix) == 0


async def test_a_large_body_does_not_hold_the_event_loop(cluster):
    """20 MB: refused with 413 from its Content-Length, unread. 7 MB (under the limit):
    parsed and tokenized off the loop, so /health answers while it is being prepared."""
    for url in (cluster.service.http_url, cluster.mix.http_url):
        huge = json.dumps({"model": "tiny", "prompt": "a " * (10 << 20), "max_tokens": 2})
        resp = post(url, "/v1/completions", huge)
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
        big = json.dumps({"model": "tiny", "prompt": "hello world " * (600 << 10),
                          "max_tokens": 2})
        # /health on fresh connections: a kept-alive one the server closes as idle while the
        # big request runs would fail the probe (a client-side race, not the server's).
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http, \
                httpx.AsyncClient(base_url=url, timeout=30, trust_env=False,
                                  limits=fresh) as probe:
            task = asyncio.ensure_future(http.post("/v1/completions", content=big,
                                                   headers={"Content-Type": "application/json"}))
            answered_meanwhile = 0
            while not task.done():
                health = await probe.get("/health")
                assert health.status_code == 200
                if not task.done():
                    answered_meanwhile += 1
            resp = await task
        assert resp.status_code == 400  # longer than the context
        assert resp.json()["error"]["param"] in ("prompt", "max_tokens")
        assert answered_meanwhile >= 1, "/health waited for the large request"


async def test_add_new_requests_refuses_bad_ids_before_allocating(cluster):
    vocab = _vocab(cluster)
    server, collector, source = await start_collector()
    try:
        async with grpc.aio.insecure_channel(cluster.decode_meta["rpc_address"]) as ch:
            stub = pb_grpc.DisaggPDServiceStub(ch)
            failures_before = step_failures(cluster.decode)
            good = disagg_request("good-5", PROMPT, source, max_tokens=24)
            bad = [disagg_request("neg-5", [5, -1, 7], source),
                   disagg_request("oov-5", [5, vocab, 7], source),
                   disagg_request("big-5", [5, 2 ** 31 - 1], source)]
            replies = await stub.AddNewRequests(pb.DisaggRequests(
                prefill_name="prefill-x", reqs=[good, *bad]), timeout=10)
            codes = {r.req_id: r.status_code for r in replies.reqs}
            assert codes == {"good-5": 200, "neg-5": 400, "oov-5": 400, "big-5": 400}, replies
            assert all("out of range" in r.status_msg for r in replies.reqs[1:])
            # Only the good request holds blocks, and it decodes to the end.
            assert blocks_used(cluster.decode) == len(replies.reqs[0].blocks_ids) > 0
            status = await stub.FirstGeneration(pb.DisaggGenerationsRequests(
                gens=[handover("good-5", [PROMPT[1]])]), timeout=10)
            assert status.ok, status.message
            last = await collector.wait_done("good-5")
            assert last.gen_status.status_code == 200
            assert last.usage.num_generated_tokens == 24
            await wait_blocks_free(cluster.decode)
            assert step_failures(cluster.decode) == failures_before
    finally:
        await server.stop(0)


@pytest.mark.parametrize("tokens", [[10 ** 6], [-1], [], [3, 4]])
async def test_first_generation_with_a_bad_token_fails_only_its_request(cluster, tokens):
    vocab = _vocab(cluster)
    tokens = [vocab if t == 10 ** 6 and vocab > 10 ** 6 else t for t in tokens]
    server, collector, source = await start_collector()
    tag = f"{len(tokens)}-{tokens[0] if tokens else 'none'}"
    try:
        async with grpc.aio.insecure_channel(cluster.decode_meta["rpc_address"]) as ch:
            stub = pb_grpc.DisaggPDServiceStub(ch)
            failures_before = step_failures(cluster.decode)
            healthy, bad = f"healthy-{tag}", f"bad-{tag}"
            replies = await stub.AddNewRequests(pb.DisaggRequests(prefill_name="prefill-x", reqs=[
                disagg_request(healthy, PROMPT, source, max_tokens=40),
                disagg_request(bad, PROMPT, source)]), timeout=10)
            assert [r.status_code for r in replies.reqs] == [200, 200]
            ok = await stub.FirstGeneration(pb.DisaggGenerationsRequests(
                gens=[handover(healthy, [PROMPT[2]])]), timeout=10)
            assert ok.ok
            status = await stub.FirstGeneration(pb.DisaggGenerationsRequests(
                gens=[handover(bad, tokens)]), timeout=10)
            assert not status.ok and status.code == 400
            assert bad in status.message
            failed = await collector.wait_done(bad)
            assert failed.gen_status.status_code == 400
            last = await collector.wait_done(healthy)
            assert last.gen_status.status_code == 200
            assert last.usage.num_generated_tokens == 40
            await wait_blocks_free(cluster.decode)
            assert step_failures(cluster.decode) == failures_before
    finally:
        await server.stop(0)


async def test_duplicate_request_id_to_generate_is_refused(cluster):
    server, collector, source = await start_collector()
    try:
        async with grpc.aio.insecure_channel(cluster.mix_meta["rpc_address"]) as ch:
            stub = pb_grpc.DisaggPDServiceStub(ch)
            first = disagg_request("dup-7", PROMPT, source, max_tokens=200)
            assert (await stub.Generate(first, timeout=10)).ok
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(disagg_request("dup-7", PROMPT, source, max_tokens=3),
                                    timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "duplicate request id" in e.value.details()
            last = await collector.wait_done("dup-7")
            assert last.gen_status.status_code == 200
            assert last.usage.num_generated_tokens == 200  # the first one, untouched
            await wait_blocks_free(cluster.mix)
    finally:
        await server.stop(0)


async def test_full_engine_is_429_with_retry_after_through_the_service(etcd_server, tmp_path):
    """An engine whose queue is full refuses Generate (RESOURCE_EXHAUSTED); with every
    instance full the service answers 429 + Retry-After, and the requests it took finish."""
    from tests.integration.cluster_harness import start_mix_cluster

    h = Harness(etcd_server.endpoint, "full/", tmp_path)
    h.engine = _with_extra(h.engine, ["--max-num-seqs", "1", "--max-pending-requests", "1"])
    try:
        svc, (mix,) = start_mix_cluster(h, num_engines=1)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 48, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=svc.http_url, timeout=120, trust_env=False) as http:
            resps = await asyncio.gather(*[http.post("/v1/completions", json=body)
                                           for _ in range(8)])
        codes = sorted(r.status_code for r in resps)
        assert set(codes) == {200, 429}, codes
        for r in resps:
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_exceeded"
            else:
                assert r.json()["usage"]["completion_tokens"] == 48
        await wait_blocks_free(mix)
    finally:
        h.stop()


def _with_extra(engine_fn, flags: list[str]):
    """Harness.engine with `flags` added to every engine it starts."""
    def engine(role, name, port=None, extra=None):
        return engine_fn(role, name, port, extra=[*flags, *(extra or [])])
    return engine


async def test_non_streaming_hang_up_cancels_cleanly(cluster):
    """A client that hangs up on a non-streaming request: the engine aborts it, frees its
    blocks and logs no InvalidStateError (before: `task.result()` on a cancelled task).
    The request asks for nearly the whole context and the client gives up after 0.5 s:
    the tiny model makes ~1000 tokens a second on a fast core, so it is still running."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000,
            "ignore_eos": True}
    for proc in (cluster.mix, cluster.service):
        async with httpx.AsyncClient(base_url=proc.http_url, trust_env=False) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body, timeout=0.5)
        await wait_blocks_free(cluster.mix)
        assert log_count(proc, "InvalidStateError") == 0
        assert log_count(proc, "Result is not set") == 0
