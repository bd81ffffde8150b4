"""PD under failure: decode out of KV blocks, decode killed mid-stream (its requests
migrate to another decode, or fail clearly when there is none), failed KV transfer."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.integration.cluster_harness import (Harness, aclient,
                                               kill_mid_stream_and_check_migration,
                                               long_stream, metric, migrations, wait_drained, wait_until)
from tests.integration.faulty_engine import EXIT_STATUS

pytestmark = pytest.mark.integration


def start(h: Harness, decode_blocks: int, num_decodes: int = 1):
    """(service, prefill, decode, ...): one PREFILL and `num_decodes` DECODE engines."""
    svc = h.service()
    prefill = h.engine("PREFILL", "prefill", extra=["--block-size", "8"])
    decodes = [h.engine("DECODE", f"decode{i}" if i else "decode",
                        extra=["--block-size", "8", "--num-blocks", str(decode_blocks)])
               for i in range(num_decodes)]
    for p in (prefill, *decodes):
        p.wait_ready(180)
    svc.wait_ready(60, path="/readiness")
    return (svc, prefill, *decodes)


async def test_decode_out_of_blocks_waits_retries_or_fails_cleanly(etcd_server, tmp_path):
    h = Harness(etcd_server.endpoint, "pd-oob/", tmp_path)
    try:
        # 11 usable blocks of 8 tokens: one 30+20-token request (7 blocks) at a time.
        svc, prefill, decode = start(h, decode_blocks=12)
        c = aclient(svc)

        async def one(i: int) -> str:
            try:
                r = await c.completions.create(
                    model="tiny", prompt=[5 + i] * 30, max_tokens=20, temperature=0,
                    extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 20
                return "ok"
            except openai.APIStatusError as exc:
                return f"{exc.status_code}: {exc.message}"

        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), 90)
        elapsed = time.monotonic() - t0
        print(f"\nout-of-blocks: {results.count('ok')}/8 completed in {elapsed:.1f}s; {results}")
        assert results.count("ok") >= 2  # retries let queued requests through
        for r in results:
            assert r == "ok" or ("503" in r and "KV space" in r), r
        # A request that can never fit on decode fails at once with a clear message.
        with pytest.raises(openai.APIStatusError) as e:
            await c.completions.create(model="tiny", prompt=[7] * 100, max_tokens=10)
        assert e.value.status_code == 400 and "decode can hold" in e.value.message
        await wait_drained([prefill.http_url, decode.http_url], timeout_s=10)
        assert metric(prefill.http_url, "xllm_kv_cache_blocks_used") == 0
        assert metric(decode.http_url, "xllm_kv_cache_blocks_used") == 0
    finally:
        h.stop()


async def test_decode_killed_mid_stream(etcd_server, tmp_path):
    """The only decode dies: with nowhere to migrate, clients get a clear error within
    lease TTL + eviction grace."""
    h = Harness(etcd_server.endpoint, "pd-kill/", tmp_path)
    try:
        svc, prefill, decode = start(h, decode_blocks=512)
        c = aclient(svc)

        tasks = [asyncio.create_task(long_stream(c, f"story {i}")) for i in range(3)]
        # all three decoding when it dies
        await wait_until(lambda: metric(decode.http_url, "xllm_requests_running") == 3, 60, 0.1)
        decode.kill()
        killed = time.monotonic()
        bound_s = h.ttl_s + 2.0 + 2.0  # lease TTL + eviction grace + probe slack
        results = await asyncio.wait_for(asyncio.gather(*tasks), bound_s + 5)
        worst = max(t for _, t in results) - killed
        print(f"\ndecode killed: clients got errors within {worst:.1f}s: {[r for r, _ in results]}")
        assert all(r.startswith("error") for r, _ in results)
        assert worst < bound_s
        assert metric(prefill.http_url, "xllm_kv_cache_blocks_used") == 0
        # With no decode left the service says why.
        with pytest.raises(openai.APIStatusError) as e:
            await c.completions.create(model="tiny", prompt="hello", max_tokens=4)
        assert e.value.status_code == 503
    finally:
        h.stop()


async def test_decode_killed_mid_stream_migrates_to_the_other_decode(etcd_server, tmp_path):
    """SIGKILL the decode that serves greedy streams: each pauses, then continues on the
    surviving decode, and ends with exactly the tokens (and text) of an uninterrupted run."""
    h = Harness(etcd_server.endpoint, "pd-migrate/", tmp_path)
    try:
        svc, prefill, d0, d1 = start(h, decode_blocks=1024, num_decodes=2)
        survivor = await kill_mid_stream_and_check_migration(
            svc, [d0, d1], [f"migrating story {i} begins" for i in range(4)], max_tokens=1500,
            pause_bound_s=h.ttl_s + 2.0 + 6.0)  # lease TTL + eviction grace + recompute
        await wait_drained([prefill.http_url, survivor.http_url])
    finally:
        h.stop()


@pytest.mark.parametrize("mode", ["PULL", "PUSH", "PUSH-streamed"])
async def test_failed_transfer_is_recomputed_on_the_decode(etcd_server, tmp_path, mode):
    """A KV transfer that fails (fault injected on the side that moves the KV): the decode
    never runs on KV that did not arrive; the service has a decode recompute the prompt
    (MultiGenerations without KV) and the request completes; pools drain. Streamed (the
    prompts span several chunks, engine/pd/kv_stream.py): the stream stops at its failed
    push and the hand-over fails as a bulk one does."""
    h = Harness(etcd_server.endpoint, f"pd-xfer-fail-{mode}/", tmp_path)
    streamed = mode == "PUSH-streamed"
    mode = mode.split("-")[0]
    try:
        svc = h.service()
        common = ["--block-size", "8", "--kv-cache-transfer-mode", mode]
        settings = None
        if streamed:  # 16-token chunks; every prompt streams
            common += ["--max-num-batched-tokens", "16", "--max-num-seqs", "8"]
            settings = {"kv_stream_min_tokens": 8}
        mover = h.engine("DECODE" if mode == "PULL" else "PREFILL", "mover", extra=common,
                         fault="fail-transfers", settings=settings)
        other = h.engine("PREFILL" if mode == "PULL" else "DECODE", "other", extra=common)
        prefill, decode = (other, mover) if mode == "PULL" else (mover, other)
        for p in (prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        c = aclient(svc)
        for i in range(3):
            r = await c.completions.create(model="tiny",
                                           prompt=f"transfer {i} " * (12 if streamed else 6),
                                           max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert metric(prefill.http_url, "xllm_pd_transfer_failures_total") == 3
        if streamed:
            assert prefill.log_path.read_text(errors="replace").count(
                "stopped after 0 blocks") == 3
        assert migrations(svc, "ok") == 3 and migrations(svc, "failed") == 0
        await wait_drained([prefill.http_url, decode.http_url], timeout_s=10)
        assert metric(prefill.http_url, "xllm_kv_cache_blocks_used") == 0
        assert metric(decode.http_url, "xllm_kv_cache_blocks_used") == 0
    finally:
        h.stop()


@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
async def test_decode_dying_at_the_hand_over_gets_the_request_moved(etcd_server, tmp_path,
                                                                   mode):
    """A decode crashes as prefill hands a request over (FirstGeneration): prefill reports
    it unreachable and the service moves the request to the other decode at once (no
    lease wait), where it completes with the tokens of an uninterrupted run."""
    h = Harness(etcd_server.endpoint, f"pd-handover-crash-{mode}/", tmp_path)
    try:
        # Round robin: the second request at the latest meets the doomed decode (least
        # load would break the tie between two idle decodes by name, the same each time).
        svc = h.service(extra=["--load-balance-policy", "RR"])
        common = ["--block-size", "8", "--kv-cache-transfer-mode", mode]
        prefill = h.engine("PREFILL", "prefill", extra=common)
        good = h.engine("DECODE", "good", extra=common)
        doomed = h.engine("DECODE", "doomed", extra=common, fault="exit-at-first-generation")
        for p in (prefill, good, doomed):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        c = aclient(svc)
        body = {"ignore_eos": True, "return_token_ids": True}
        outputs = []
        for i in range(8):  # one at a time, until one of them has met the doomed decode
            t0 = time.monotonic()
            r = await c.completions.create(model="tiny", prompt=f"hand over {i}",
                                           max_tokens=24, temperature=0, extra_body=body)
            outputs.append((f"hand over {i}", r.choices[0].model_extra["token_ids"]))
            if not doomed.alive():
                took = time.monotonic() - t0
                print(f"\n{mode}: the request that met the dying decode took {took:.2f}s")
                assert took < h.ttl_s  # moved at once, not after the lease ran out
                break
        assert doomed.popen.wait(5) == EXIT_STATUS, "no request reached the doomed decode"
        assert migrations(svc, "ok") == 1 and migrations(svc, "failed") == 0
        for prompt, ids in outputs:  # the same on the good decode alone
            ref = await c.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                             temperature=0, extra_body=body)
            assert ids == ref.choices[0].model_extra["token_ids"]
        await wait_drained([prefill.http_url, good.http_url])
    finally:
        h.stop()
