"""Fuzzing the edges, bounded in time, against real processes.

HTTP (hypothesis): request bodies built from the pydantic request models' fields, each
value drawn from what the field takes and from what it must refuse (integers past the
wire's widths, non-finite numbers, wrong types, long lists), plus raw bodies that are
not JSON, deep nesting and bodies over the size limit, sent to a MIX engine's own API
and to the service. Properties: no 5xx, every error a JSON OpenAI error body, and
afterwards the instance serves a normal request and holds 0 KV blocks.

gRPC (seeded random): AddNewRequests, FirstGeneration, MultiGenerations (DECODE and
MIX), PullKVCache / PushKVCache (the decode's KV worker) and Generations / Heartbeat /
RegisterInstance (the service) with random and hostile field values. Properties: no UNKNOWN or INTERNAL
status, no failed engine step, and 0 blocks held once the requests the fuzz placed are
cancelled. Both print their counts (run with -s).
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.cluster_harness import Harness
from tests.integration.hostile_harness import (
    blocks_used,
    start_cluster,
    start_collector,
    step_failures,
    tiny_vocab_size,
    wait_blocks_free,
)
from xllm_py.api.protocol import ChatCompletionRequest, CompletionRequest
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.proto import xllm_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

HTTP_BUDGET_S = 25.0  # per target
GRPC_BUDGET_S = 25.0


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    h = Harness(etcd_server.endpoint, "fuzz/", tmp_path_factory.mktemp("fuzz"))
    try:
        yield start_cluster(h, "fuzz-decode/")
    finally:
        h.stop()


# ---------------------------------------------------------------- HTTP
_INTS = st.one_of(
    st.integers(-3, 40), st.sampled_from([2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 63 - 1,
                                          2 ** 63, -(2 ** 63) - 1, 2 ** 64 + 5, 10 ** 30]))
_FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([float("inf"), float("-inf"),
                                                       float("nan"), 1e39, -1e39, 1e-300]))
_JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_TOKEN_IDS = st.lists(st.one_of(st.integers(0, 1100), _INTS), min_size=0, max_size=12)
_TEXT = st.text(max_size=40)


def _field_values(name: str):
    by_name = {
        "prompt": st.one_of(_TEXT, _TOKEN_IDS, st.lists(_TEXT, max_size=4),
                            st.lists(_TOKEN_IDS, max_size=3), st.just("x" * 5000)),
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
             "content": st.one_of(_TEXT, st.none(), st.lists(st.fixed_dictionaries(
                 {"type": st.sampled_from(["text", "image_url"]), "text": _TEXT}), max_size=2))}),
            max_size=3),
        "max_tokens": st.one_of(st.integers(-2, 12), _INTS),
        "max_completion_tokens": st.one_of(st.integers(-2, 12), _INTS),
        "n": st.one_of(st.integers(-1, 4), _INTS), "best_of": st.one_of(st.integers(-1, 6), _INTS),
        "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=20)),
        "stop_token_ids": _TOKEN_IDS, "stream": st.booleans(), "echo": st.booleans(),
        "logprobs": st.one_of(st.integers(-1, 25), st.booleans(), _INTS),
        "top_logprobs": st.one_of(st.integers(-1, 25), _INTS),
        "model": st.sampled_from(["tiny", "gpt-4", ""]),
        "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
            {"include_usage": st.booleans()})),
    }
    if name in by_name:
        return st.one_of(by_name[name], _JUNK)
    return st.one_of(_INTS, _FLOATS, _JUNK)


def _bodies(model) -> st.SearchStrategy:
    fields = sorted(model.model_fields)
    required = [f for f, info in model.model_fields.items() if info.is_required()]
    optional = [f for f in fields if f not in required]
    return st.tuples(
        st.fixed_dictionaries({f: _field_values(f) for f in required}),
        st.lists(st.sampled_from(optional), max_size=6, unique=True).flatmap(
            lambda names: st.fixed_dictionaries({f: _field_values(f) for f in names})),
    ).map(lambda parts: {**_SHORT, **parts[0], **parts[1]})


# A body that leaves max_tokens out would generate to the end of the context (seconds each
# on CPU, so few requests in the budget); one that sets it keeps its own value.
_SHORT = {"max_tokens": 8}


def _near_valid(model) -> st.SearchStrategy:
    """A request that would run (short), with one or two fields hostile."""
    base = ({"prompt": "Hello there"} if model is CompletionRequest
            else {"messages": [{"role": "user", "content": "Hi"}]})
    base = {**base, "model": "tiny", "max_tokens": 3}
    names = sorted(set(model.model_fields) - set(base))
    return st.lists(st.sampled_from(names), min_size=0, max_size=2, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({f: _field_values(f) for f in chosen})).map(
        lambda hostile: {**base, **{k: v for k, v in hostile.items()
                                    if k not in ("max_tokens", "max_completion_tokens")}})


_RAW = st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"1e999999",
                        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                        b'{"messages": [{"role": "user", "content": "' + b"\\ud800" + b'"}]}',
                        b"\xff\xfe\x00"])

_PATHS = {CompletionRequest: "/v1/completions", ChatCompletionRequest: "/v1/chat/completions"}


def _check_response(resp: httpx.Response, counts: collections.Counter) -> None:
    counts[resp.status_code] += 1
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    ctype = resp.headers.get("content-type", "")
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif ctype.startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
    else:
        json.loads(resp.text)


def _http_fuzz(url: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    deadline = time.monotonic() + HTTP_BUDGET_S
    client = httpx.Client(base_url=url, timeout=60, trust_env=False)

    @settings(max_examples=800, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.sampled_from(list(_PATHS)).flatmap(lambda m: st.tuples(st.just(m), _bodies(m))),
        st.sampled_from(list(_PATHS)).flatmap(lambda m: st.tuples(st.just(m), _near_valid(m))),
        st.tuples(st.sampled_from(list(_PATHS)), _RAW)))
    def one(case) -> None:
        if time.monotonic() > deadline:
            return
        model, body = case
        content = body if isinstance(body, bytes) else json.dumps(body)
        resp = client.post(_PATHS[model], content=content,
                           headers={"Content-Type": "application/json"})
        _check_response(resp, counts)

    try:
        one()
        big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
        _check_response(client.post("/v1/completions", content=big,
                                    headers={"Content-Type": "application/json"}), counts)
    finally:
        client.close()
    return counts


@pytest.mark.parametrize("target", ["mix", "service"])
async def test_http_fuzz(cluster, target):
    proc = cluster.mix if target == "mix" else cluster.service
    failures_before = step_failures(cluster.mix)
    counts = await asyncio.to_thread(_http_fuzz, proc.http_url)
    print(f"\nHTTP fuzz of the {target}: {sum(counts.values())} requests, statuses "
          f"{dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= 50
    ok = httpx.post(proc.http_url + "/v1/completions", trust_env=False, timeout=60, json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    await wait_blocks_free(cluster.mix, 60)
    assert step_failures(cluster.mix) == failures_before


# ---------------------------------------------------------------- gRPC
class _GrpcFuzz:
    def __init__(self, rng: random.Random, source: str, vocab: int) -> None:
        self.rng = rng
        self.source = source
        self.vocab = vocab
        self.ids: list[str] = []  # request ids used (cancelled at the end)
        self.counts: collections.Counter = collections.Counter()  # (rpc, gRPC status)
        self.answers: collections.Counter = collections.Counter()  # (rpc, code in the body)

    def _int(self) -> int:
        r = self.rng
        return r.choice([0, 1, -1, 2, 7, self.vocab - 1, self.vocab, 2 ** 31 - 1, -(2 ** 31),
                         r.randint(-(2 ** 31), 2 ** 31 - 1), r.randint(0, 64)])

    def _float(self) -> float:
        return self.rng.choice([0.0, 0.5, 1.0, -1.0, 2.5, float("nan"), float("inf"),
                                float("-inf"), 3e38, 1e-40])

    def _tokens(self) -> list[int]:
        r = self.rng
        n = r.choice([0, 1, 3, 8, 40, 3000])
        good = r.random() < 0.6
        return [r.randint(1, self.vocab - 1) if good else self._int() for _ in range(n)]

    def req_id(self) -> str:
        rid = self.rng.choice(["", "dup", f"f-{len(self.ids)}", "x" * 300, "ü\u0000"]) \
            if self.rng.random() < 0.3 else f"f-{len(self.ids)}"
        self.ids.append(rid)
        return rid

    def request(self) -> pb.DisaggRequest:
        """Half the time a request that would run, with at most one field hostile; else
        every field random."""
        r = self.rng
        if r.random() < 0.5:
            return self._near_valid()
        req = pb.DisaggRequest(
            req_id=self.req_id(), service_req_id=r.choice(["", "s"]),
            source_xservice_addr=r.choice([self.source, self.source, "", "nowhere:1"]),
            has_max_tokens=r.random() < 0.8, max_tokens=r.choice([0, 1, 4, 16, self._int()]),
            ignore_eos=r.random() < 0.5, n=r.choice([0, 1, 2, self._int()]),
            best_of=r.choice([0, 0, 3, self._int()]), has_seed=r.random() < 0.3,
            seed=r.choice([0, 2 ** 63 - 1, -(2 ** 63)]), has_temperature=r.random() < 0.7,
            temperature=self._float(), top_p=self._float(), top_k=r.choice([0, 5, self._int()]),
            min_p=self._float(), repetition_penalty=self._float(),
            frequency_penalty=self._float(), presence_penalty=self._float(),
            logprobs=r.random() < 0.2, top_logprobs=r.choice([0, 3, self._int()]),
            min_tokens=r.choice([0, 2, self._int()]),
            has_prompt_logprobs=r.random() < 0.1, prompt_logprobs=r.choice([0, 2, self._int()]))
        req.prompt_tokens.extend(self._tokens())
        req.stop_token_ids.extend(self._tokens()[:4])
        req.eos_token_ids.extend(self._tokens()[:2])
        for _ in range(r.choice([0, 0, 1, 3])):
            req.stop_sequences.add(text=r.choice(["", "a", "\n", "x" * 1000]))
        for _ in range(r.choice([0, 0, 1])):
            req.logit_bias[self._int()] = self._float()
        return req

    def _near_valid(self) -> pb.DisaggRequest:
        r = self.rng
        req = pb.DisaggRequest(req_id=f"f-{len(self.ids)}", source_xservice_addr=self.source,
                               max_tokens=r.choice([1, 4, 16]), ignore_eos=r.random() < 0.5,
                               has_temperature=True, temperature=r.choice([0.0, 0.8]))
        self.ids.append(req.req_id)
        req.prompt_tokens.extend(r.randint(1, self.vocab - 1) for _ in range(r.randint(1, 30)))
        hostile = self.request_fields()
        name = r.choice([None, "prompt_tokens", "stop_token_ids", "logit_bias", "top_k", "n",
                         "min_tokens", "repetition_penalty", "req_id"])
        if name in ("prompt_tokens", "stop_token_ids"):
            getattr(req, name).extend([self._int()])
        elif name == "logit_bias":
            req.logit_bias[self._int()] = self._float()
        elif name is not None:
            setattr(req, name, getattr(hostile, name))
        return req

    def request_fields(self) -> pb.DisaggRequest:
        """Random scalar fields (for _near_valid to take one from)."""
        return pb.DisaggRequest(req_id=self.rng.choice(["", "dup", "x" * 300]),
                                top_k=self._int(), n=self._int(), min_tokens=self._int(),
                                repetition_penalty=self._float())

    def handover(self, known: list[str]) -> pb.DisaggGenerationsRequest:
        r = self.rng
        gen = pb.DisaggGenerationsRequest(
            req_id=r.choice(known) if known and r.random() < 0.8 else self.req_id(),
            kv_cache_transfer_mode=r.choice(["PUSH", "PUSH", "PULL", "", "SIDEWAYS"]),
            failed=r.random() < 0.1, num_computed_tokens=self._int(),
            dp_size=r.choice([0, 1, self._int()]))
        tokens = ([r.randint(1, self.vocab - 1)] if r.random() < 0.5
                  else self._tokens()[: r.choice([0, 1, 1, 2])])
        for t in tokens:
            tok = gen.tokens.add(token_id=t)
            if r.random() < 0.2:
                tok.has_logprob = True
                tok.logprob = self._float()
                tok.top_tokens.extend([self._int()])
                tok.top_logprobs.extend([self._float()])
        gen.block_ids.extend(self._int() for _ in range(r.choice([0, 1, 4])))
        gen.addrs.extend(r.choice([[], ["127.0.0.1:1"], ["garbage"]]))
        gen.cluster_ids.extend(r.choice([[], [0], [2 ** 64 - 1]]))
        return gen

    async def call(self, name: str, coro) -> object | None:
        try:
            reply = await coro
        except grpc.aio.AioRpcError as e:
            self.counts[(name, e.code().name)] += 1
            return None
        self.counts[(name, "OK")] += 1
        if isinstance(reply, pb.Status):  # the answer in the body (batch RPCs)
            self.answers[(name, reply.code if not reply.ok else 200)] += 1
        elif isinstance(reply, pb.DisaggResponses):
            for item in reply.reqs:
                self.answers[(name, item.status_code)] += 1
        return reply


async def _grpc_fuzz(cluster, fz: _GrpcFuzz, service_rpc: str) -> None:
    r = fz.rng
    deadline = time.monotonic() + GRPC_BUDGET_S
    placed: list[str] = []
    async with grpc.aio.insecure_channel(cluster.decode_meta["rpc_address"]) as dch, \
            grpc.aio.insecure_channel(cluster.mix_meta["rpc_address"]) as mch, \
            grpc.aio.insecure_channel(cluster.decode_meta["worker_rpc_addrs"][0]) as wch, \
            grpc.aio.insecure_channel(service_rpc) as sch:
        decode, mix = pb_grpc.DisaggPDServiceStub(dch), pb_grpc.DisaggPDServiceStub(mch)
        worker, service = pb_grpc.WorkerServiceStub(wch), pb_grpc.XllmRpcServiceStub(sch)
        while time.monotonic() < deadline:
            kind = r.choice(["add", "add", "first", "first", "multi", "pull", "push", "gens",
                             "heartbeat", "register"])
            if kind == "add":
                msg = pb.DisaggRequests(prefill_name=r.choice(["p", ""]),
                                        reqs=[fz.request() for _ in range(r.choice([1, 1, 3]))])
                reply = await fz.call("AddNewRequests", decode.AddNewRequests(msg, timeout=10))
                if reply is not None:
                    placed += [x.req_id for x in reply.reqs if x.status_code == 200]
            elif kind == "first":
                msg = pb.DisaggGenerationsRequests(gens=[fz.handover(placed)
                                                         for _ in range(r.choice([1, 2]))])
                await fz.call("FirstGeneration", decode.FirstGeneration(msg, timeout=15))
            elif kind == "multi":
                item = pb.MultiGenerationsRequest(request=fz.request(),
                                                  has_num_unread_tokens=r.random() < 0.3,
                                                  num_unread_tokens=fz._int())
                item.generated_token_ids.extend(fz._tokens()[:r.choice([0, 1, 3])])
                if r.random() < 0.3:
                    item.kv.CopyFrom(fz.handover([]))
                stub = r.choice([decode, mix])
                await fz.call("MultiGenerations", stub.MultiGenerations(
                    pb.MultiGenerationsRequests(reqs=[item]), timeout=15))
            elif kind in ("pull", "push"):
                cls = pb.PullKVCacheRequest if kind == "pull" else pb.PushKVCacheRequest
                n = r.choice([0, 1, 3, 5000])
                msg = cls(cluster_id=r.choice([0, 2 ** 64 - 1]), req_id=r.choice(["", "k"]),
                          addr=r.choice(["", "garbage", "127.0.0.1:1",
                                         cluster.decode_meta["addrs"][0]]))
                msg.src_blocks.extend(fz._int() for _ in range(n))
                msg.dst_blocks.extend(fz._int() for _ in range(n if r.random() < 0.8 else 2))
                rpc = worker.PullKVCache if kind == "pull" else worker.PushKVCache
                await fz.call("PullKVCache" if kind == "pull" else "PushKVCache",
                              rpc(msg, timeout=10))
            elif kind == "gens":
                msg = pb.DisaggStreamGenerations(instance_name=r.choice(["", "mix", "x" * 200]))
                for _ in range(r.choice([0, 1, 5])):
                    g = msg.gens.add(req_id=fz.req_id(), service_req_id=r.choice(["", "cmpl-1"]),
                                     finished=r.random() < 0.5,
                                     finished_on_prefill_instance=r.random() < 0.3)
                    g.gen_status.status_code = r.choice([0, 200, 400, 500, fz._int()])
                    out = g.outputs.add(index=fz._int(), text=r.choice(["", "hi", "\ud7ff"]))
                    out.token_ids.extend(fz._tokens()[:3])
                await fz.call("Generations", service.Generations(msg, timeout=10))
            elif kind == "register":
                meta = pb.InstanceMetaInfo(
                    name=r.choice(["", "ghost", "x" * 1000]), type=r.choice([0, 1, 2, 3, 99]),
                    rpc_address=r.choice(["", "nowhere", "127.0.0.1:1", "h:99999"]),
                    incarnation_id=r.choice(["", "i"]), dp_size=fz._int(),
                    block_size=fz._int(), num_blocks=fz._int())
                meta.cluster_ids.extend(r.choice([[], [1], [1, 2]]))
                meta.addrs.extend(r.choice([[], ["a:1"]]))
                await fz.call("RegisterInstance", service.RegisterInstance(meta, timeout=10))
            else:
                msg = pb.HeartbeatRequest(name=r.choice(["", "ghost"]),
                                          incarnation_id=r.choice(["", "i"]))
                msg.load_metrics.waiting_requests_num = fz._int()
                msg.load_metrics.gpu_cache_usage_perc = fz._float()
                await fz.call("Heartbeat", service.Heartbeat(msg, timeout=10))
        # What a prefill would do with the requests it placed and never handed over, and
        # a service with the ones that decode: end them.
        for rid in set(fz.ids) | set(placed):
            await decode.Cancel(pb.CancelRequest(req_id=rid, reason="fuzz cleanup"), timeout=10)
            await mix.Cancel(pb.CancelRequest(req_id=rid, reason="fuzz cleanup"), timeout=10)
        await decode.FirstGeneration(pb.DisaggGenerationsRequests(gens=[
            pb.DisaggGenerationsRequest(req_id=rid, failed=True) for rid in set(placed)]),
            timeout=30)


async def test_grpc_fuzz(cluster):
    server, _, source = await start_collector()
    fz = _GrpcFuzz(random.Random(15), source, tiny_vocab_size())
    before = (step_failures(cluster.decode), step_failures(cluster.mix))
    i = cluster.service.argv.index("--rpc-port")
    try:
        await _grpc_fuzz(cluster, fz, f"127.0.0.1:{cluster.service.argv[i + 1]}")
    finally:
        await server.stop(0)
    statuses = collections.Counter()
    for (_, code), n in fz.counts.items():
        statuses[code] += n
    print(f"\ngRPC fuzz: {sum(fz.counts.values())} calls, statuses {dict(statuses)}; per RPC "
          f"{dict(sorted(fz.counts.items()))}; codes in OK replies "
          f"{dict(sorted(fz.answers.items()))}")
    assert sum(fz.counts.values()) >= 50
    assert statuses["UNKNOWN"] == 0 and statuses["INTERNAL"] == 0, fz.counts
    await wait_blocks_free(cluster.decode, 60)
    await wait_blocks_free(cluster.mix, 60)
    assert (step_failures(cluster.decode), step_failures(cluster.mix)) == before
    assert blocks_used(cluster.decode) == 0
