"""DisaggPDScheduler on a real engine: a cancel never frees blocks a KV transfer may still
touch, and never leaves blocks held for good; a restarted decode is linked afresh.

The peers are left out: the KV transfer is the scheduler's own `_worker_transfer`,
replaced by one the test opens and closes, and the decode a prefill would notify sits
at an address nothing listens on."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import CacheConfig, EngineConfig, InstanceRole
from xllm_py.engine.disagg_scheduler import DisaggPDScheduler, _PrefillState
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc.convert import EngineRequestSpec, spec_to_proto
from xllm_py.sampling_params import SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16


class _Sink:
    def __init__(self) -> None:
        self.outputs = []

    def emit(self, output) -> None:
        self.outputs.append(output)


class _Reporter:
    """Collects what the scheduler would send to the service."""

    def __init__(self) -> None:
        self.sinks: list[_Sink] = []

    def sink(self, *args, **kwargs) -> _Sink:
        self.sinks.append(_Sink())
        return self.sinks[-1]

    def flush(self) -> None:
        pass


async def _on_engine(engine: LLMEngine, fn):
    return await asyncio.wrap_future(engine.call(fn))


async def _blocks_used(engine: LLMEngine) -> int:
    return await _on_engine(engine, lambda: engine.scheduler.kv.block_pool.num_used_blocks)


async def _still_held(engine: LLMEngine, blocks: list[int]) -> None:
    """A while later, the request's blocks are still in use (not freed under a transfer)."""
    await asyncio.sleep(0.2)
    assert await _blocks_used(engine) == len(blocks)


async def _until_free(engine: LLMEngine, timeout_s: float = 20.0) -> None:
    t0 = time.monotonic()
    while await _blocks_used(engine) or await _on_engine(engine, lambda: engine.scheduler.requests):
        assert time.monotonic() - t0 < timeout_s, "blocks still held"
        await asyncio.sleep(0.02)


@pytest.fixture
async def node(request):
    role = request.param
    config = EngineConfig(model="tiny", role=role, rpc_timeout_s=2.0,
                          cache=CacheConfig(enable_prefix_caching=False))
    engine = LLMEngine(config)
    engine.start()
    meta = InstanceMeta(name=f"{role.value.lower()}:1", type=role, block_size=16)
    pd = DisaggPDScheduler(engine, config, meta, _Reporter(), resolve_meta=None,
                           list_decodes=None, worker_rpc_addr="127.0.0.1:1")
    pd.start()
    yield engine, pd
    await pd.stop()
    engine.stop()


def _spec(rid: str = "r1") -> EngineRequestSpec:
    return EngineRequestSpec(request_id=rid, service_request_id=rid, prompt_token_ids=PROMPT,
                             params=SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True),
                             source_xservice_addr="127.0.0.1:2")


# ---------------------------------------------------------------------------- prefill
class _DecodeStub:
    """Records the FirstGeneration messages prefill sends to its decode peer."""

    def __init__(self) -> None:
        self.first_generations: list[pb.DisaggGenerationsRequest] = []

    async def FirstGeneration(self, msg, timeout=None):
        assert timeout is not None
        self.first_generations.extend(msg.gens)
        return pb.Status(ok=True)


@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_prefill_cancel_racing_the_first_token_frees_the_held_kv(node, monkeypatch):
    engine, pd = node
    decode_stub = _DecodeStub()
    monkeypatch.setattr(pd, "_pd_stub", lambda addr: decode_stub)
    spec = _spec()
    decode = InstanceMeta(name="decode:1", type=InstanceRole.DECODE, rpc_address="127.0.0.1:1")
    state = _PrefillState(spec, decode, decode_blocks=[0, 1, 2], num_cached_on_decode=0)
    pd._prefill[spec.request_id] = state
    pd._submit_prefill(spec, state)
    # The service's Cancel lands while the step that samples the first token runs: its
    # engine abort comes after that step and finds nothing to abort (here: no abort).
    assert pd.cancel(spec.request_id) is False
    await _until_free(engine)  # the hand-over hook frees the KV it would have held
    # ... and decode was told to drop the blocks it set aside.
    assert [(g.req_id, g.failed) for g in decode_stub.first_generations] == [("r1", True)]


@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_prefill_cancel_before_dispatch_is_the_engines(node):
    engine, pd = node
    assert pd.cancel("never-seen") is False  # nothing PD-side: the engine aborts it


# ---------------------------------------------------------------------------- decode
async def _add_on_decode(pd: DisaggPDScheduler, rid: str = "r1") -> list[int]:
    msg = pb.DisaggRequests(prefill_name="prefill:1")
    msg.reqs.append(spec_to_proto(_spec(rid)))
    reply = await pd.add_new_requests(msg)
    assert reply.reqs[0].status_code == 200
    return list(reply.reqs[0].blocks_ids)


def _first_generation(rid: str, blocks: list[int]) -> pb.DisaggGenerationsRequests:
    gen = pb.DisaggGenerationsRequest(req_id=rid, kv_cache_transfer_mode="PULL",
                                      addrs=["127.0.0.1:3"], cluster_ids=[7],
                                      block_ids=blocks, prefill_name="prefill:1")
    gen.tokens.add(token_id=11)
    return pb.DisaggGenerationsRequests(gens=[gen])


class _HeldPull:
    """A KV pull that runs until the test lets it end."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, op: str, req) -> None:
        self.started.set()
        await self.release.wait()


async def _take_over_with_a_held_pull(pd: DisaggPDScheduler, monkeypatch):
    """Request r1 placed on decode and its FirstGeneration in flight, its pull running
    until the test releases it. Returns (pull, blocks, the FirstGeneration task)."""
    pull = _HeldPull()
    monkeypatch.setattr(pd, "_worker_transfer", pull)
    blocks = await _add_on_decode(pd)
    call = asyncio.create_task(pd.first_generation(_first_generation("r1", blocks)))
    await asyncio.wait_for(pull.started.wait(), 5)
    return pull, blocks, call


@pytest.mark.parametrize("node", [InstanceRole.DECODE], indirect=True)
async def test_decode_caller_gone_mid_pull_frees_the_blocks_after_the_pull(node, monkeypatch):
    engine, pd = node
    pull, blocks, call = await _take_over_with_a_held_pull(pd, monkeypatch)
    call.cancel()  # the FirstGeneration RPC's deadline passed, or prefill went away
    await _still_held(engine, blocks)  # the pull may still write into them
    pull.release.set()
    await _until_free(engine)
    assert all(not o.outputs for o in pd.reporter.sinks)  # it never started decoding


@pytest.mark.parametrize("node", [InstanceRole.DECODE], indirect=True)
async def test_decode_cancel_mid_pull_frees_the_blocks_after_the_pull(node, monkeypatch):
    engine, pd = node
    pull, blocks, call = await _take_over_with_a_held_pull(pd, monkeypatch)
    assert pd.cancel("r1") is True  # not the engine's to abort yet
    await _still_held(engine, blocks)
    pull.release.set()
    status = await asyncio.wait_for(call, 5)
    assert not status.ok and "cancelled" in status.message
    await _until_free(engine)
    assert all(not o.outputs for o in pd.reporter.sinks)


@pytest.mark.parametrize("node", [InstanceRole.DECODE], indirect=True)
async def test_decode_cancel_before_first_generation_waits_for_it(node):
    engine, pd = node
    blocks = await _add_on_decode(pd)
    assert pd.cancel("r1") is True  # a PUSH may be writing into its blocks
    await _still_held(engine, blocks)
    # Prefill hands over (its push has ended): the blocks go, nothing is decoded.
    status = await pd.first_generation(_first_generation("r1", blocks))
    assert status.ok
    await _until_free(engine)
    assert all(not o.outputs for o in pd.reporter.sinks)


@pytest.mark.parametrize("node", [InstanceRole.DECODE], indirect=True)
async def test_decode_cancelled_request_without_first_generation_is_reaped(node):
    engine, pd = node
    blocks = await _add_on_decode(pd)
    assert pd.cancel("r1") is True
    now = time.monotonic()
    assert pd.reap_orphans(now) == []  # within the grace
    assert pd.reap_orphans(now + pd.cancel_grace_s + 1) == ["r1"]
    await _until_free(engine)
    assert len(blocks) == 3


@pytest.mark.parametrize("node", [InstanceRole.DECODE], indirect=True)
async def test_decode_take_over_then_cancel_is_the_engines(node, monkeypatch):
    engine, pd = node
    pull = _HeldPull()
    pull.release.set()
    monkeypatch.setattr(pd, "_worker_transfer", pull)
    blocks = await _add_on_decode(pd)
    status = await pd.first_generation(_first_generation("r1", blocks))
    assert status.ok
    assert pd.cancel("r1") is False  # decoding: the engine aborts it and frees its blocks
    engine.abort("r1")
    await _until_free(engine)


# ---------------------------------------------------------------------------- linking
class _LinkStub:
    def __init__(self) -> None:
        self.links: list[str] = []

    async def LinkInstance(self, info, timeout=None):
        assert timeout is not None
        self.links.append(info.instance_name)
        return pb.Status(ok=True)


@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_prefill_links_each_decode_incarnation_once(node, monkeypatch):
    engine, pd = node
    stub = _LinkStub()
    monkeypatch.setattr(pd, "_pd_stub", lambda addr: stub)
    first = InstanceMeta(name="decode:1", type=InstanceRole.DECODE, block_size=16,
                         incarnation_id="a")
    await pd._link(first)
    await pd._link(first)
    assert len(stub.links) == 1
    restarted = InstanceMeta(name="decode:1", type=InstanceRole.DECODE, block_size=16,
                             incarnation_id="b")
    await pd._link(restarted)
    assert len(stub.links) == 2


# ---------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_dispatch_takes_online_first_and_offline_without_delay(node, monkeypatch):
    engine, pd = node
    order: list[str] = []

    async def dispatch(spec) -> None:
        order.append(spec.request_id)

    monkeypatch.setattr(pd, "_dispatch", dispatch)
    for i in range(3):
        await pd.add_request(dataclasses.replace(_spec(f"off{i}"), offline=True))
    await pd.add_request(_spec("on0"))
    for _ in range(50):  # a few loop turns, no timer: nothing waits for a poll
        await asyncio.sleep(0)
    assert order[0] == "on0" and sorted(order[1:]) == ["off0", "off1", "off2"]
    await pd.add_request(dataclasses.replace(_spec("off3"), offline=True))
    for _ in range(50):
        await asyncio.sleep(0)
    assert order[-1] == "off3"


@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_dispatch_asks_the_master_for_decodes_only_if_the_chosen_one_fails(
        node, monkeypatch):
    engine, pd = node
    listed: list[int] = []
    placed: list[tuple[str, str]] = []
    full = {"d1"}

    async def list_decodes() -> list[str]:
        listed.append(1)
        return ["d1", "d2"]

    async def resolve(name: str) -> InstanceMeta:
        return InstanceMeta(name=name, type=InstanceRole.DECODE, block_size=16)

    async def link(decode) -> None:
        pass

    async def add_on_decode(spec, decode):
        return None if decode.name in full else pb.DisaggResponse(status_code=200)

    pd.list_decodes, pd.resolve_meta = list_decodes, resolve
    monkeypatch.setattr(pd, "_link", link)
    monkeypatch.setattr(pd, "_add_on_decode", add_on_decode)
    monkeypatch.setattr(pd, "_submit_prefill",
                        lambda spec, state: placed.append((spec.request_id, state.decode.name)))
    await pd._dispatch(dataclasses.replace(_spec("a"), decode_name="d2"))
    assert placed == [("a", "d2")] and listed == []  # no master round trip
    await pd._dispatch(dataclasses.replace(_spec("b"), decode_name="d1"))
    assert placed[-1] == ("b", "d2") and listed == [1]  # d1 full: the master's list
    full.add("d2")
    with pytest.raises(Exception, match="no KV space"):
        await pd._dispatch(dataclasses.replace(_spec("c"), decode_name="d1"))


@pytest.mark.parametrize("node", [InstanceRole.PREFILL], indirect=True)
async def test_prelink_links_new_decodes_once_and_skips_incompatible_ones(node, monkeypatch,
                                                                          caplog):
    engine, pd = node
    decode = InstanceRole.DECODE
    metas = {"d1": InstanceMeta(name="d1", type=decode, incarnation_id="a", block_size=16),
             "d2": InstanceMeta(name="d2", type=decode, incarnation_id="b", block_size=32)}
    stub = _LinkStub()

    async def list_decodes():
        return list(metas)

    async def resolve_meta(name):
        return metas.get(name)

    monkeypatch.setattr(pd, "list_decodes", list_decodes)
    monkeypatch.setattr(pd, "resolve_meta", resolve_meta)
    monkeypatch.setattr(pd, "_pd_stub", lambda addr: stub)
    assert await pd.prelink_once() == ["d1"]  # d2's block size differs: refused
    assert await pd.prelink_once() == []  # nothing new; d2 neither retried nor re-warned
    assert [r.message for r in caplog.records if "incompatible" in r.message] == [
        "prelink: decode d2 is incompatible: block_size differs: prefill:1 has 16, d2 has 32"]
    metas["d1"] = dataclasses.replace(metas["d1"], incarnation_id="c")  # d1 restarted
    assert await pd.prelink_once() == ["d1"]
    assert stub.links == ["prefill:1"] * 2 and "xllm_pd_linked_instances 1" in pd.metrics_text()
    del metas["d1"]  # gone from the master's list: forgotten
    assert await pd.prelink_once() == [] and "xllm_pd_linked_instances 0" in pd.metrics_text()
