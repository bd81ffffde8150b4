"""A PD pair in one process: a PREFILL and a DECODE engine (the tiny model), each with its
PDRole, wired by PairPeers (the PDPeers interface calling the other scheduler
directly; a KV transfer copies blocks from one engine's pool to the other's). A greedy
request handed over from prefill to decode gives exactly the tokens of a MIX run, and both
pools end empty: the hand-over itself is under test, not a stand-in for it."""
from __future__ import annotations

import asyncio

import pytest

from tests.unit.sinks import DoneSink
from tests.unit.pd_fakes import FakePeers, Reporter, until, until_free
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import CacheConfig, EngineConfig, InstanceRole, KVTransferMode, TransferConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.pd_messages import HandOver, KVMove, PeerLink, Placement
from xllm_py.engine.pd.phases import DecodePhase
from xllm_py.engine.pd.role import PDRole
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.sampling_params import SamplingParams

pytestmark = pytest.mark.integration  # starts the tiny model twice

PROMPT = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 + 8


class PairPeers(FakePeers):
    """Prefill's decode is `decode_pd`; transfers copy prefill's blocks into decode's."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_engine: LLMEngine | None = None
        self.decode_engine: LLMEngine | None = None
        self.decode_pd: PDRole | None = None

    async def link_instance(self, decode: InstanceMeta, prefill: InstanceMeta) -> None:
        await super().link_instance(decode, prefill)
        await self.decode_pd.links.link_instance(PeerLink(prefill.name, prefill.cluster_ids,
                                                    prefill.addrs, prefill))

    async def add_new_request(self, decode: InstanceMeta, prefill: InstanceMeta,
                              spec: EngineRequestSpec) -> Placement:
        [placement] = await self.decode_pd.decode.add_new_requests(prefill.name, [spec])
        return placement

    async def first_generation(self, decode: InstanceMeta, handover: HandOver,
                               timeout_s: float) -> str:
        self.handovers.append((decode.name, handover))
        [problem] = await self.decode_pd.decode.first_generation([handover])
        return problem

    async def _transfer(self, op: str, move: KVMove) -> None:
        self.moves.append((op, move))
        src = self.prefill_engine.storage.read_blocks(move.src_blocks)
        self.decode_engine.storage.write_blocks(move.dst_blocks, src)


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for d in o.outputs for t in d.token_ids]


async def _mix_tokens(engine: LLMEngine, rid: str, params: SamplingParams) -> list[int]:
    sink = DoneSink()
    engine.submit(EngineRequest(rid, PROMPT, params, sink))
    assert await asyncio.to_thread(sink.done.wait, 30)
    assert not sink.outputs[-1].error_code
    return _tokens(sink.outputs)


@pytest.fixture
async def pair(request):
    mode = request.param
    peers = PairPeers()
    engines, pds = [], []
    for role in (InstanceRole.DECODE, InstanceRole.PREFILL):
        config = EngineConfig(model="tiny", role=role, rpc_timeout_s=5.0,
                              cache=CacheConfig(enable_prefix_caching=True),
                              transfer=TransferConfig(mode=mode))
        engine = LLMEngine(config)
        engine.start()
        meta = InstanceMeta(name=f"{role.value.lower()}:1", type=role, block_size=16,
                            rpc_address="in-process", addrs=["in-process"], cluster_ids=[1])

        async def resolve_meta(name: str) -> InstanceMeta | None:
            return pds[0].links.meta if name == "decode:1" else None

        async def list_decodes() -> list[str]:
            return ["decode:1"]

        pd = PDRole(engine, config, meta, Reporter(), peers, resolve_meta, list_decodes,
                    latency_profile=None)
        pd.start()
        engines.append(engine)
        pds.append(pd)
    peers.decode_engine, peers.prefill_engine = engines
    peers.decode_pd = pds[0]
    yield engines[1], pds[1], engines[0], pds[0], peers
    for engine, pd in zip(engines, pds):
        await pd.stop()
        engine.stop()


@pytest.mark.parametrize("pair", [KVTransferMode.PULL, KVTransferMode.PUSH], indirect=True)
@pytest.mark.parametrize("decode_has_the_prefix", [False, True])
async def test_greedy_pd_request_gives_the_mix_tokens(pair, decode_has_the_prefix):
    prefill, prefill_pd, decode, decode_pd, peers = pair
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = None
    if decode_has_the_prefix:  # decode's prefix cache holds 2 of the 3 prompt blocks
        expected = await _mix_tokens(decode, "mix", params)
    prefill_pd.prefill.add_request(EngineRequestSpec(
        "r1", "r1", PROMPT, params, source_xservice_addr="service:1", decode_name="decode:1"))
    await until(lambda: any(o.finished for o in decode_pd.reporter.outputs("r1")),
                what="decode's last output")
    first = prefill_pd.reporter.outputs("r1")
    rest = decode_pd.reporter.outputs("r1")
    assert all(not o.error_code for o in first + rest)
    assert len(_tokens(first)) == 1 and rest[-1].num_generated_tokens == 12
    [(_, handover)] = peers.handovers
    assert len(handover.block_ids) == (1 if decode_has_the_prefix else 3)
    assert [op for op, _ in peers.moves] == [
        "pull" if peers.decode_engine.config.transfer.mode == KVTransferMode.PULL else "push"]
    if expected is None:
        expected = await _mix_tokens(decode, "mix", params)
    assert _tokens(first) + _tokens(rest) == expected
    assert decode_pd.decode.phase("r1") is None and prefill_pd.num_pending() == 0
    assert peers.links == [("decode:1", "prefill:1")]
    await until_free(prefill)
    await until_free(decode)


@pytest.mark.parametrize("pair", [KVTransferMode.PULL], indirect=True)
async def test_a_request_that_ends_on_prefill_frees_both_sides(pair):
    prefill, prefill_pd, decode, decode_pd, peers = pair
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill_pd.prefill.add_request(EngineRequestSpec(
        "r1", "r1", PROMPT, params, source_xservice_addr="service:1", decode_name="decode:1"))
    await until(lambda: peers.handovers, what="the hand-over")
    [(_, handover)] = peers.handovers
    assert handover.failed and handover.status_msg == "finished on prefill"
    [out] = prefill_pd.reporter.outputs("r1")
    assert out.finished and len(_tokens([out])) == 1
    # (the hand-over is recorded as it is sent: decode drops the request as it takes it)
    await until(lambda: decode_pd.decode.phase("r1") in (None, DecodePhase.DROPPED),
                what="decode dropping r1")
    await until_free(prefill)
    await until_free(decode)
    assert not decode_pd.reporter.outputs("r1") and not peers.moves
