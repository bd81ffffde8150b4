"""PDRole on a real engine (the tiny model), its peers faked (FakePeers: the
decode engines and the KV worker are in the test's process): a request is placed,
prefilled and handed over; a cancel never frees blocks a KV transfer may still touch,
and never leaves blocks held for good; refusals keep decode's status; a restarted
decode is linked afresh. Only public methods and the PDPeers interface are used."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time

import pytest

from tests.unit.pd_fakes import FakePeers, Reporter, blocks_used, on_engine, until, until_free
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import (CacheConfig, EngineConfig, InstanceRole, KVTransferMode,
                            PDSchedulerConfig, TransferConfig)
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.pd.handlers import DecodeHandler, PrefillHandler, Starting
from xllm_py.pd_messages import HandOver, OfflinePull
from xllm_py.engine.pd.phases import DecodePhase, PrefillPhase
from xllm_py.engine.pd.role import PDRole
from xllm_py.engine.self_profile import start_up_profile
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.status import Status, StatusError
from xllm_py.sampling_params import SamplingParams

pytestmark = pytest.mark.integration  # starts the tiny model

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16
DECODE = InstanceRole.DECODE


def _decode_meta(name: str, **kw) -> InstanceMeta:
    return InstanceMeta(name=name, type=DECODE, block_size=16, rpc_address="127.0.0.1:1",
                        addrs=["127.0.0.1:7"], cluster_ids=[7], **kw)


@pytest.fixture
async def make_node():
    made = []

    async def make(role: InstanceRole, mode: KVTransferMode = KVTransferMode.PULL,
                   list_decodes=None, profile: str | None = None, resolve=None, forget=None,
                   **pd_overrides):
        config = EngineConfig(model="tiny", role=role, rpc_timeout_s=2.0,
                              cache=CacheConfig(enable_prefix_caching=False),
                              transfer=TransferConfig(mode=mode), latency_profile_path=profile)
        engine = LLMEngine(config)
        start_up_profile(engine, config)  # (the file, as the engine process loads it)
        engine.start()
        meta = InstanceMeta(name=f"{role.value.lower()}:1", type=role, block_size=16,
                            addrs=["127.0.0.1:3"], cluster_ids=[3])
        peers = FakePeers()

        async def resolve_meta(name: str) -> InstanceMeta:
            return _decode_meta(name)

        async def one_decode() -> list[str]:
            return ["decode:1"]

        pd = PDRole(engine, config, meta, Reporter(), peers, resolve or resolve_meta,
                    list_decodes or one_decode, PDSchedulerConfig(**pd_overrides),
                    forget_meta=forget, latency_profile=engine.latency_profile)
        pd.start()
        made.append((engine, pd))
        return engine, pd, peers

    yield make
    for engine, pd in made:
        await pd.stop()
        engine.stop()


def _spec(rid: str = "r1", **kw) -> EngineRequestSpec:
    kw.setdefault("decode_name", "decode:1")
    return EngineRequestSpec(request_id=rid, service_request_id=rid, prompt_token_ids=PROMPT,
                             params=SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True),
                             source_xservice_addr="127.0.0.1:2", **kw)


# ---------------------------------------------------------------------------- prefill
async def test_a_placement_whose_answer_is_lost_is_dropped_on_that_decode(make_node):
    """AddNewRequests reached the decode (it set blocks aside) but its answer was lost (a
    cut link): the prefill tells that decode to drop them; the request goes on elsewhere
    or fails saying why, never 'no KV space' (the blocks used to stay until the decode's
    orphan timeout)."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    peers.lost_answers.add("decode:1")
    pd.prefill.add_request(_spec())
    await until(lambda: any(h.failed for _, h in peers.handovers), what="the drop")
    assert [(d, h.request_id, h.failed) for d, h in peers.handovers
            if h.failed] == [("decode:1", "r1", True)]
    await until(lambda: pd.reporter.outputs("r1"), what="the request's end")
    out = pd.reporter.outputs("r1")[-1]
    assert "no KV space" not in out.error_message


async def test_the_drop_is_retried_while_the_decode_cannot_be_reached(make_node):
    """A partition: the AddNewRequests answer is lost and the first drops cannot connect;
    the drop is sent again until the decode hears it (a delayed AddNewRequests may reach
    the decode when the partition heals: the drop must follow it)."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    peers.lost_answers.add("decode:1")
    peers.unreachable_first_generations = 3
    pd.prefill.add_request(_spec())
    await until(lambda: any(h.failed for _, h in peers.handovers), what="the drop")
    assert peers.unreachable_first_generations == 0
    assert [(d, h.request_id) for d, h in peers.handovers if h.failed] == [("decode:1", "r1")]


async def test_prefill_places_prefills_and_hands_over(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    pd.prefill.add_request(_spec())
    await until(lambda: peers.handovers, what="FirstGeneration")
    [(decode, h)] = peers.handovers
    assert decode == "decode:1" and peers.placements == [("r1", "decode:1")]
    assert not h.failed and h.mode == "PULL" and len(h.token_ids) == 1
    assert len(h.block_ids) == 3 and h.addrs == ["127.0.0.1:3"] and h.cluster_ids == [3]
    await until_free(engine)  # FirstGeneration answered: the held KV is freed
    [first] = pd.reporter.outputs("r1")  # the first token went to the service
    assert first.outputs[0].token_ids == h.token_ids and not first.error_code
    assert pd.prefill.phase("r1") is None and pd.num_pending() == 0


async def test_prefill_push_writes_decodes_blocks_before_first_generation(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL, KVTransferMode.PUSH)
    pd.prefill.add_request(_spec())
    await until(lambda: peers.handovers, what="FirstGeneration")
    [(op, move)] = peers.moves
    [(_, h)] = peers.handovers
    assert op == "push" and move.dst_blocks == peers.block_ids
    assert move.src_blocks == h.block_ids and move.addr == "127.0.0.1:7"
    assert h.mode == "PUSH" and not h.failed
    await until_free(engine)


async def test_prefill_failed_push_fails_the_request_and_frees_both_sides(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL, KVTransferMode.PUSH)
    peers.transfer_error = StatusError(Status.BAD_GATEWAY, "KV push failed: boom")
    pd.prefill.add_request(_spec())
    await until(lambda: pd.reporter.errors(), what="the error report")
    assert pd.reporter.errors() == [("r1", 502, "KV push failed: boom")]
    [(_, h)] = peers.handovers  # decode heard of it, to free its blocks
    assert h.failed and h.status_msg == "KV push failed: boom"
    assert pd.metrics.registry.get_sample_value("xllm_pd_transfer_failures_total") == 1
    await until_free(engine)


@pytest.mark.parametrize("status", [Status.INVALID_ARGUMENT, Status.INTERNAL])
async def test_prefill_reports_decodes_refusal_with_decodes_status(make_node, status):
    """A decode that refuses a request (400: it cannot hold the prompt; 500: it broke)
    fails it with that same status, not another one."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    peers.refuse["decode:1"] = status
    pd.prefill.add_request(_spec())
    await until(lambda: pd.reporter.errors(), what="the error report")
    assert pd.reporter.errors() == [("r1", status.http_status, "decode:1 refuses it")]
    assert await blocks_used(engine) == 0 and pd.num_pending() == 0


async def test_prefill_cancel_racing_the_first_token_frees_the_held_kv(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    held = threading.Event()
    engine.call(lambda: held.wait(10))  # the engine thread is busy: the step waits
    pd.prefill.add_request(_spec())
    await until(lambda: pd.prefill.phase("r1") is PrefillPhase.PREFILLING, what="placement")
    # The service's Cancel lands while the step that samples the first token runs: its
    # engine abort comes after that step and finds nothing to abort (here: no abort).
    pd.prefill.cancel("r1")
    assert pd.prefill.phase("r1") is None and pd.num_pending() == 0
    held.set()
    await until_free(engine)  # the hand-over hook frees the KV it would have held
    # ... and decode was told to drop the blocks it set aside, and nothing else.
    assert [(h.request_id, h.failed, h.status_msg) for _, h in peers.handovers] == [
        ("r1", True, "cancelled")]


async def test_prefill_cancel_while_placing_never_reaches_the_engine(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    peers.place_gate = asyncio.Event()
    pd.prefill.add_request(_spec())
    await asyncio.wait_for(peers.place_started.wait(), 5)
    assert pd.prefill.phase("r1") is PrefillPhase.DISPATCHING and pd.num_pending() == 1
    pd.prefill.cancel("r1")
    peers.place_gate.set()  # decode placed it meanwhile: it is told to drop it
    await until(lambda: peers.handovers, what="the drop")
    assert [(h.request_id, h.failed) for _, h in peers.handovers] == [("r1", True)]
    assert pd.num_pending() == 0 and not pd.reporter.outputs("r1")
    assert await on_engine(engine, lambda: engine.num_generated_tokens) == 0


async def test_prefill_cancel_of_an_unknown_request_is_the_engines(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    pd.handler().cancel("never-seen")  # nothing PD-side: the engine aborts it
    await _turns()
    assert pd.num_pending() == 0 and not peers.handovers


# ---------------------------------------------------------------------------- handlers
async def test_each_role_serves_its_rpcs_and_refuses_the_others(make_node):
    """The servicer's handler for the role: a PREFILL queues Generate on its side and
    refuses the decode's RPCs; a DECODE refuses a pull signal; before the role is up,
    a PREFILL refuses requests."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    handler = pd.handler()
    assert isinstance(handler, PrefillHandler)
    peers.place_gate = asyncio.Event()  # (it stays dispatching)
    handler.generate(_spec())
    assert handler.num_pending() == 1 and pd.prefill.phase("r1") is not None
    handler.cancel("r1")
    assert handler.num_pending() == 0
    for call in (handler.add_new_requests("p", []), handler.first_generation([]),
                 handler.multi_generations([])):
        with pytest.raises(StatusError) as e:
            await call
        assert e.value.status is Status.FAILED_PRECONDITION, e.value.message
    peers.place_gate.set()
    starting = Starting(engine, pd.reporter, InstanceRole.PREFILL)
    with pytest.raises(StatusError, match="prefill instance is starting"):
        starting.generate(_spec("r2"))
    _, decode_pd, _ = await make_node(DECODE)
    decode = decode_pd.handler()
    assert isinstance(decode, DecodeHandler)
    with pytest.raises(StatusError, match="SendPullSignal is served by PREFILL"):
        decode.on_pull(OfflinePull("decode:9", preferred_req_len=1, max_total_len=10))


# ---------------------------------------------------------------------------- dispatch
async def _turns(n: int = 100) -> None:
    for _ in range(n):  # a few loop turns, no timer: nothing waits for a poll
        await asyncio.sleep(0)


async def test_dispatch_takes_online_first_and_offline_only_on_a_pull(make_node):
    """Offline requests wait for a decode's pull (SendPullSignal); a pull takes at most
    preferred_req_len of them, in arrival order, within max_total_len tokens (prompt +
    max_tokens: 48 each here), each placed on the pulling decode."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    peers.refuse["decode:9"] = Status.INVALID_ARGUMENT  # no prefill work: order only
    peers.refuse["decode:1"] = Status.INVALID_ARGUMENT
    for i in range(4):
        pd.prefill.add_request(_spec(f"off{i}", offline=True))
    pd.prefill.add_request(_spec("on0"))
    await _turns()
    assert peers.asked == ["on0"]  # offline work waits for a pull
    assert pd.prefill.on_pull(OfflinePull("decode:9", preferred_req_len=3, max_total_len=100)) == 2
    await _turns()
    assert peers.asked == ["on0", "off0", "off1"]
    assert [n for r, n in peers.refused_on if r.startswith("off")] == ["decode:9"] * 2
    assert pd.prefill.on_pull(OfflinePull("decode:9", preferred_req_len=1, max_total_len=10**6)) == 1
    pd.prefill.cancel("off3")
    assert pd.prefill.on_pull(OfflinePull("decode:9", preferred_req_len=5, max_total_len=10**6)) == 0
    await _turns()
    assert peers.asked == ["on0", "off0", "off1", "off2"]
    text = pd.metrics_text()
    assert "xllm_pd_pulls_received_total 3.0" in text
    assert "xllm_pd_offline_handed_total 3.0" in text


async def test_dispatch_places_only_while_the_placed_prompts_leave_room(make_node):
    """max_placed_prompt_tokens: a queued request asks a decode for blocks only while the
    prompts placed and not handed over hold fewer tokens; the next one goes as soon as
    one is handed over (its decode blocks are not held while it queues here)."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL, max_placed_prompt_tokens=60)
    peers.place_gate = asyncio.Event()
    for rid in ("r1", "r2", "r3"):
        pd.prefill.add_request(_spec(rid))
    await until(lambda: peers.asked == ["r1", "r2"], what="two placements asked")
    await asyncio.sleep(0.2)  # a gap in which r3 would be asked for, were it not held
    assert peers.asked == ["r1", "r2"]  # 80 placed tokens >= 60
    assert pd.prefill.pacer.placed_prompt_tokens() == 80
    assert pd.prefill.phase("r3") is PrefillPhase.QUEUED and pd.num_pending() == 3
    peers.place_gate.set()
    await until(lambda: len(peers.handovers) == 3, what="all three handed over")
    assert peers.asked == ["r1", "r2", "r3"]
    await until_free(engine)
    assert pd.prefill.pacer.placed_prompt_tokens() == 0


async def test_dispatch_places_a_prompt_longer_than_the_limit_alone(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL, max_placed_prompt_tokens=10)
    pd.prefill.add_request(_spec("r1"))
    pd.prefill.add_request(_spec("r2"))
    await until(lambda: len(peers.handovers) == 2, what="both handed over, one at a time")
    assert peers.asked == ["r1", "r2"]
    await until_free(engine)


@pytest.mark.parametrize("order", ["deadline", "fcfs"])
async def test_dispatch_order_puts_a_request_that_can_still_make_its_ttft_first(
        make_node, tmp_path, order):
    """prefill_order deadline: with r1 placed ahead (1 ms per prompt token predicted:
    40 ms), `late` (target 1 ms: missed whatever is done) yields to `ontime` (60 s) that
    arrived after it; fcfs keeps arrival order."""
    from xllm_py.cluster.latency_profile import LatencyProfile

    profile = tmp_path / "profile.json"
    data = LatencyProfile(prefill_base_ms=0.0, prefill_ms_per_token=1.0, decode_base_ms=1.0,
                   decode_ms_per_seq=0.1, decode_ms_per_ctx_token=0.0).to_dict()
    profile.write_text(json.dumps(data))
    engine, pd, peers = await make_node(InstanceRole.PREFILL, profile=str(profile),
                                        max_placed_prompt_tokens=10, prefill_order=order)
    peers.place_gate = asyncio.Event()
    pd.prefill.add_request(_spec("r1"))
    await until(lambda: peers.asked == ["r1"], what="r1 placed")
    pd.prefill.add_request(_spec("late", ttft_slo_ms=1))
    pd.prefill.add_request(_spec("ontime", ttft_slo_ms=60_000))
    pd.prefill.add_request(_spec("none"))
    peers.place_gate.set()
    await until(lambda: len(peers.handovers) == 4, what="all four handed over")
    expected = ["ontime", "late", "none"] if order == "deadline" else ["late", "ontime", "none"]
    assert peers.asked == ["r1"] + expected
    await until_free(engine)


async def test_deadline_order_places_the_next_request_just_in_time(make_node, tmp_path):
    """With a latency profile the next request is placed only once the work placed ahead
    is predicted done within PLACE_LEAD_S (here r1: 40 tokens at 100 ms = 4 s, so r2
    waits for r1's first token, not for the placement gate, which is off)."""
    from xllm_py.cluster.latency_profile import LatencyProfile

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LatencyProfile(
        prefill_base_ms=0.0, prefill_ms_per_token=100.0, decode_base_ms=1.0,
        decode_ms_per_seq=0.1, decode_ms_per_ctx_token=0.0).to_dict()))
    engine, pd, peers = await make_node(InstanceRole.PREFILL, profile=str(profile),
                                        max_placed_prompt_tokens=0)
    peers.place_gate = asyncio.Event()
    pd.prefill.add_request(_spec("r1"))
    pd.prefill.add_request(_spec("r2"))
    await until(lambda: peers.asked == ["r1"], what="r1 placed")
    await asyncio.sleep(0.3)  # a gap in which r2 would be asked for, were it not held
    assert peers.asked == ["r1"] and pd.prefill.phase("r2") is PrefillPhase.QUEUED
    peers.place_gate.set()
    await until(lambda: len(peers.handovers) == 2, what="both handed over")
    assert peers.asked == ["r1", "r2"]
    await until_free(engine)


async def test_a_decode_restarted_elsewhere_is_linked_at_its_new_address(make_node):
    """The cached meta of a decode names where it listened before a restart (same name,
    new port): the link fails, the meta is read again past the cache, and the request
    goes to the new address instead of failing with "cannot link"."""
    stale = InstanceMeta(name="decode:1", type=DECODE, block_size=16,
                         rpc_address="127.0.0.1:1", addrs=["127.0.0.1:7"], cluster_ids=[7],
                         incarnation_id="old")
    etcd = {"decode:1": dataclasses.replace(stale, rpc_address="127.0.0.1:2",
                                            incarnation_id="new")}
    cache = {"decode:1": stale}
    forgot: list[str] = []

    async def resolve(name: str) -> InstanceMeta:
        return cache.get(name) or etcd[name]

    def forget(name: str) -> None:
        forgot.append(name)
        cache.pop(name, None)

    engine, pd, peers = await make_node(InstanceRole.PREFILL, resolve=resolve, forget=forget)
    peers.dead_addresses.add("127.0.0.1:1")
    pd.prefill.add_request(_spec("r1"))
    await until(lambda: len(peers.handovers) == 1, what="handed over at the new address")
    assert forgot == ["decode:1"] and [d for d, _ in peers.links] == ["decode:1"]
    assert peers.placements == [("r1", "decode:1")]
    await until_free(engine)


async def test_a_failed_engine_step_ends_the_prefill_record_and_frees_its_place(make_node):
    """The engine fails a step (its requests get an error): their records end, decode is
    told to drop its blocks, and the place they held goes to the next request."""
    engine, pd, peers = await make_node(InstanceRole.PREFILL, max_placed_prompt_tokens=10)
    real_step, failed = engine.runner.execute_step, []

    def failing_step(seqs):
        if not failed:
            failed.append(True)
            raise RuntimeError("injected step failure")
        return real_step(seqs)

    engine.runner.execute_step = failing_step
    pd.prefill.add_request(_spec("r1"))
    pd.prefill.add_request(_spec("r2"))
    await until(lambda: pd.reporter.errors(), what="r1's error report")
    assert [e[:2] for e in pd.reporter.errors()] == [("r1", 500)]
    await until(lambda: any(h.failed for _, h in peers.handovers), what="decode told to drop")
    await until(lambda: [h.request_id for _, h in peers.handovers if not h.failed] == ["r2"],
                what="r2 placed and handed over")
    assert pd.prefill.phase("r1") is None
    await until_free(engine)
    assert pd.num_pending() == 0 and pd.prefill.pacer.placed_prompt_tokens() == 0


async def test_dispatch_asks_the_master_for_decodes_only_if_the_chosen_one_fails(make_node):
    listed: list[int] = []

    async def list_decodes() -> list[str]:
        listed.append(1)
        return ["d1", "d2"]

    engine, pd, peers = await make_node(InstanceRole.PREFILL, list_decodes=list_decodes,
                                        attempts_per_decode=1, backoff_s=0.0,
                                        prelink_interval_s=3600)
    await until(lambda: listed, what="the first prelink round")
    listed.clear()
    peers.full.add("d1")
    pd.prefill.add_request(_spec("a", decode_name="d2"))
    await until(lambda: peers.placements, what="placement of a")
    assert peers.placements == [("a", "d2")] and listed == []  # no master round trip
    pd.prefill.add_request(_spec("b", decode_name="d1"))
    await until(lambda: len(peers.placements) == 2, what="placement of b")
    assert peers.placements[-1] == ("b", "d2") and listed == [1]  # d1 full: the list
    peers.full.add("d2")
    pd.prefill.add_request(_spec("c", decode_name="d1"))
    await until(lambda: pd.reporter.errors(), what="the error report")
    [(rid, code, message)] = pd.reporter.errors()
    assert (rid, code) == ("c", 503) and "no KV space" in message
    await until_free(engine)


# ---------------------------------------------------------------------------- linking
async def test_prefill_links_each_decode_incarnation_once(make_node):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    first = _decode_meta("decode:1", incarnation_id="a")
    await pd.links.link(first)
    await pd.links.link(first)
    assert len(peers.links) == 1
    await pd.links.link(_decode_meta("decode:1", incarnation_id="b"))  # restarted
    assert len(peers.links) == 2


async def test_prelink_links_new_decodes_once_and_skips_incompatible_ones(make_node, caplog):
    engine, pd, peers = await make_node(InstanceRole.PREFILL)
    metas = {"d1": _decode_meta("d1", incarnation_id="a"),
             "d2": dataclasses.replace(_decode_meta("d2", incarnation_id="b"), block_size=32)}

    async def list_decodes():
        return list(metas)

    async def resolve_meta(name):
        return metas.get(name)

    pd.links.list_decodes, pd.links.resolve_meta = list_decodes, resolve_meta
    linked = lambda: pd.metrics.registry.get_sample_value("xllm_pd_linked_instances")  # noqa: E731
    assert await pd.links.prelink_once() == ["d1"]  # d2's block size differs: refused
    assert await pd.links.prelink_once() == []  # nothing new; d2 neither retried nor re-warned
    assert [r.message for r in caplog.records if "incompatible" in r.message] == [
        "prelink: decode d2 is incompatible: block_size differs: prefill:1 has 16, d2 has 32"]
    metas["d1"] = dataclasses.replace(metas["d1"], incarnation_id="c")  # d1 restarted
    assert await pd.links.prelink_once() == ["d1"]
    assert peers.links == [("d1", "prefill:1")] * 2 and linked() == 1
    assert "xllm_pd_linked_instances 1.0" in pd.metrics_text()
    del metas["d1"]  # gone from the master's list: forgotten
    assert await pd.links.prelink_once() == [] and linked() == 0


# ---------------------------------------------------------------------------- decode
async def _add_on_decode(pd: PDRole, rid: str = "r1") -> list[int]:
    [placement] = await pd.decode.add_new_requests("prefill:1", [_spec(rid)])
    assert placement.status is Status.OK, placement
    return placement.block_ids


def _first_generation(rid: str, blocks: list[int], **kw) -> HandOver:
    return HandOver(rid, prefill_name="prefill:1", mode="PULL", token_ids=[11],
                    logprobs=[None], addrs=["127.0.0.1:3"], cluster_ids=[7],
                    block_ids=blocks, **kw)


async def test_an_add_new_requests_that_comes_after_its_drop_is_refused(make_node):
    """The prefill's drop overtook its AddNewRequests (delayed past its deadline): the late
    call is refused, no blocks set aside for a request nobody will hand over."""
    engine, pd, peers = await make_node(DECODE)
    drop = HandOver("r9", prefill_name="prefill:1", failed=True, status_msg="cancelled")
    [problem] = await pd.decode.first_generation([drop])
    assert "unknown request" in problem
    [placement] = await pd.decode.add_new_requests("prefill:1", [_spec("r9")])
    assert placement.status is Status.INVALID_ARGUMENT and "dropped" in placement.message
    assert pd.decode.num_open() == 0
    await _add_on_decode(pd, "r9b")  # other requests are placed as before
    assert pd.decode.num_open() == 1


@contextlib.asynccontextmanager
async def _admitting(engine: LLMEngine, pd: PDRole, rid: str):
    """An AddNewRequests of `rid` under way while the engine thread is held (the
    admission waits for it until the block ends). Yields the call's task."""
    gate = threading.Event()
    busy = engine.call(lambda: gate.wait(10))
    try:
        add = asyncio.create_task(pd.decode.add_new_requests("prefill:1", [_spec(rid)]))
        await asyncio.sleep(0.05)
        assert not add.done()
        yield add
    finally:
        gate.set()
        await asyncio.wrap_future(busy)


async def test_a_drop_that_comes_while_the_engine_admits_frees_the_blocks(make_node):
    """The drop came after its AddNewRequests reached the decode but before the engine
    had set the blocks aside (no record yet): the admission's blocks are freed and the
    call refused, not held until the orphan reaper."""
    engine, pd, peers = await make_node(DECODE)
    async with _admitting(engine, pd, "r7") as add:
        drop = HandOver("r7", prefill_name="prefill:1", failed=True, status_msg="cancelled")
        [problem] = await pd.decode.first_generation([drop])
        assert "unknown request" in problem
    [placement] = await add
    assert placement.status is Status.INVALID_ARGUMENT and "dropped" in placement.message
    assert pd.decode.num_open() == 0
    await until_free(engine)


async def test_an_add_new_requests_given_up_during_the_admission_frees_the_blocks(make_node):
    """The AddNewRequests call was cancelled (its deadline passed; a call a partition held
    back arrives with its cancel behind it) while the engine admitted it: the blocks the
    admission set aside have no record, and are freed when the engine answers."""
    engine, pd, peers = await make_node(DECODE)
    async with _admitting(engine, pd, "r8") as add:
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
    assert pd.decode.num_open() == 0
    await until_free(engine)
    await _add_on_decode(pd, "r8")  # the id is not held: placed again as new
    assert pd.decode.num_open() == 1


async def _take_over_with_a_held_pull(pd: PDRole, peers: FakePeers):
    """Request r1 placed on decode and its FirstGeneration in flight, its pull running
    until the test sets peers.transfer_gate. Returns (blocks, the FirstGeneration task)."""
    peers.transfer_gate = asyncio.Event()
    blocks = await _add_on_decode(pd)
    call = asyncio.create_task(pd.decode.first_generation([_first_generation("r1", blocks)]))
    await asyncio.wait_for(peers.transfer_started.wait(), 5)
    assert pd.decode.phase("r1") is DecodePhase.PULLING
    return blocks, call


async def _still_held(engine: LLMEngine, blocks: list[int]) -> None:
    """A while later, the request's blocks are still in use (not freed under a transfer)."""
    await asyncio.sleep(0.2)
    assert await blocks_used(engine) == len(blocks)


async def test_decode_takes_over_pulls_and_decodes(make_node):
    engine, pd, peers = await make_node(DECODE)
    blocks = await _add_on_decode(pd)
    assert pd.decode.phase("r1") is DecodePhase.ALLOCATED and len(blocks) == 3
    assert await pd.decode.first_generation([_first_generation("r1", blocks)]) == [""]
    [(op, move)] = peers.moves
    assert (op, move.src_blocks, move.dst_blocks, move.addr) == ("pull", blocks, blocks,
                                                                 "127.0.0.1:3")
    await until_free(engine)  # decoded to max_tokens
    outputs = pd.reporter.outputs("r1")
    assert outputs[-1].finished and outputs[-1].num_generated_tokens == 8
    assert sum(len(d.token_ids) for o in outputs for d in o.outputs) == 7  # + prefill's


async def test_decode_refuses_a_prompt_it_cannot_hold_with_invalid_argument(make_node):
    engine, pd, peers = await make_node(DECODE)
    too_long = dataclasses.replace(_spec(), prompt_token_ids=[5] * (engine.max_model_len + 1))
    [placement] = await pd.decode.add_new_requests("prefill:1", [too_long])
    assert placement.status is Status.INVALID_ARGUMENT and "decode can hold" in placement.message
    assert await blocks_used(engine) == 0


async def test_decode_failed_pull_fails_the_request(make_node):
    engine, pd, peers = await make_node(DECODE)
    peers.transfer_error = StatusError(Status.BAD_GATEWAY, "KV pull failed: boom")
    blocks = await _add_on_decode(pd)
    assert await pd.decode.first_generation([_first_generation("r1", blocks)]) == [
        "KV pull failed: boom"]
    await until_free(engine)  # never decoded on KV that did not arrive
    [out] = pd.reporter.outputs("r1")
    assert (out.error_code, out.error_message) == (502, "KV pull failed: boom")
    assert pd.metrics.registry.get_sample_value("xllm_pd_transfer_failures_total") == 1


async def test_decode_caller_gone_mid_pull_frees_the_blocks_after_the_pull(make_node):
    engine, pd, peers = await make_node(DECODE)
    blocks, call = await _take_over_with_a_held_pull(pd, peers)
    call.cancel()  # the FirstGeneration RPC's deadline passed, or prefill went away
    await _still_held(engine, blocks)  # the pull may still write into them
    assert pd.decode.phase("r1") is DecodePhase.GONE
    peers.transfer_gate.set()
    await until_free(engine)
    assert not pd.reporter.outputs("r1")  # it never started decoding


async def test_decode_cancel_mid_pull_frees_the_blocks_after_the_pull(make_node):
    engine, pd, peers = await make_node(DECODE)
    blocks, call = await _take_over_with_a_held_pull(pd, peers)
    assert pd.decode.cancel("r1") is True  # not the engine's to abort yet
    await _still_held(engine, blocks)
    peers.transfer_gate.set()
    [problem] = await asyncio.wait_for(call, 5)
    assert "cancelled" in problem
    await until_free(engine)
    assert not pd.reporter.outputs("r1")


async def test_decode_cancel_before_first_generation_frees_at_once_in_pull_mode(make_node):
    """PULL: nothing but the decode's own pull writes into its blocks, so a cancel (the
    service's, also when the prefill died before the hand-over) frees them now; a late
    FirstGeneration is answered as for a dropped request."""
    engine, pd, peers = await make_node(DECODE)
    blocks = await _add_on_decode(pd)
    assert blocks and pd.decode.cancel("r1") is True
    assert pd.decode.phase("r1") is None
    await until_free(engine)
    await pd.decode.first_generation([_first_generation("r1", blocks)])  # too late: nothing runs
    await until_free(engine)
    assert not pd.reporter.outputs("r1") and not peers.moves


async def test_decode_cancel_before_first_generation_waits_for_it(make_node):
    engine, pd, peers = await make_node(DECODE, KVTransferMode.PUSH)
    blocks = await _add_on_decode(pd)
    assert pd.decode.cancel("r1") is True  # a PUSH may be writing into its blocks
    assert pd.decode.phase("r1") is DecodePhase.CANCELLED
    await _still_held(engine, blocks)
    # Prefill hands over (its push has ended): the blocks go, nothing is decoded.
    assert await pd.decode.first_generation([_first_generation("r1", blocks)]) == [""]
    await until_free(engine)
    assert not pd.reporter.outputs("r1") and not peers.moves


async def test_decode_cancelled_request_without_first_generation_is_reaped(make_node):
    engine, pd, peers = await make_node(DECODE, KVTransferMode.PUSH)
    blocks = await _add_on_decode(pd)
    assert pd.decode.cancel("r1") is True
    now = time.monotonic()
    assert pd.decode.reap_orphans(now) == []  # within the grace
    assert pd.decode.reap_orphans(now + pd.decode.cancel_grace_s + 1) == ["r1"]
    await until_free(engine)
    assert len(blocks) == 3 and not pd.reporter.outputs("r1")


async def test_decode_request_whose_first_generation_never_comes_fails(make_node):
    engine, pd, peers = await make_node(DECODE, orphan_timeout_s=5.0)
    await _add_on_decode(pd)
    assert pd.decode.reap_orphans(time.monotonic() + 6) == ["r1"]
    await until_free(engine)
    [out] = pd.reporter.outputs("r1")
    assert out.error_code == 502 and "never handed the request over" in out.error_message


async def test_decode_take_over_then_cancel_is_the_engines(make_node):
    engine, pd, peers = await make_node(DECODE)
    blocks = await _add_on_decode(pd)
    assert await pd.decode.first_generation([_first_generation("r1", blocks)]) == [""]
    assert pd.decode.cancel("r1") is False  # decoding: the engine aborts it and frees its blocks
    engine.abort("r1")
    await until_free(engine)
    # A second FirstGeneration for it finds nothing to take over.
    assert await pd.decode.first_generation([_first_generation("r1", blocks)]) == ["unknown request r1"]


async def test_a_decode_engine_hands_no_request_over(make_node):
    engine, pd, peers = await make_node(DECODE)
    engine.set_connector(pd.connector)  # (the decode's: it hands nothing over)
    pd.connector.hands_over = True  # (a prefill's)
    with pytest.raises(ValueError, match="a DECODE engine hands no request over"):
        engine.set_connector(pd.connector)
