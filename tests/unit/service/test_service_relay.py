"""ServiceBackend.on_generations: in-order relay, PD first-token ordering, cancelled
requests answered ok=false, eviction fails in-flight requests (a dead prefill only those
that still wait for decode's first output; a dead decode or MIX instance only those it
cannot hand to another of its kind with MultiGenerations)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from xllm_py.api.backend import GenerateRequest
from xllm_py.cluster.instance_meta import InstanceMeta
from xllm_py.config import InstanceRole
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.rpc import service as wire
from xllm_py.sampling_params import SamplingParams
from xllm_service.backend import ServiceBackend
from xllm_service.instance_table import InstanceInfo, InstanceState
from xllm_service.router import RoundRobinPolicy, Route, Router
from xllm_service.sub_request import SubPhase, SubRequest


def info(name: str, role: InstanceRole, addr: str = "127.0.0.1:1") -> InstanceInfo:
    return InstanceInfo(InstanceMeta(name=name, type=role, rpc_address=addr),
                        InstanceState.ACTIVE, 0.0)


def backend() -> ServiceBackend:
    return ServiceBackend(None, "tiny", 2048, Router(lambda role: [], RoundRobinPolicy()),
                          FakeEngines(), "127.0.0.1:0")


def gen(rid: str, tokens: list[int], finished=False, on_prefill=False, code=200, text=""):
    g = pb.DisaggStreamGeneration(req_id=rid, service_req_id=rid, finished=finished,
                                  finished_on_prefill_instance=on_prefill,
                                  gen_status=pb.GenStatus(status_code=code))
    g.outputs.add(index=0, token_ids=tokens, text=text)
    return g


def register(b: ServiceBackend, rid: str, route: Route) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    b.subs.add(SubRequest(rid, 0, route, q))
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
    b.subs.get("r2").transition(SubPhase.CANCELLED)
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
    b = ServiceBackend(None, "tiny", 2048, router, FakeEngines(), "127.0.0.1:0")
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
DECODE2 = info("d2", InstanceRole.DECODE, "10.0.0.3:1")


class FakeEngines:
    """The engines as the service's RPCs see them (xllm_service.engine_client.Engines):
    Generate accepts, Cancel and MultiGenerations are recorded (MultiGenerations as the
    wire message the service's rpc layer builds); MultiGenerations answers
    `migrate_reply` (a Status, or an exception to raise)."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # engine request ids, in Generate order
        self.cancels: list[tuple[str, str]] = []  # (rpc address, engine request id)
        self.migrated: list[tuple[str, pb.MultiGenerationsRequest]] = []  # (address, item)
        self.migrate_reply: pb.Status | Exception = pb.Status(ok=True)

    async def generate(self, addr: str, spec) -> wire.SubmitStatus:
        self.sent.append(wire.generate_request(spec).service_req_id)
        return wire.SubmitStatus(ok=True)

    async def migrate(self, addr: str, spec, generated_token_ids: list[int],
                      num_unread_tokens: int) -> wire.SubmitStatus:
        msg = wire.migration_request(spec, generated_token_ids, num_unread_tokens)
        self.migrated += [(addr, item) for item in msg.reqs]
        if isinstance(self.migrate_reply, Exception):
            raise self.migrate_reply
        return wire.submit_status(self.migrate_reply)

    async def cancel(self, addr: str, engine_request_id: str, service_request_id: str = "",
                     reason: str = "") -> None:
        msg = wire.cancel_request(engine_request_id, service_request_id, reason)
        assert msg.reason, "the service says why it cancels"
        self.cancels.append((addr, msg.req_id))

    async def close(self) -> None:
        pass


def backend_over(roles: dict) -> tuple[ServiceBackend, FakeEngines]:
    """A ServiceBackend routing (round robin) over `roles` (role -> instances), its RPCs
    going to FakeEngines."""
    engines = FakeEngines()
    b = ServiceBackend(None, "tiny", 2048, Router(lambda role: roles.get(role, []),
                                                  RoundRobinPolicy()), engines, "127.0.0.1:0")
    return b, engines


def pd_backend(decodes=(DECODE,)) -> tuple[ServiceBackend, FakeEngines]:
    return backend_over({InstanceRole.PREFILL: [PREFILL], InstanceRole.DECODE: decodes})


async def start_pd(b: ServiceBackend, engines: FakeEngines, n: int = 1):
    """A streaming client request on the (p, d) pair (or a MIX instance, on a backend
    with MIX ones); returns its generator, the pending first output and the engine
    request id."""
    stream = b.generate(GenerateRequest("cmpl-1", [5, 6, 7], SamplingParams(max_tokens=8, n=n), stream=True))
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
    assert b.metrics.outcomes == {"ok": 1}
    assert b.metrics.instance_outcomes == {("p", "ok"): 1, ("d", "ok"): 1}  # both still count it


async def test_prefill_eviction_fails_a_request_before_its_first_token():
    """Decode's token 2 is in, but prefill's token 1 never will be: nothing to resume from."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [2]))
    assert b.inflight("p") == 1

    b.on_evict(PREFILL)
    code, message = await take(first)
    assert code == 503 and "instance p left the cluster" in message
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert b.metrics.instance_outcomes == {("p", "error"): 1, ("d", "error"): 1}
    assert (b.inflight("p"), b.inflight("d")) == (0, 0)
    assert engines.migrated == []


@pytest.mark.parametrize("decodes", [2, 1], ids=["two-decodes", "one-decode"])
async def test_prefill_eviction_after_its_first_token_recomputes_on_a_decode(decodes):
    """Prefill's first token is relayed, no decode output yet (the decode may still be
    pulling the KV from the dead prefill): a decode recomputes the prompt and resumes after
    that token (the dead prefill is no decode, so the one decode will do); the blocks set
    aside under the old id are dropped on every decode; the old id's late outputs are
    refused."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2)[:decodes])
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True, text="a"))
    assert await take(first) == [1]

    b.on_evict(PREFILL)
    await asyncio.gather(*b._tasks)
    (addr, item), = engines.migrated
    assert list(item.generated_token_ids) == [1] and not item.HasField("kv")
    assert b.metrics.migrations == {"ok": 1}
    assert sorted(c[1] for c in engines.cancels) == [rid] * decodes
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [9])]))
    assert [s.ok for s in reply.all_status] == [False]
    new_id = item.request.service_req_id
    await feed(b, gen(new_id, [2, 3], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2, 3]


@pytest.mark.parametrize("decode_started", [False, True])
async def test_decode_eviction_fails_a_pd_request_with_nowhere_to_go(decode_started):
    """No other decode: 503 that says why."""
    b, engines = pd_backend(decodes=(DECODE,))
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True))
    assert await take(first) == [1]
    if decode_started:
        await feed(b, gen(rid, [2]))
        assert await take(anext(stream)) == [2]

    b.on_evict(DECODE)
    code, message = await take(anext(stream))
    assert code == 503 and "instance d left the cluster" in message
    assert "could not migrate it: no other decode instance is registered" in message
    assert b.metrics.migrations == {"failed": 1} and engines.migrated == []
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert 'xllm_service_migrations_total{outcome="failed"} 1' in b.metrics_text()


async def test_decode_eviction_before_any_token_fails_the_request():
    """Nothing relayed yet (prefill's first token not in): nothing to resume from."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    b.on_evict(DECODE)
    code, message = await take(first)
    assert code == 503 and "instance d left the cluster" in message
    assert b.metrics.migrations == {} and engines.migrated == []


async def test_decode_eviction_before_decode_output_migrates_and_frees_prefill():
    """Prefill's first token is in but decode's output is not (decode may still be pulling
    the KV): the request moves anyway (the new decode recomputes), and no longer depends
    on prefill: prefill's eviction, or its late failure under the old id, changes nothing."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, rid = await migrate_after(b, engines, [[1]])
    (addr, item), = engines.migrated
    new_id = item.request.service_req_id
    assert list(item.generated_token_ids) == [1] and item.num_unread_tokens == 1
    assert (b.inflight("p"), b.inflight("d"), b.inflight("d2")) == (0, 0, 1)
    reply = await b.on_generations(pb.DisaggStreamGenerations(
        gens=[gen(rid, [], finished=True, code=502)]))
    assert [s.ok for s in reply.all_status] == [False]
    b.on_evict(PREFILL)
    await feed(b, gen(new_id, [2, 3], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2, 3]


async def migrate_after(b: ServiceBackend, engines: FakeEngines, tokens: list[list[int]],
                        texts: list[str] | None = None):
    """A PD request that streamed `tokens` (prefill's first, then decode's; with `texts`),
    then lost decode "d"; returns its stream and old engine id once MultiGenerations was
    sent."""
    texts = texts or [""] * len(tokens)
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, tokens[0], on_prefill=True, text=texts[0]))
    assert await take(first) == tokens[0]
    for t, text in zip(tokens[1:], texts[1:]):
        await feed(b, gen(rid, t, text=text))
        assert await take(anext(stream)) == t
    b.on_evict(DECODE)
    await asyncio.gather(*b._tasks)
    return stream, rid


@pytest.mark.parametrize("end", ["finished", "client-gone"])
async def test_decode_eviction_migrates_to_another_decode(end):
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, rid = await migrate_after(b, engines, [[1], [2], [3, 4]])

    (addr, item), = engines.migrated
    new_id = item.request.service_req_id
    assert addr == "10.0.0.3:1"  # d2, never the dead d
    assert list(item.generated_token_ids) == [1, 2, 3, 4]
    assert not item.HasField("kv")  # recompute on the new decode
    assert new_id != rid and new_id.startswith("cmpl-1-0-") and item.request.req_id == new_id
    assert list(item.request.prompt_tokens) == [5, 6, 7] and item.request.max_tokens == 8
    assert item.request.source_xservice_addr == "127.0.0.1:0"
    assert b.metrics.migrations == {"ok": 1}
    assert (b.inflight("d"), b.inflight("d2")) == (0, 1)

    # The old decode, if still alive, is told to stop; tokens are never delivered twice.
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [5])]))
    assert [s.ok for s in reply.all_status] == [False]
    await feed(b, gen(new_id, [5]))
    assert await take(anext(stream)) == [5]
    if end == "finished":
        await feed(b, gen(new_id, [6, 7, 8], finished=True))
        last = await asyncio.wait_for(anext(stream), 1.0)
        assert last.finished and not last.failed and last.outputs[0].token_ids == [6, 7, 8]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert b.metrics.outcomes == {"ok": 1}
        assert engines.cancels == []
    else:  # Cancel goes to the new decode, under the new id
        await stream.aclose()
        await asyncio.gather(*b._tasks)
        assert ("10.0.0.3:1", new_id) in engines.cancels
        assert all(r == new_id for _, r in engines.cancels)
    assert (b.inflight("d"), b.inflight("d2")) == (0, 0)
    assert 'xllm_service_migrations_total{outcome="ok"} 1' in b.metrics_text()


@pytest.mark.parametrize("texts, unread", [
    (["a", "b", "cd"], 0), (["a", "", ""], 3), (["", "", ""], 4), (["a", "b", ""], 2)])
async def test_migration_says_how_many_tokens_the_client_has_no_text_for(texts, unread):
    """Tokens after the last output with text were held back by the dead decode (an
    incomplete character): the new decode must emit their text."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    await migrate_after(b, engines, [[1], [2], [3, 4]], texts)
    (_, item), = engines.migrated
    assert item.has_num_unread_tokens and item.num_unread_tokens == unread


@pytest.mark.parametrize("reply", [
    pb.Status(ok=False, code=400, message="no KV space"),
    grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                         grpc.aio.Metadata(), "Deadline Exceeded")], ids=["refused", "rpc-error"])
async def test_decode_eviction_fails_the_request_when_multi_generations_fails(reply):
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    engines.migrate_reply = reply
    stream, rid = await migrate_after(b, engines, [[1], [2]])
    code, message = await take(anext(stream))
    assert code == 503 and "instance d left the cluster" in message
    assert "migrating it to d2 failed" in message
    assert ("no KV space" if isinstance(reply, pb.Status) else "DEADLINE_EXCEEDED") in message
    assert b.metrics.migrations == {"failed": 1}
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert (b.inflight("d"), b.inflight("d2")) == (0, 0)


async def test_migrated_request_migrates_again_and_counts_usage_once():
    """The new decode dies too: the request moves on with all tokens so far; usage is the
    last decode's count (it includes the tokens generated elsewhere), not a sum."""
    d3 = info("d3", InstanceRole.DECODE, "10.0.0.4:1")
    decodes = [DECODE, DECODE2, d3]
    b, engines = pd_backend(decodes)
    stream, rid = await migrate_after(b, engines, [[1], [2]])
    decodes.remove(DECODE)  # the registry drops an evicted instance
    new_id = engines.migrated[0][1].request.service_req_id
    g = gen(new_id, [3])
    g.usage.num_generated_tokens = 3
    await feed(b, g)
    assert (await asyncio.wait_for(anext(stream), 1.0)).num_generated_tokens == 3
    b.on_evict(DECODE2)
    await asyncio.gather(*b._tasks)
    addr, item = engines.migrated[1]
    assert addr == "10.0.0.4:1" and list(item.generated_token_ids) == [1, 2, 3]
    g = gen(item.request.service_req_id, [4, 5, 6, 7, 8], finished=True)
    g.usage.num_generated_tokens = 8
    await feed(b, g)
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.num_generated_tokens == 8
    assert b.metrics.migrations == {"ok": 2}


async def test_client_gone_after_prefill_released_cancels_on_both_instances():
    b, engines = pd_backend()
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True), gen(rid, [2]))
    assert await take(first) == [1]
    assert await take(anext(stream)) == [2]
    assert b.inflight("p") == 0

    await stream.aclose()  # the client went away
    await asyncio.gather(*b._tasks)
    assert engines.cancels == [("10.0.0.1:1", rid), ("10.0.0.2:1", rid)]
    assert (b.inflight("p"), b.inflight("d")) == (0, 0)
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [3])]))
    assert [s.ok for s in reply.all_status] == [False]


# ---------------------------------------------------------------- MIX instance evicted
MIX = info("m", InstanceRole.MIX, "10.0.1.1:1")
MIX2 = info("m2", InstanceRole.MIX, "10.0.1.2:1")


def mix_backend(mixes=(MIX, MIX2)) -> tuple[ServiceBackend, FakeEngines]:
    # A decode is registered too: a MIX request never moves to it.
    return backend_over({InstanceRole.MIX: mixes, InstanceRole.DECODE: [DECODE]})


async def mix_migrate_after(b: ServiceBackend, engines: FakeEngines, tokens: list[list[int]],
                            texts: list[str], n: int = 1):
    """A MIX request (on "m", the first in round robin) that streamed `tokens`, one
    choice per output (choice i of n gets every n-th output), then lost "m"; returns its
    stream, old engine id and the client's next output (pending) once any
    MultiGenerations was sent."""
    stream, first, rid = await start_pd(b, engines, n)
    assert b.inflight("m") == 1
    pending = first
    for i, (t, text) in enumerate(zip(tokens, texts)):
        g = gen(rid, t, text=text)
        g.outputs[0].index = i % n
        await feed(b, g)
        assert (await asyncio.wait_for(pending, 1.0)).outputs[0].token_ids == t
        pending = anext(stream)
    b.on_evict(MIX)
    await asyncio.gather(*b._tasks)
    return stream, rid, pending


async def test_mix_eviction_migrates_to_another_mix():
    b, engines = mix_backend()
    stream, rid, pending = await mix_migrate_after(b, engines, [[1], [2], [3, 4]],
                                                   ["a", "b", ""])
    (addr, item), = engines.migrated
    new_id = item.request.service_req_id
    assert addr == "10.0.1.2:1"  # m2: never the dead m, never a decode
    assert list(item.generated_token_ids) == [1, 2, 3, 4]
    assert item.has_num_unread_tokens and item.num_unread_tokens == 2  # 3, 4 had no text
    assert not item.HasField("kv")  # MIX recomputes
    assert new_id != rid and new_id.startswith("cmpl-1-0-") and item.request.req_id == new_id
    assert list(item.request.prompt_tokens) == [5, 6, 7] and item.request.max_tokens == 8
    assert item.request.routing.decode_name == "" and item.request.n == 1
    assert b.metrics.migrations == {"ok": 1}
    assert (b.inflight("m"), b.inflight("m2")) == (0, 1)
    assert 'xllm_service_migrations_total{outcome="ok"} 1' in b.metrics_text()

    # The dead instance's late outputs are refused; the new one's reach the client.
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [5])]))
    assert [s.ok for s in reply.all_status] == [False]
    await feed(b, gen(new_id, [5], text="cde"))
    assert await take(pending) == [5]
    await feed(b, gen(new_id, [6, 7, 8], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [6, 7, 8]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert b.metrics.outcomes == {"ok": 1} and engines.cancels == []
    assert b.metrics.instance_outcomes == {("m2", "ok"): 1}
    assert (b.inflight("m"), b.inflight("m2")) == (0, 0)


async def test_mix_eviction_fails_a_request_with_n_sequences_and_says_why():
    b, engines = mix_backend()
    stream, rid, pending = await mix_migrate_after(b, engines, [[1], [2]], ["a", "b"], n=2)
    code, message = await take(pending)
    assert code == 503 and "instance m left the cluster" in message
    assert "cannot be migrated" in message and "n=2" in message
    assert engines.migrated == [] and b.metrics.migrations == {}
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


async def test_mix_eviction_fails_the_request_with_no_other_mix():
    b, engines = mix_backend(mixes=(MIX,))
    stream, rid, pending = await mix_migrate_after(b, engines, [[1], [2]], ["a", "b"])
    code, message = await take(pending)
    assert code == 503 and "instance m left the cluster" in message
    assert "could not migrate it: no other MIX instance is registered" in message
    assert engines.migrated == [] and b.metrics.migrations == {"failed": 1}
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert 'xllm_service_migrations_total{outcome="failed"} 1' in b.metrics_text()


async def test_mix_eviction_before_any_token_sends_the_request_again_whole():
    """Nothing relayed yet: the request goes whole to another MIX (a plain Generate under
    a fresh id, n > 1 too), and its stream is that instance's; late outputs of the old id
    are refused."""
    b, engines = mix_backend()
    stream, rid, pending = await mix_migrate_after(b, engines, [], [], n=2)
    old, new_id = engines.sent
    assert old == rid and new_id != rid and new_id.startswith("cmpl-1-0-")
    assert engines.migrated == [] and b.metrics.migrations == {"ok": 1}
    assert (b.inflight("m"), b.inflight("m2")) == (0, 1)
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [9])]))
    assert [s.ok for s in reply.all_status] == [False]
    await feed(b, gen(new_id, [1], finished=True))
    last = await asyncio.wait_for(pending, 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [1]


async def test_mix_eviction_before_any_token_fails_the_request_with_no_other_mix():
    b, engines = mix_backend(mixes=(MIX,))
    stream, rid, pending = await mix_migrate_after(b, engines, [], [])
    code, message = await take(pending)
    assert code == 503 and message.startswith(
        "instance m left the cluster while serving the request; no other instance")
    assert engines.sent == [rid] and b.metrics.migrations == {"failed": 1}


async def test_prefill_eviction_before_anything_relayed_serves_it_on_a_decode():
    """The prefill died with nothing relayed (no token from it or a decode): a decode
    serves the request whole under a fresh id; the decodes drop what they set aside."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    b.on_evict(PREFILL)
    await asyncio.gather(*b._tasks)
    old, new_id = engines.sent
    assert old == rid and new_id != rid
    assert {req for _, req in engines.cancels} == {rid}
    assert b.metrics.migrations == {"ok": 1} and b.inflight("p") == 0
    await feed(b, gen(new_id, [4]))
    assert await take(first) == [4]
    await feed(b, gen(new_id, [5], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [5]


@pytest.mark.parametrize("decodes", [2, 1], ids=["another-decode", "no-other-decode"])
async def test_prefill_that_cannot_reach_its_decode_gets_the_request_moved(decodes):
    """Prefill relayed the first token, then its FirstGeneration could not reach decode
    (dead before the take-over): the request moves to another decode (recomputed there)
    instead of failing; with no other decode it fails saying both why and why not."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2)[:decodes])
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True, text="a"))
    assert await take(first) == [1]
    failure = gen(rid, [], finished=True, code=502)
    failure.gen_status.status_msg = "decode instance d failed: UNAVAILABLE"
    failure.unreachable_instance = "d"
    await feed(b, failure)
    await asyncio.gather(*b._tasks)
    if decodes == 1:
        code, message = await take(anext(stream))
        assert code == 503 and "decode instance d could not be reached" in message
        assert "could not migrate it" in message and engines.migrated == []
        return
    (addr, item), = engines.migrated
    assert addr == "10.0.0.3:1" and list(item.generated_token_ids) == [1]
    assert item.num_unread_tokens == 0 and b.metrics.migrations == {"ok": 1}
    new_id = item.request.service_req_id
    await feed(b, gen(new_id, [2, 3], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2, 3]


async def test_a_decode_that_dropped_the_request_gets_it_moved():
    """The decode could not reach the service (a cut link) and dropped the stream; once
    back it says so (GenerationsReporter's notice, naming itself): the request moves to
    another decode instead of waiting for the idle timeout. Its late tokens are refused."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True, text="a"))
    assert await take(first) == [1]
    await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [2], text="b")],
                                                      instance_name="d"))
    assert await take(anext(stream)) == [2]
    notice = wire.dropped_generation(gen(rid, [3]), "d", "instance d could not reach the "
                                     "service and dropped it")
    await b.on_generations(pb.DisaggStreamGenerations(gens=[notice], instance_name="d"))
    await asyncio.gather(*b._tasks)
    (addr, item), = engines.migrated
    assert addr == "10.0.0.3:1" and list(item.generated_token_ids) == [1, 2]
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [3])],
                                                              instance_name="d"))
    assert [s.ok for s in reply.all_status] == [False]


async def test_a_drop_notice_from_another_instance_is_an_ordinary_failure():
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True, text="a"))
    assert await take(first) == [1]
    other = wire.dropped_generation(gen(rid, []), "p", "instance p dropped it")
    await b.on_generations(pb.DisaggStreamGenerations(gens=[other], instance_name="p"))
    code, message = await take(anext(stream))
    assert code == 503 and message == "instance p dropped it" and engines.migrated == []


async def test_a_transfer_failure_before_the_first_token_is_recomputed_once_it_is_in():
    """The decode's pull failed and said so before the prefill's first token reached the
    service (they race): the failure waits for that token, then a decode recomputes."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    failure = gen(rid, [], finished=True, code=502)
    failure.gen_status.status_msg = "KV pull failed"
    await b.on_generations(pb.DisaggStreamGenerations(gens=[failure], instance_name="d"))
    assert not first.done() and engines.migrated == []
    await feed(b, gen(rid, [1], on_prefill=True))
    assert await take(first) == [1]
    await asyncio.gather(*b._tasks)
    (addr, item), = engines.migrated
    assert list(item.generated_token_ids) == [1]
    await feed(b, gen(item.request.service_req_id, [2], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2]


@pytest.mark.parametrize("code", [502, 500])
async def test_a_transfer_failure_is_recomputed_on_a_decode(code):
    """A decode that was reached but could not take over because its KV pull failed (the
    engines' 502: a peer failed) after the first token was relayed: a decode recomputes
    the prompt (vLLM's recompute policy for a failed KV load) and the stream goes on.
    Another failure (500) reaches the client; every decode drops what it may have set
    aside for the request (its prefill may be unable to tell them: dead, or cut off)."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    await feed(b, gen(rid, [1], on_prefill=True))
    assert await take(first) == [1]
    failure = gen(rid, [], finished=True, code=code)
    failure.gen_status.status_msg = "decode could not take over: KV pull failed"
    await feed(b, failure)
    await asyncio.gather(*b._tasks)
    assert sorted(engines.cancels) == [("10.0.0.2:1", rid), ("10.0.0.3:1", rid)]
    if code != 502:
        code_seen, message = await take(anext(stream))
        assert code_seen == code and "KV pull failed" in message and engines.migrated == []
        return
    (addr, item), = engines.migrated
    assert list(item.generated_token_ids) == [1] and not item.HasField("kv")
    new_id = item.request.service_req_id
    await feed(b, gen(new_id, [2, 3], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2, 3]


@pytest.mark.parametrize("code", [503, 502, 500])
async def test_a_request_its_prefill_could_not_place_is_served_whole_by_a_decode(code):
    """The prefill could not reach any decode (a partition between them: 503, or 502) and
    failed the request before any token: a decode serves it whole under a fresh id (the
    DECODE path); the old id's late outputs are refused. Another failure reaches the client."""
    b, engines = pd_backend(decodes=(DECODE,))
    stream, first, rid = await start_pd(b, engines)
    failure = gen(rid, [], finished=True, code=code)
    failure.gen_status.status_msg = "cannot link decode d: UNAVAILABLE"
    await b.on_generations(pb.DisaggStreamGenerations(gens=[failure], instance_name="p"))
    await asyncio.gather(*b._tasks)
    if code == 500:
        assert await take(first) == (500, "cannot link decode d: UNAVAILABLE")
        assert engines.sent == [rid]
        return
    new_id = engines.sent[-1]
    assert new_id != rid and engines.sent == [rid, new_id]
    assert (b.inflight("p"), b.inflight("d")) == (0, 1)
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [9])]))
    assert [s.ok for s in reply.all_status] == [False]
    await feed(b, gen(new_id, [1]))
    assert await take(first) == [1]
    await feed(b, gen(new_id, [2], finished=True))
    last = await asyncio.wait_for(anext(stream), 1.0)
    assert last.finished and not last.failed and last.outputs[0].token_ids == [2]


async def test_service_follows_the_decode_the_prefill_handed_the_request_to():
    """The service chose d, but d was full and prefill handed the request to d2: d2's
    outputs re-point the route, so d2's eviction moves the request (before: nothing
    happened and the client waited for the idle timeout) and d's eviction leaves it be."""
    b, engines = pd_backend(decodes=(DECODE, DECODE2))
    stream, first, rid = await start_pd(b, engines)
    assert b.inflight("d") == 1
    await feed(b, gen(rid, [1], on_prefill=True, text="a"))
    assert await take(first) == [1]
    reply = await b.on_generations(pb.DisaggStreamGenerations(gens=[gen(rid, [2], text="b")],
                                                              instance_name="d2"))
    assert [s.ok for s in reply.all_status] == [True]
    assert await take(anext(stream)) == [2]
    assert (b.inflight("d"), b.inflight("d2")) == (0, 1)
    b.on_evict(DECODE)
    assert engines.migrated == []
    b.on_evict(DECODE2)
    await asyncio.gather(*b._tasks)
    (addr, item), = engines.migrated
    assert addr == "10.0.0.2:1" and list(item.generated_token_ids) == [1, 2]
