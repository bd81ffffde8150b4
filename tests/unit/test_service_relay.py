"""ServiceBackend.on_generations: in-order relay, PD first-token ordering, cancelled
requests answered ok=false, eviction fails in-flight requests (a dead prefill only those
that still wait for decode's first output)."""
from __future__ import annotations

import asyncio

import pytest

from xllm_py.api.backend import GenerateRequest
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2 as pb
from xllm_service.backend import ServiceBackend, _Sub
from xllm_service.instance_table import InstanceInfo, InstanceState
from xllm_service.router import RoundRobinPolicy, Route, Router


def info(name: str, role: InstanceRole, addr: str = "127.0.0.1:1") -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role, rpc_address=addr),
                        InstanceState.ACTIVE, 0.0)


def backend() -> ServiceBackend:
    return ServiceBackend(None, "tiny", 2048, Router(lambda role: [], RoundRobinPolicy()),
                          "127.0.0.1:0")


def gen(rid: str, tokens: list[int], finished=False, on_prefill=False, code=200):
    g = pb.DisaggStreamGeneration(req_id=rid, service_req_id=rid, finished=finished,
                                  finished_on_prefill_instance=on_prefill,
                                  gen_status=pb.GenStatus(status_code=code))
    g.outputs.add(index=0, token_ids=tokens)
    return g


def register(b: ServiceBackend, rid: str, route: Route) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    b._subs[rid] = _Sub(rid, 0, route, q)
    for name in route.instance_names:
        b._by_instance[name].add(rid)
    return q


def drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait()[1])
    return out


async def test_pd_decode_outputs_wait_for_prefill_first_token():
    b = backend()
    q = register(b, "r1", Route(info("p", InstanceRole.PREFILL), info("d", InstanceRole.DECODE)))
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen("r1", [2])]))
    assert [s.ok for s in reply.all_status] == [True]
    assert drain(q) == []  # decode's token 2 is held until prefill's token 1 arrives
    await b.on_generations(pb.DisaggStreamGenerations(gens=[gen("r1", [1], on_prefill=True)]))
    await b.on_generations(pb.DisaggStreamGenerations(gens=[gen("r1", [3], finished=True)]))
    assert [o.outputs[0].token_ids for o in drain(q)] == [[1], [2], [3]]


async def test_unknown_or_cancelled_requests_get_ok_false():
    b = backend()
    q = register(b, "r2", Route(info("m", InstanceRole.MIX)))
    b._subs["r2"].cancelled = True
    reply = await b.on_generations(pb.DisaggStreamGenerations(
        gens=[gen("r2", [1]), gen("nope", [1])]))
    assert [s.ok for s in reply.all_status] == [False, False]
    assert drain(q) == []


async def test_engine_error_passes_through_and_eviction_fails_inflight():
    b = backend()
    q1 = register(b, "r3", Route(info("m", InstanceRole.MIX)))
    q2 = register(b, "r4", Route(info("m", InstanceRole.MIX)))
    await b.on_generations(pb.DisaggStreamGenerations(gens=[gen("r3", [], True, code=502)]))
    (out,) = drain(q1)
    assert out.failed and out.error_code == 502
    b.on_evict(info("m", InstanceRole.MIX))
    (out,) = drain(q2)
    assert out.failed and out.error_code == 503 and "left the cluster" in out.error_message


def test_readiness_checks_do_not_shift_round_robin():
    mixes = [info("a", InstanceRole.MIX), info("b", InstanceRole.MIX)]
    router = Router(lambda role: [i for i in mixes if i.role == role], RoundRobinPolicy())
    b = ServiceBackend(None, "tiny", 2048, router, "127.0.0.1:0")
    assert router.route().target.name == "a"
    for _ in range(3):
        assert b.check_ready() == (True, "ok")
    assert router.route().target.name == "b"
    mixes.clear()
    ok, why = b.check_ready()
    assert not ok and "no engine instance" in why


# ---------------------------------------------------------------- PD pair, prefill evicted
PREFILL = info("p", InstanceRole.PREFILL, "10.0.0.1:1")
DECODE = info("d", InstanceRole.DECODE, "10.0.0.2:1")


class FakeEngines:
    """The engines as the service's RPCs see them: Generate accepts, Cancel is recorded."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # engine request ids, in Generate order
        self.cancels: list[tuple[str, str]] = []  # (rpc address, engine request id)

    async def send_generate(self, addr: str, msg: pb.DisaggRequest) -> pb.Status:
        self.sent.append(msg.service_req_id)
        return pb.Status(ok=True)

    def stub(self, addr: str):
        engines = self

        class Stub:
            async def Cancel(self, msg: pb.PullSignal, timeout: float) -> pb.Status:
                engines.cancels.append((addr, msg.req_id))
                return pb.Status(ok=True)
        return Stub()


def pd_backend() -> tuple[ServiceBackend, FakeEngines]:
    roles = {InstanceRole.PREFILL: [PREFILL], InstanceRole.DECODE: [DECODE]}
    b = ServiceBackend(None, "tiny", 2048, Router(lambda role: roles.get(role, []),
                                                  RoundRobinPolicy()), "127.0.0.1:0")
    engines = FakeEngines()
    b._send_generate = engines.send_generate
    b._stub = engines.stub
    return b, engines


async def start_pd(b: ServiceBackend, engines: FakeEngines):
    """A streaming client request on the (p, d) pair; returns its generator, the pending
    first output and the engine request id."""
    stream = b.generate(GenerateRequest("cmpl-1", [5, 6, 7], stream=True, max_tokens=8))
    first = asyncio.ensure_future(anext(stream))
    for _ in range(100):
        if engines.sent or first.done():
            break
        await asyncio.sleep(0)
    (rid,) = engines.sent
    return stream, first, rid


async def feed(b: ServiceBackend, *gens) -> None:
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=list(gens)))
    assert all(s.ok for s in reply.all_status)


async def take(pending) -> list[int] | tuple[int, str]:
    """The client's next output: its tokens, or (error code, message)."""
    out = await asyncio.wait_for(pending, 1.0)
    if out.failed:
        return out.error_code, out.error_message
    return out.outputs[0].token_ids


@pytest.mark.parametrize("decode_first", [False, True], ids=["in-order", "decode-held"])
async def test_prefill_eviction_spares_a_request_streaming_from_decode(decode_first):
    b, engines = pd_backend()
    stream, first, rid = await start_pd(b, engines)
    prefill_out, decode_out = gen(rid, [1], on_prefill=True), gen(rid, [2])
    for g in ([decode_out, prefill_out] if decode_first else [prefill_out, decode_out]):
        await feed(b, g)
    assert await take(first) == [1]
    assert await take(anext(stream)) == [2]

    b.on_evict(PREFILL)  # decode has the KV and is generating: nothing to fail
    assert (b.inflight("p"), b.inflight("d")) == (0, 1)
    await feed(b, gen(rid, [3]))
    await feed(b, gen(rid, [4], finished=True))
    assert await take(anext(stream)) == [3]
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [4]
    assert b.outcomes == {"ok": 1}
    assert b.instance_outcomes == {("p", "ok"): 1, ("d", "ok"): 1}  # both still count it


@pytest.mark.parametrize("seen", ["prefill-only", "decode-held"])
async def test_prefill_eviction_fails_a_request_before_decode_output(seen):
    b, engines = pd_backend()
    stream, first, rid = await start_pd(b, engines)
    if seen == "prefill-only":  # first token in, decode may still be pulling the KV
        await feed(b, gen(rid, [1], on_prefill=True))
        assert await take(first) == [1]
        first = anext(stream)
    else:  # decode's token 2 is in, but prefill's token 1 never will be
        await feed(b, gen(rid, [2]))
    assert b.inflight("p") == 1

    b.on_evict(PREFILL)
    code, message = await take(first)
    assert code == 503 and "instance p left the cluster" in message
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert b.instance_outcomes == {("p", "error"): 1, ("d", "error"): 1}
    assert (b.inflight("p"), b.inflight("d")) == (0, 0)


@pytest.mark.parametrize("decode_started", [False, True])
async def test_decode_eviction_fails_a_pd_request(decode_started):
    b, engines = pd_backend()
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True))
    assert await take(first) == [1]
    if decode_started:
        await feed(b, gen(rid, [2]))
        assert await take(anext(stream)) == [2]

    b.on_evict(DECODE)
    code, message = await take(anext(stream))
    assert code == 503 and "instance d left the cluster" in message
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_client_gone_after_prefill_released_cancels_on_both_instances():
    b, engines = pd_backend()
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True), gen(rid, [2]))
    assert await take(first) == [1]
    assert await take(anext(stream)) == [2]
    assert b.inflight("p") == 0

    await stream.aclose()  # the client went away
    await asyncio.gather(*b._cancels)
    assert engines.cancels == [("10.0.0.1:1", rid), ("10.0.0.2:1", rid)]
    assert (b.inflight("p"), b.inflight("d")) == (0, 0)
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [3])]))
    assert [s.ok for s in reply.all_status] == [False]
