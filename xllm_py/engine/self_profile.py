"""An engine's latency profile, measured at start-up and corrected by its own steps
(xLLM profiles TTFT and TPOT when an instance starts, `profile_ttft` /
`profile_tpot`).

`measure_profile(engine)`, before the engine thread starts: steps of known shape straight
through the engine's own model runner and sampler (prompt chunks from position 0 and after
a prefix, decode batches of 1..32 sequences at short and long contexts, prompt chunks
beside decodes), timed on the wall clock -> the profile's terms fitted to them
(xllm_py/cluster/step_cost_fit.py) -> a LatencyProfile with the engine's step budgets.
A step needs no request: its sequences point at free KV blocks (their contents are
whatever is there; the cost of attention does not depend on them), every decode sequence
of a batch at the same ones. No prompt before a chunk is computed, so the cost of a chunk
after a long prefix is one step. Bounded: the shapes go cheapest first, each kind in
turn; one predicted (from the steps so far) to end past `budget_s` is left out, and
every shape runs at most `REPEATS` times. On the 2-core VM, tiny-25m: ~2 s.

Timed by the engine thread's CPU time where it computes alone (CPU, one torch thread:
the cost on a core of its own, which another process's load does not move; the wall clock
otherwise). The service scales the predictions to the wall clock the requests then see
(pd_decision.py `SloPredictor.observe`), the TPOT guard measures its steps itself.

`ProfileCorrector`, a step observer of the engine (step_observers.py: the whole step,
scheduling, forward, sampling, outputs, on the same clock): a moving average (weight ALPHA) of what
the step took beyond the profile's prediction, one for prompt-only steps (added to the
prompt base) and one for decode steps (added to the decode base), each step's time
bounded to 1/4..4 x the prediction; `profile()` is the measured profile so corrected (what
the cluster node registers again when it moved by a tenth, cluster_node.py, with the TPOT
guard's settings derived again from it). Additive: what the start-up steps leave out is
per step (scheduling, outputs: the same at any context), and the steps an engine runs are
the shapes it happens to get (a decode at short contexts); a scale learned there would
move every term, the per-token and per-context ones the start-up fit measured over the
whole range, and with them the targets the service derives (measured rounds: a TPOT
target of 11.5 ms in two rounds, 20.0 ms in a third, with one cluster and one workload).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from xllm_py.cluster import slo_defaults as d
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.cluster.step_cost_fit import StepShape, fit_step_costs
from xllm_py.engine.scheduler_types import ScheduledSeq
from xllm_py.engine.step_observers import StepRecord

logger = logging.getLogger(__name__)

BUDGET_S = 4.0  # wall time the start-up profile may take (warm-up included)
REPEATS = 3  # runs of a shape (its median counts); a shape over REPEAT_MAX_MS runs once
REPEAT_MAX_MS = 100.0
ALPHA = 0.05  # weight of one step in the corrections
RATIO_BOUND = 4.0


def _plan(budget: int, max_seqs: int, max_ctx: int) -> list[tuple[str, tuple]]:
    """The shapes to time, in order: ("prompt", (start, tokens)), ("decode", (seqs, ctx)),
    ("mixed", (seqs, ctx, start, tokens)); the cheap ones that fix every term first."""
    def chunk(n: int) -> int:
        return max(1, min(n, budget, max_ctx - 1))

    long_ctx = max(2, min(1024, max_ctx - 1))
    mid = max(0, min(896, max_ctx - 1 - chunk(128)))
    end = max(0, max_ctx - 1 - chunk(256))
    # (the first six always run: each term of the fit is in them; short, so that a big
    # model's six fit in a few seconds too: a 128-token chunk after 896 tokens is a
    # third attention pairs)
    plan = [("prompt", (0, chunk(64))), ("decode", (1, min(64, long_ctx))),
            ("prompt", (0, chunk(128))), ("decode", (min(16, max_seqs), 256)),
            ("prompt", (mid, chunk(128))), ("decode", (min(16, max_seqs), long_ctx)),
            ("mixed", (min(4, max_seqs), 256, 0, chunk(64))),
            ("prompt", (0, chunk(1024))), ("decode", (min(32, max_seqs), long_ctx)),
            ("prompt", (0, chunk(256))),
            ("prompt", (end, chunk(256))), ("decode", (1, long_ctx)),
            ("mixed", (min(8, max_seqs), long_ctx, max(0, max_ctx // 2 - chunk(64)), chunk(64))),
            ("prompt", (0, chunk(16))), ("decode", (min(4, max_seqs), 256))]
    return [x for i, x in enumerate(plan) if x not in plan[:i]]


def _seqs(kind: str, shape: tuple, block_size: int, vocab: int,
          num_blocks: int) -> list[ScheduledSeq]:
    """The sequences of a step of `shape`; each decode sequence on blocks of its own while
    the pool has them (blocks 1..num_blocks - 1: block 0 is the null block)."""
    def table(tokens: int, first: int = 0) -> list[int]:
        n = -(-tokens // block_size)
        return [1 + (first + j) % (num_blocks - 1) for j in range(n)]

    def prompt(start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq("profile-prompt", [(start + i) % (vocab - 16) + 16 for i in range(n)],
                            start, table(start + n), True)

    def decode(seqs: int, ctx: int) -> list[ScheduledSeq]:
        per_seq = -(-ctx // block_size)
        return [ScheduledSeq(f"profile-decode-{i}", [16 + i % (vocab - 16)], ctx - 1,
                             table(ctx, i * per_seq), True) for i in range(seqs)]

    if kind == "prompt":
        return [prompt(*shape)]
    if kind == "decode":
        return decode(*shape)
    seqs, ctx, start, n = shape
    return decode(seqs, ctx) + [prompt(start, n)]


def measure_profile(engine, budget_s: float = BUDGET_S,
                    clock: Callable[[], float] | None = None) -> LatencyProfile:
    """The engine's profile from timed steps (module docstring); call before the engine
    thread starts (nothing else may use the KV pool meanwhile). The budget is wall time;
    `clock` times the steps (default: the engine's step clock, model_setup.LoadedModel)."""
    from xllm_py.engine.sampler import SamplingRow
    from xllm_py.sampling_params import SamplingParams

    clock = clock or engine.step_clock
    t_all = t_start = time.perf_counter()
    spent = [0.0, 0.0]  # the steps' clock and wall ms (the budget is wall time)
    sched = engine.scheduler.config
    bs = engine.scheduler.block_size
    max_ctx = min(engine.scheduler.max_model_len,
                  (engine.scheduler.kv.block_pool.num_usable_blocks - 1) * bs)
    vocab = engine.model_config.vocab_size
    greedy = SamplingRow(SamplingParams(temperature=0.0))

    def run(seqs: list[ScheduledSeq]) -> float:
        t0, w0 = clock(), time.perf_counter()
        logits = engine.runner.execute_step(seqs).sample
        if logits is not None:
            engine.sampler(logits, [greedy] * logits.shape[0])
        ms = (clock() - t0) * 1000
        spent[0] += ms
        spent[1] += (time.perf_counter() - w0) * 1000
        return ms

    num_blocks = engine.scheduler.kv.block_pool.num_usable_blocks + 1
    run(_seqs("prompt", (0, min(64, max_ctx - 1)), bs, vocab, num_blocks))  # warm-up
    run(_seqs("decode", (2, min(64, max_ctx - 1)), bs, vocab, num_blocks))
    t_start, spent[:] = time.perf_counter(), [0.0, 0.0]  # (the budget starts after it)
    samples: list[tuple[StepShape, float]] = []
    skipped = 0
    for kind, shape in _plan(sched.max_num_batched_tokens, sched.max_num_seqs, max_ctx):
        seqs = _seqs(kind, shape, bs, vocab, num_blocks)
        step = StepShape.of(seqs)
        left_ms = (budget_s - (time.perf_counter() - t_start)) * 1000
        wall_per_ms = spent[1] / spent[0] if spent[0] > 0 else 1.0
        if len(samples) >= 6 and _guess_ms(samples, step) * wall_per_ms > left_ms:
            skipped += 1
            continue
        times = [run(seqs)]
        while len(times) < REPEATS and times[0] < REPEAT_MAX_MS:
            times.append(run(seqs))
        samples.append((step, sorted(times)[len(times) // 2]))
        logger.debug("profile step %s %s: %s ms", kind, shape, [round(t, 1) for t in times])
    coef = fit_step_costs(samples)
    profile = LatencyProfile(**coef, max_num_batched_tokens=sched.max_num_batched_tokens,
                             max_prefill_tokens_while_decoding=(
                                 sched.max_prefill_tokens_while_decoding),
                             max_model_len=engine.scheduler.max_model_len)
    logger.info("latency profile measured in %.1f s (%d step shapes, %d left out for time): "
                "prompt %.3f ms/token + %.3f ms/kpair + %.1f ms a step; decode %.1f ms + %.2f "
                "ms/seq + %.4f ms/context token", time.perf_counter() - t_all, len(samples),
                skipped,
                profile.prefill_ms_per_token, profile.prefill_ms_per_kpair,
                profile.prefill_base_ms, profile.decode_base_ms, profile.decode_ms_per_seq,
                profile.decode_ms_per_ctx_token)
    return profile


def _guess_ms(samples: list[tuple[StepShape, float]], step: StepShape) -> float:
    """A step's time from the steps timed so far (a fit when it can be made, else the
    slowest per-token rate seen): enough to leave out what would overrun the budget."""
    try:
        c = fit_step_costs(samples)
    except ValueError:
        return 0.0
    guess = LatencyProfile(**c).step_ms(step.num_prefill_tokens, step.num_decode_seqs,
                                        step.num_decode_ctx_tokens)
    return guess + c["prefill_ms_per_kpair"] * step.num_prefill_pairs / 1000


class ProfileCorrector:
    """The start-up profile corrected by what the engine's steps take (module docstring),
    timed by the engine's step clock: the one the profile was measured by."""

    def __init__(self, profile: LatencyProfile) -> None:
        self.base = profile
        self.prefill_extra_ms = 0.0
        self.decode_extra_ms = 0.0
        self.num_observed = 0

    def on_step(self, step: StepRecord) -> None:
        self.observe(StepShape.of(step.out.seqs), step.whole_ms)

    def observe(self, shape: StepShape, ms: float) -> None:
        if ms <= 0 or not (shape.num_prefill_tokens or shape.num_decode_seqs):
            return
        p = self.base
        if shape.num_decode_seqs and not shape.num_prefill_tokens:
            predicted = p.decode_step_ms(shape.num_decode_seqs, shape.num_decode_ctx_tokens)
            self.decode_extra_ms = _ema(self.decode_extra_ms, ms, predicted)
        elif shape.num_prefill_tokens and not shape.num_decode_seqs:
            predicted = (p.step_ms(shape.num_prefill_tokens, 0, 0)
                         + p.prefill_ms_per_kpair * shape.num_prefill_pairs / 1000)
            self.prefill_extra_ms = _ema(self.prefill_extra_ms, ms, predicted)
        else:
            return  # (a mixed step's time is both kinds': neither corrects alone)
        self.num_observed += 1

    def profile(self) -> LatencyProfile:
        p = self.base
        return dataclasses.replace(
            p, prefill_base_ms=max(0.0, p.prefill_base_ms + self.prefill_extra_ms),
            decode_base_ms=max(0.0, p.decode_base_ms + self.decode_extra_ms))


def _ema(old: float, ms: float, predicted: float) -> float:
    """`old` moved towards this step's time beyond `predicted` (bounded, module docstring)."""
    if predicted <= 0:
        return old
    ms = min(RATIO_BOUND * predicted, max(predicted / RATIO_BOUND, ms))
    return old + ALPHA * (ms - predicted - old)


# ---------------------------------------------------------------- start-up and derived
OFF = ("off", "none")  # latency_profile: off: no profile (none measured, none registered)


def start_up_profile(engine, config) -> LatencyProfile | None:
    """The profile an engine registers, before its thread starts: latency_profile FILE,
    else a simulated engine's time model, else (in a cluster: PREFILL, DECODE, and MIX,
    whose duty the master decides from it) measured here; None for a standalone engine
    without a file (nothing reads it), or with `latency_profile: off`. The scheduler settings left to the profile are derived
    from it (`apply_derived`); a measured one is corrected by the steps from then on
    (the engine's `profile_corrector`). Sets it on the engine (`set_latency_profile`)."""
    path = config.latency_profile_path
    if path is not None and path.lower() in OFF:
        return None
    measured = False
    if path or config.simulate:
        profile = LatencyProfile.load(path or config.simulate)
    elif config.etcd_addr and config.role.value in ("PREFILL", "DECODE", "MIX"):
        profile, measured = measure_profile(engine), True
    else:
        return None
    profile = apply_derived(engine, profile)
    engine.set_latency_profile(profile, ProfileCorrector(profile) if measured else None)
    return profile


# What a corrected profile re-derives (the step budgets stay as set at start-up).
GUARD_SETTINGS = ("prompt_tpot_target_ms", "prompt_hold_max_ms")


def derived_settings(sched, role: str, p: LatencyProfile,
                     only: tuple[str, ...] | None = None) -> dict:
    """The scheduler settings of `sched.from_profile` (the flags not given; of those, the
    ones in `only`) for an instance of `role` and profile `p`
    (xllm_py/cluster/slo_defaults.py)."""
    names = {n for n in sched.from_profile if only is None or n in only}
    out: dict = {}
    if role == "PREFILL" and "max_num_batched_tokens" in names:
        out["max_num_batched_tokens"] = d.prefill_step_budget(p, sched.max_num_seqs)
    if role == "DECODE" and "max_prefill_tokens_while_decoding" in names:
        out["max_prefill_tokens_while_decoding"] = d.decode_chunk_cap(p)
    if role == "DECODE" and "prompt_tpot_target_ms" in names:
        out["prompt_tpot_target_ms"] = round(d.guard_target_ms(p), 2)
    if "prompt_hold_max_ms" in names:
        out["prompt_hold_max_ms"] = round(d.hold_limit_ms(p), 1)
    return out


def apply_derived(engine, p: LatencyProfile,
                  only: tuple[str, ...] | None = None) -> LatencyProfile:
    """Set the engine's scheduler settings derived from `p` (of those, the ones in
    `only`), and its TPOT guard's target and hold limit; returns `p` with the instance's
    settings (what it registers). On the engine thread once it runs."""
    from xllm_py.engine.tpot_guard import TpotGuard

    sched = engine.scheduler
    changes = derived_settings(sched.config, engine.config.role.value, p, only)
    if changes:
        sched.config = dataclasses.replace(sched.config, **changes)
        logger.info("scheduler settings from the latency profile: %s", changes)
    cfg = sched.config
    if cfg.prompt_tpot_target_ms > 0:
        if sched.tpot_guard is None:
            sched.tpot_guard = TpotGuard(cfg.prompt_tpot_target_ms,
                                         max_hold_ms=cfg.prompt_hold_max_ms)
        else:
            sched.tpot_guard.retarget(cfg.prompt_tpot_target_ms, cfg.prompt_hold_max_ms)
    guarded = sched.tpot_guard is not None  # (the guard's settings: 0 without one)
    return dataclasses.replace(
        p, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_prefill_tokens_while_decoding=cfg.max_prefill_tokens_while_decoding,
        max_model_len=sched.max_model_len,
        prompt_hold_max_ms=cfg.prompt_hold_max_ms if guarded else 0.0,
        prompt_tpot_target_ms=cfg.prompt_tpot_target_ms if guarded else 0.0)


def moved(old: LatencyProfile, new: LatencyProfile, by: float = 0.1) -> bool:
    """Whether the corrected profile moved by more than `by` (relative) since `old`, at
    the shapes the derived settings are taken at (a decode at the pace slo_defaults sets
    targets by, a 512-token prompt): a decode step of one stream at no context is mostly
    the base the corrections add to, and moved by a tenth every few seconds."""
    pairs = ((d.decode_pace_ms(old), d.decode_pace_ms(new)),
             (old.prefill_ms(512), new.prefill_ms(512)))
    return any(abs(b - a) > by * a for a, b in pairs if a > 0)
