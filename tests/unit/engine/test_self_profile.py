"""An engine's latency profile at start-up (xllm_py/engine/self_profile.py): timed steps
of known shape fitted to the profile's terms within a budget, corrected by the steps it
runs, and the settings derived from it by role (xllm_py/cluster/slo_defaults.py)."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest

from xllm_py.cluster import slo_defaults as d
from xllm_py.cluster.latency_profile import LatencyProfile, attn_pairs
from xllm_py.cluster.step_cost_fit import StepShape, fit_step_costs
from xllm_py.config import CacheConfig, EngineConfig, InstanceRole, SchedulerConfig
from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.engine.scheduler_types import ScheduledSeq, SchedulerOutput
from xllm_py.engine.self_profile import (ProfileCorrector, apply_derived, derived_settings,
                                         measure_profile, moved, start_up_profile)
from xllm_py.engine.step_observers import StepRecord

# tiny-25m on one core, as measured on the 2-core VM (prompt 0.62 ms a token, ...)
TRUE = LatencyProfile(prefill_base_ms=5.0, prefill_ms_per_token=0.62, decode_base_ms=6.6,
                      decode_ms_per_seq=0.6, decode_ms_per_ctx_token=0.001,
                      prefill_ms_per_kpair=0.27, max_model_len=2048)


def true_ms(shape: StepShape) -> float:
    return (TRUE.step_ms(shape.num_prefill_tokens, shape.num_decode_seqs,
                         shape.num_decode_ctx_tokens)
            + TRUE.prefill_ms_per_kpair * shape.num_prefill_pairs / 1000)


class FakeRunner:
    """Advances a clock by the true cost of each step it is given (no model)."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.shapes: list[StepShape] = []

    def execute_step(self, seqs):
        shape = StepShape.of(seqs)
        self.shapes.append(shape)
        self.clock[0] += true_ms(shape) / 1000
        for s in seqs:  # the sequences point at real blocks of the pool (not block 0)
            assert s.block_table and min(s.block_table) >= 1
            assert max(s.block_table) < 1024
        return types.SimpleNamespace(sample=types.SimpleNamespace(shape=(len(seqs), 8)))


def fake_engine(role: str = "DECODE", sched: SchedulerConfig | None = None):
    clock = [0.0]
    scheduler = ContinuousScheduler(sched or SchedulerConfig(), CacheConfig(), num_blocks=1024)
    engine = types.SimpleNamespace(
        scheduler=scheduler, runner=FakeRunner(clock), sampler=lambda logits, rows: None,
        model_config=types.SimpleNamespace(vocab_size=1000),
        config=EngineConfig(role=InstanceRole(role), etcd_addr="127.0.0.1:1"),
        latency_profile=None, profile_corrector=None, step_clock=lambda: clock[0])

    def set_latency_profile(profile, corrector=None):  # (LLMEngine.set_latency_profile)
        engine.latency_profile, engine.profile_corrector = profile, corrector

    engine.set_latency_profile = set_latency_profile
    return engine, clock


def test_the_profile_is_fitted_from_timed_steps_of_known_shape():
    engine, clock = fake_engine()
    p = measure_profile(engine, budget_s=60, clock=lambda: clock[0])
    for name in ("prefill_ms_per_token", "prefill_ms_per_kpair", "decode_base_ms",
                 "decode_ms_per_seq", "decode_ms_per_ctx_token"):
        assert getattr(p, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert p.max_num_batched_tokens == 2048 and p.max_model_len == 2048
    kinds = {(bool(s.num_prefill_tokens), bool(s.num_decode_seqs))
             for s in engine.runner.shapes}
    assert kinds == {(True, False), (False, True), (True, True)}  # mixed steps too
    assert max(s.num_decode_seqs for s in engine.runner.shapes) == 32
    # a chunk after a long prefix (no prompt computed before it): one step
    assert StepShape(256, 0, 0, attn_pairs(2047 - 256, 256)) in engine.runner.shapes


def test_the_budget_leaves_out_what_would_overrun_it():
    engine, clock = fake_engine()
    measure_profile(engine, budget_s=60, clock=lambda: clock[0])
    everything = set(engine.runner.shapes)
    engine, clock = fake_engine()
    p = measure_profile(engine, budget_s=0.0, clock=lambda: clock[0])
    # past its budget: the first six shapes only (each term of the fit is in them), and
    # the warm-up's decode step
    assert len(set(engine.runner.shapes)) == 6 + 1 < len(everything)
    assert p.prefill_ms_per_token == pytest.approx(TRUE.prefill_ms_per_token, rel=1e-6)


def test_the_fit_keeps_every_term_non_negative_and_needs_both_kinds():
    shapes = [StepShape(64), StepShape(256), StepShape(0, 1, 64), StepShape(0, 16, 4096),
              StepShape(256, 0, 0, attn_pairs(768, 256)), StepShape(0, 4, 1024)]
    coef = fit_step_costs([(s, true_ms(s)) for s in shapes])
    assert coef["prefill_ms_per_token"] == pytest.approx(0.62, rel=1e-6)
    assert all(v >= 0 for v in coef.values())
    noisy = [(s, max(0.0, true_ms(s) - 6.0)) for s in shapes]  # a negative base: dropped
    assert all(v >= 0 for v in fit_step_costs(noisy).values())
    with pytest.raises(ValueError, match="prefill-only and decode-only"):
        fit_step_costs([(StepShape(0, 1, 10), 1.0)] * 6)


def test_the_corrector_adds_to_each_kinds_base_what_its_steps_take_beyond_it():
    c = ProfileCorrector(TRUE)
    for _ in range(200):  # decode steps at one shape take 3 ms more than the profile says
        c.observe(StepShape(0, 8, 8192), TRUE.decode_step_ms(8, 8192) + 3.0)
        c.observe(StepShape(300, 4, 1000), 1000.0)  # a mixed step teaches neither kind
    assert c.decode_extra_ms == pytest.approx(3.0, rel=1e-3) and c.prefill_extra_ms == 0.0
    p = c.profile()
    # the same 3 ms at every other shape: the per-seq and per-context terms are kept
    for seqs, ctx in ((1, 100), (32, 32 * 1900)):
        assert p.decode_step_ms(seqs, ctx) == pytest.approx(TRUE.decode_step_ms(seqs, ctx) + 3.0,
                                                            rel=1e-3)
    assert p.decode_ms_per_ctx_token == TRUE.decode_ms_per_ctx_token
    assert p.prefill_ms(512) == pytest.approx(TRUE.prefill_ms(512))
    assert moved(TRUE, p) and not moved(TRUE, TRUE)
    # at the pace the targets are set by (8 streams of 1024 tokens, ~20 ms): 1 ms is not
    # a tenth of it
    assert not moved(TRUE, dataclasses.replace(TRUE, decode_base_ms=TRUE.decode_base_ms + 1))
    c.observe(StepShape(512), 1e9)  # one wild step moves it by a bounded amount
    assert c.prefill_extra_ms == pytest.approx(0.05 * 3 * TRUE.step_ms(512, 0, 0))
    for _ in range(500):  # steps far faster than predicted: bounded to a quarter
        c.observe(StepShape(0, 1, 10), 0.01)
    assert c.profile().decode_step_ms(1, 10) == pytest.approx(TRUE.decode_step_ms(1, 10) / 4,
                                                              rel=1e-3)


def test_every_step_the_engine_runs_corrects_the_profile():
    out = SchedulerOutput(seqs=[ScheduledSeq("a", [5], 99, [1] * 7, True)])
    corrector = ProfileCorrector(TRUE)
    for _ in range(100):  # a decode step of 1 stream, 20 ms from scheduling to outputs
        corrector.on_step(StepRecord(out, 0.0, 15.0, 20.0, 0, None))
    extra = 20.0 - TRUE.decode_step_ms(1, 100)
    assert corrector.num_observed == 100
    assert corrector.decode_extra_ms == pytest.approx(extra * (1 - 0.95 ** 100))


def test_an_engine_tells_its_step_observers_what_each_step_computed(tmp_path):
    """A simulated engine's steps reach its observers (the profile's corrector among
    them once set) with the step's output and its time on the engine's step clock."""
    from xllm_py.engine.llm_engine import EngineRequest
    from xllm_py.model.tiny import ensure_tiny_model
    from xllm_py.sampling_params import SamplingParams
    from xllm_py.sim.engine import SimulatedEngine
    from xllm_py.sim.time_model import TimeModel

    profile = tmp_path / "profile.json"
    TimeModel(prefill_base_ms=1.0, prefill_ms_per_token=0.02, decode_base_ms=1.0,
              decode_ms_per_seq=0.2, decode_ms_per_ctx_token=0.0).save(profile)
    config = EngineConfig(model=str(ensure_tiny_model("tiny")), simulate=str(profile),
                          cache=CacheConfig(num_blocks=64))
    engine = SimulatedEngine(config)
    seen: list[StepRecord] = []
    corrector = ProfileCorrector(TRUE)
    engine.set_latency_profile(TRUE, corrector)
    engine.step_observers.append(types.SimpleNamespace(on_step=seen.append))

    class Sink:
        def emit(self, out) -> None:
            pass

    engine.submit(EngineRequest("r", [11] * 20, SamplingParams(max_tokens=4), Sink()))
    engine._drain_commands(None)
    while engine.scheduler.has_schedulable_requests():
        engine.step()
    assert engine.latency_profile is TRUE and engine.profile_corrector is corrector
    assert len(seen) == engine.num_steps == corrector.num_observed == 4  # prompt + 3 decodes
    assert seen[0].out.seqs[0].request_id.startswith("r") and len(seen[0].out.seqs[0].token_ids) == 20
    assert all(s.whole_ms >= s.ms > 0 for s in seen)


def test_defaults_derived_from_a_tiny_25m_profile():
    assert d.tpot_target_ms([TRUE]) == pytest.approx(1.25 * TRUE.decode_step_ms(8, 8192))
    assert 20 < d.tpot_target_ms([TRUE]) < 27
    assert 2000 < d.ttft_target_ms([TRUE]) < 3200
    assert d.guard_target_ms(TRUE) == pytest.approx(0.65 * d.tpot_target_ms([TRUE]))
    assert d.hold_limit_ms(TRUE) == pytest.approx(0.6 * d.ttft_target_ms([TRUE]))
    assert d.decode_chunk_cap(TRUE) == 64
    assert d.prefill_step_budget(TRUE) == 512
    assert d.prefill_step_budget(TRUE, least=1024) == 1024  # never under max_num_seqs
    slow = dataclasses.replace(TRUE, decode_base_ms=66.0)  # the slowest decode sets it
    assert d.tpot_target_ms([TRUE, slow]) == d.tpot_target_ms([slow])
    assert d.decode_holding_ms(dataclasses.replace(TRUE, prompt_hold_max_ms=900)) == 300
    assert d.decode_holding_ms(TRUE) == 0  # no guard: never holding


def test_flags_not_given_are_left_to_the_profile(tmp_path):
    from xllm_py.utils.config_file import write_settings

    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg.scheduler.from_profile == {"max_num_batched_tokens", "prompt_hold_max_ms",
                                          "max_prefill_tokens_while_decoding",
                                          "prompt_tpot_target_ms"}
    assert cfg.scheduler.max_num_batched_tokens == 2048  # without a profile: as before
    assert cfg.scheduler.prompt_tpot_target_ms == 0
    cfg = config_from_args(build_parser().parse_args(
        ["--max-num-batched-tokens", "1024",
         *write_settings(tmp_path / "s.yaml", {"prompt_tpot_target_ms": 0})]))
    assert cfg.scheduler.from_profile == {"prompt_hold_max_ms",
                                          "max_prefill_tokens_while_decoding"}
    assert cfg.scheduler.max_num_batched_tokens == 1024


@pytest.mark.parametrize("role, keys", [
    ("PREFILL", {"max_num_batched_tokens", "prompt_hold_max_ms"}),
    ("DECODE", {"max_prefill_tokens_while_decoding", "prompt_tpot_target_ms",
                "prompt_hold_max_ms"}),
    ("MIX", {"prompt_hold_max_ms"})])
def test_settings_are_derived_by_role(role, keys):
    sched = config_from_args(build_parser().parse_args([])).scheduler
    assert set(derived_settings(sched, role, TRUE)) == keys
    given = dataclasses.replace(sched, from_profile=frozenset())
    assert derived_settings(given, role, TRUE) == {}


def test_a_decode_gets_its_guard_from_the_profile_and_registers_its_settings():
    sched = config_from_args(build_parser().parse_args([])).scheduler
    engine, _ = fake_engine("DECODE", sched)
    assert engine.scheduler.tpot_guard is None
    p = apply_derived(engine, TRUE)
    guard = engine.scheduler.tpot_guard
    assert guard.target_s * 1000 == pytest.approx(d.guard_target_ms(TRUE), abs=0.01)
    assert guard.max_hold_s * 1000 == pytest.approx(d.hold_limit_ms(TRUE), abs=0.1)
    assert engine.scheduler.config.max_prefill_tokens_while_decoding == 64
    assert (p.max_prefill_tokens_while_decoding, p.max_num_batched_tokens) == (64, 2048)
    assert p.prompt_hold_max_ms == engine.scheduler.config.prompt_hold_max_ms > 0
    assert p.prompt_tpot_target_ms == engine.scheduler.config.prompt_tpot_target_ms > 0
    assert LatencyProfile.from_dict(p.to_dict()) == p  # (as the service reads it)
    # corrected later: the guard follows, the step budgets stay
    slower = dataclasses.replace(TRUE, decode_base_ms=2 * TRUE.decode_base_ms)
    apply_derived(engine, slower, ("prompt_tpot_target_ms", "prompt_hold_max_ms"))
    assert engine.scheduler.tpot_guard is guard
    assert guard.target_s * 1000 == pytest.approx(d.guard_target_ms(slower), abs=0.01)


def test_where_the_start_up_profile_comes_from(tmp_path):
    engine, _ = fake_engine("MIX")
    standalone = dataclasses.replace(engine.config, etcd_addr=None)
    assert start_up_profile(engine, standalone) is None  # no cluster: nothing reads it
    assert start_up_profile(engine, engine.config) is not None  # elastic: the master does
    engine, _ = fake_engine("DECODE")
    off = dataclasses.replace(engine.config, latency_profile_path="off")
    assert start_up_profile(engine, off) is None and engine.profile_corrector is None
    path = tmp_path / "p.json"
    path.write_text(json.dumps(TRUE.to_dict()))
    given = dataclasses.replace(engine.config, latency_profile_path=str(path))
    p = start_up_profile(engine, given)
    assert p.prefill_ms_per_token == TRUE.prefill_ms_per_token  # the file overrides
    assert engine.latency_profile == p and engine.profile_corrector is None
    assert engine.runner.shapes == []  # nothing measured
