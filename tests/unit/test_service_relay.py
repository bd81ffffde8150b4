"""ServiceBackend.on_generations: in-order relay, PD first-token ordering, cancelled
requests answered ok=false, eviction fails in-flight requests."""
from __future__ import annotations

import asyncio

from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2 as pb
from xllm_service.backend import ServiceBackend, _Sub
from xllm_service.instance_table import InstanceInfo, InstanceState
from xllm_service.router import RoundRobinPolicy, Route, Router


def info(name: str, role: InstanceRole) -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role, rpc_address="127.0.0.1:1"),
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
