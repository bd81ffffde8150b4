"""Factories and a fake model runner for scheduler / KV-manager unit tests (no torch)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.engine.scheduler import ContinuousScheduler, RequestUpdate, SchedulerOutput
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams

_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}

DEFAULTS = dict(
    block_size=4,
    num_blocks=65,  # 64 usable + the null block
    enable_prefix_caching=True,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=256,
    enable_chunked_prefill=True,
)


def create_scheduler(**overrides: object) -> ContinuousScheduler:
    """A scheduler with small test defaults; any SchedulerConfig/CacheConfig field overrides."""
    values = {**DEFAULTS, **overrides}
    unknown = set(values) - _SCHED_FIELDS - _CACHE_FIELDS
    if unknown:
        raise ValueError(f"unknown scheduler/cache fields: {sorted(unknown)}")
    sched = SchedulerConfig(**{k: v for k, v in values.items() if k in _SCHED_FIELDS})
    cache = CacheConfig(**{k: v for k, v in values.items() if k in _CACHE_FIELDS})
    return ContinuousScheduler(sched, cache, num_blocks=cache.num_blocks)


def create_requests(
    n: int,
    num_tokens: int,
    *,
    prefix: list[int] | None = None,
    start: int = 0,
    remote_decode: bool = False,
    offline: bool = False,
    tpot_slo_ms: float = 0.0,
    **sampling: object,
) -> list[Request]:
    """`n` requests "req-<i>" of `num_tokens` tokens each; prompts differ unless `prefix`."""
    sampling.setdefault("max_tokens", 8)
    requests = []
    for i in range(start, start + n):
        head = list(prefix or [])
        tail = [(i + 1) * 1000 + j for j in range(num_tokens - len(head))]
        requests.append(
            Request(
                f"req-{i}",
                head + tail,
                SamplingParams(**sampling),
                arrival_time=float(i),
                remote_decode=remote_decode,
                offline=offline,
                tpot_slo_ms=tpot_slo_ms,
            )
        )
    return requests


def assert_scheduler_empty(scheduler: ContinuousScheduler) -> None:
    """No live request anywhere, and every usable block free with ref count 0."""
    assert scheduler.requests == {}
    assert len(scheduler.waiting) == 0
    assert len(scheduler.offline.waiting) == 0
    assert scheduler.running == []
    assert len(scheduler.offline.suspended) == 0
    assert scheduler.kv._requests == {}
    pool = scheduler.kv.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert pool.num_used_blocks == 0
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def default_next_token(request_id: str, context: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context."""
    value = 0
    for token in context:
        value = (value * 131 + token + 7) % 1_000_003
    return 100 + value % 900  # 100..999: never a prompt token of create_requests


class FakeRunner:
    """Simulates a paged KV cache: writes computed tokens into block slots and samples
    from the context it reads back through the block table, so a wrong block table,
    start position or a reused block without recompute changes the outputs."""

    def __init__(
        self,
        block_size: int,
        next_token: Callable[[str, list[int]], int] = default_next_token,
    ) -> None:
        self.block_size = block_size
        self.next_token = next_token
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token

    def fill(self, block_table: list[int], token_ids: list[int], start_pos: int = 0) -> None:
        """Write KV for tokens at positions start_pos.. (also used to fake a KV transfer)."""
        for i, token in enumerate(token_ids):
            pos = start_pos + i
            self.slots[(block_table[pos // self.block_size], pos % self.block_size)] = token

    def read(self, block_table: list[int], length: int) -> list[int]:
        context = []
        for pos in range(length):
            key = (block_table[pos // self.block_size], pos % self.block_size)
            assert key in self.slots, f"position {pos} read before its KV was written"
            context.append(self.slots[key])
        return context

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for seq in out.seqs:
            assert seq.block_table, "scheduled without blocks"
            assert 0 not in seq.block_table, "the null block was handed out"
            self.fill(seq.block_table, seq.token_ids, seq.start_pos)
            if seq.sample:
                context = self.read(seq.block_table, seq.start_pos + len(seq.token_ids))
                sampled[seq.request_id] = self.next_token(seq.request_id, context)
        return sampled


def run_to_completion(
    scheduler: ContinuousScheduler, runner: FakeRunner, max_steps: int = 1000
) -> dict[str, list[RequestUpdate]]:
    """Step until nothing is schedulable; returns every update per request id."""
    updates: dict[str, list[RequestUpdate]] = {}
    for _ in range(max_steps):
        if not scheduler.has_schedulable_requests():
            return updates
        out = scheduler.schedule()
        for update in scheduler.update_from_output(out, runner.step(out)):
            updates.setdefault(update.request_id, []).append(update)
    raise AssertionError(f"not done after {max_steps} steps")


def output_tokens(updates: list[RequestUpdate]) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]
