"""SubRequest: one engine request of a client request, and SubRequests, the service's
book of them (by engine request id, and by the instances each depends on).

Phases of a sub-request (every change goes through `SubRequest.transition`, checked
against `_ALLOWED`):

    MIX:  DISPATCHED -> STREAMING -> FINISHED     (DECODE path too: a decode serving it whole)
    PD:   DISPATCHED -> FIRST_RELAYED -> STREAMING -> FINISHED   (prefill's token first)
          DISPATCHED -> HOLDING -> STREAMING -> FINISHED         (a decode output first:
                                                                  held until prefill's)
    DISPATCHED:    Generate sent, nothing relayed yet.
    HOLDING:       PD: decode outputs arrived before prefill's first token; held.
    FIRST_RELAYED: PD: prefill's first token relayed, no decode output yet (decode may
                   still be pulling the KV).
    STREAMING:     outputs relayed as they arrive (a migrated sub is here too: it no
                   longer depends on its prefill).
    FINISHED:      its last output, or its error, is with the client.
    CANCELLED:     forgotten before it finished (client gone, Generate failed): late
                   outputs under its id are answered ok=false.

Any live phase may end in FINISHED or CANCELLED.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum

from xllm_py.cluster.latency_profile import attn_pairs
from xllm_py.rpc.convert import EngineRequestSpec
from xllm_py.outputs import RequestOutput
from xllm_service.instance_table import InstanceInfo
from xllm_service.router import Route


class SubPhase(enum.IntEnum):
    DISPATCHED = 1
    HOLDING = 2
    FIRST_RELAYED = 3
    STREAMING = 4
    FINISHED = 5
    CANCELLED = 6

    @property
    def is_done(self) -> bool:
        return self in (SubPhase.FINISHED, SubPhase.CANCELLED)


_ENDS = {SubPhase.FINISHED, SubPhase.CANCELLED}
_ALLOWED: dict[SubPhase, set[SubPhase]] = {
    SubPhase.DISPATCHED: {SubPhase.HOLDING, SubPhase.FIRST_RELAYED, SubPhase.STREAMING, *_ENDS},
    SubPhase.HOLDING: {SubPhase.STREAMING, *_ENDS},
    SubPhase.FIRST_RELAYED: {SubPhase.STREAMING, *_ENDS},
    SubPhase.STREAMING: set(_ENDS),
    SubPhase.FINISHED: set(),
    SubPhase.CANCELLED: set(),
}


@dataclasses.dataclass(frozen=True)
class InstanceWork:
    """The service's own requests on one instance: prompt tokens not yet computed there,
    and the sequences it generates (or will, once their prompt is in) with their context."""
    pending_prefill_tokens: int = 0
    decoding_seqs: int = 0
    decoding_ctx_tokens: int = 0
    pending_prefill_pairs: int = 0  # the (token, key) pairs those prompts attend to
    # those prompts, oldest first: (sent at, monotonic s; prompt tokens; TTFT target ms, 0:
    # none): a prefill takes them in deadline order (xllm_py/cluster/prefill_order.py)
    pending_prompts: tuple[tuple[float, int, float], ...] = ()


class InvalidSubTransition(RuntimeError):
    pass


@dataclasses.dataclass(eq=False)
class SubRequest:
    """One engine request of a client request (PD n > 1 is split into n of them)."""
    engine_request_id: str
    index_offset: int  # its sequence indices are shifted by this (PD n-split)
    route: Route
    queue: asyncio.Queue
    spec: EngineRequestSpec | None = None  # what the engine got (migration resends it)
    request_id: str = ""  # the client request's id (engine ids are made from it)
    phase: SubPhase = SubPhase.DISPATCHED
    held: list[RequestOutput] = dataclasses.field(default_factory=list)  # PD, HOLDING
    # PD: its decode's KV transfer failed before the prefill's first token was in (the
    # message): once that token is relayed, a decode recomputes the prompt
    kv_lost: str = ""
    generated: list[int] = dataclasses.field(default_factory=list)  # relayed token ids
    num_read: int = 0  # of those, how many the client has the text of
    # monotonic times: Generate sent, first and last token relayed (SLO_AWARE measures)
    sent_s: float = 0.0
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0  # tokens relayed (all sequences)
    # the second output relayed: its time and the tokens relayed with it. The decode's pace
    # is measured from there: on the PD path the gap before it is the hand-over (the KV
    # pull, the decode's admission), not a step of the decode.
    paced_s: float | None = None
    paced_tokens: int = 0

    def transition(self, phase: SubPhase) -> None:
        if phase not in _ALLOWED[self.phase]:
            raise InvalidSubTransition(
                f"sub-request {self.engine_request_id}: {self.phase.name} -> {phase.name}")
        self.phase = phase

    def advance(self, phase: SubPhase) -> None:
        """On to `phase`, unless the sub is there or past it already."""
        if self.phase < phase and not self.phase.is_done:
            self.transition(phase)

    @property
    def finished(self) -> bool:
        return self.phase is SubPhase.FINISHED

    @property
    def single_sequence(self) -> bool:
        """Its outputs are one sequence, so `generated` can resume it elsewhere. PD subs
        always are (n is split), so are DECODE-path ones; a MIX sub when n == 1 and
        best_of <= 1."""
        if self.route.on_decode_role:
            return True
        params = self.spec.params if self.spec is not None else None
        return params is not None and params.n == 1 and (params.best_of or 1) <= 1

    @property
    def serving(self) -> str:
        """The instance generating its tokens (the one whose death migrates it)."""
        return self.route.serving.name

    @property
    def awaiting_take_over(self) -> bool:
        """A PD sub whose prefill's first token is relayed and no decode output yet: the
        decode has not taken it over (it may still be pulling the KV). It can resume from
        that token on any decode by recomputing the prompt (MultiGenerations, no KV)."""
        return (self.route.is_pd and len(self.generated) == 1 and not self.held
                and self.spec is not None and self.single_sequence and not self.phase.is_done)

    def unstarted_on(self, name: str) -> bool:
        """Nothing of it reached its client, and instance `name` is the one computing it:
        a MIX or DECODE-path sub there, or a PD sub whose prefill it is."""
        return (self.phase is SubPhase.DISPATCHED and not self.generated and not self.held
                and self.spec is not None and name == self.route.target.name)

    @property
    def prefilling(self) -> bool:
        """Its prompt is still being computed: nothing relayed yet (the prefill's, or the
        instance serving it whole, first token)."""
        return self.phase is SubPhase.DISPATCHED

    def __repr__(self) -> str:  # no prompt, no tokens
        return (f"SubRequest({self.engine_request_id}, {self.phase.name}, "
                f"route={'/'.join(self.route.instance_names)}, generated={len(self.generated)})")


class SubRequests:
    """The sub-requests in flight, by engine request id, and for each instance the ids of
    those that depend on it (its eviction fails or moves them; `inflight` counts them).

    A sub depends on every instance of its route when added; `release` ends its
    dependence on its prefill, `move` re-points a PD sub to another decode, `rekey` gives
    a migrated sub a new id that depends on its new instance only, `forget` drops it.
    """

    def __init__(self) -> None:
        self._subs: dict[str, SubRequest] = {}
        # name -> ids; an instance stays listed (with 0) until evicted, for the gauge
        self._by_instance: dict[str, set[str]] = collections.defaultdict(set)

    def __len__(self) -> int:
        return len(self._subs)

    def get(self, engine_request_id: str) -> SubRequest | None:
        return self._subs.get(engine_request_id)

    def add(self, sub: SubRequest) -> None:
        self._subs[sub.engine_request_id] = sub
        for name in sub.route.instance_names:
            self._by_instance[name].add(sub.engine_request_id)

    def forget(self, sub: SubRequest) -> None:
        self._subs.pop(sub.engine_request_id, None)
        for name in sub.route.instance_names:
            self._discard(name, sub.engine_request_id)

    def release(self, sub: SubRequest, name: str) -> None:
        """`sub` no longer depends on instance `name` (its route still names it)."""
        self._discard(name, sub.engine_request_id)

    def move(self, sub: SubRequest, decode: InstanceInfo) -> None:
        """A PD sub is now on `decode` (the prefill handed it there)."""
        self._discard(sub.route.decode.name, sub.engine_request_id)
        self._by_instance[decode.name].add(sub.engine_request_id)
        sub.route = Route(sub.route.target, decode)

    def rekey(self, sub: SubRequest, new_id: str, route: Route) -> None:
        """`sub` continues as `new_id` on `route`, depending only on the instance serving
        it there; its old id is unknown from now on."""
        self.forget(sub)
        sub.engine_request_id, sub.route = new_id, route
        self._subs[new_id] = sub
        self._by_instance[sub.serving].add(new_id)

    def pop_instance(self, name: str) -> list[SubRequest]:
        """The subs that depend on `name`, which is gone: it is no longer listed."""
        ids = sorted(self._by_instance.pop(name, ()))
        return [sub for i in ids if (sub := self._subs.get(i)) is not None]

    def inflight(self, name: str) -> int:
        return len(self._by_instance.get(name, ()))

    def work(self, name: str) -> InstanceWork:
        """What the subs here ask of instance `name` now (SLO_AWARE predicts from it)."""
        pending = seqs = ctx = pairs = 0
        prompts = []
        for i in self._by_instance.get(name, ()):
            sub = self._subs.get(i)
            if sub is None or sub.spec is None or sub.phase.is_done:
                continue
            prompt = len(sub.spec.prompt_token_ids)
            if sub.prefilling and sub.route.target.name == name:
                pending += prompt
                pairs += attn_pairs(0, prompt)
                prompts.append((sub.sent_s, prompt, float(sub.spec.ttft_slo_ms)))
            if sub.serving == name:
                seqs += 1
                ctx += prompt + len(sub.generated)
        return InstanceWork(pending, seqs, ctx, pairs, tuple(sorted(prompts)))

    def inflight_by_instance(self) -> list[tuple[str, int]]:
        return sorted((name, len(ids)) for name, ids in self._by_instance.items())

    def _discard(self, name: str, engine_request_id: str) -> None:
        ids = self._by_instance.get(name)
        if ids is not None:
            ids.discard(engine_request_id)
