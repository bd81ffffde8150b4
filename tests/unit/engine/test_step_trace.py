"""step_trace (the settings file): one line per engine step (what it carried, what it
cost, the TPOT guard's answer) and the summary that says where a latency tail comes from."""
from __future__ import annotations

import json
import queue

import pytest

from xllm_py.engine.scheduler_types import ScheduledSeq, SchedulerOutput
from xllm_py.engine.step_trace import StepTrace, format_summary, summarize
from xllm_py.engine.tpot_guard import Stream, TpotGuard
from xllm_py.sim.time_model import TimeModel


def _step(t, ms, decode_seqs=0, prompt_tokens=0, guard=None, ctx=0, est=None):
    line = {"t": t, "ms": ms, "decode_seqs": decode_seqs, "decode_context": ctx,
            "prompt_seqs": int(prompt_tokens > 0), "prompt_tokens": prompt_tokens,
            "waiting": 0, "guard": guard}
    if est is not None:
        line["guard_step_ms"], line["guard_token_ms"] = est
    return line


def test_record_splits_the_step_into_streams_and_prompt_chunks(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    out = SchedulerOutput(seqs=[ScheduledSeq("a", [5], 100, [0], True),
                                ScheduledSeq("b", [6], 20, [1], True),
                                ScheduledSeq("c", [1] * 64, 64, [2, 3], False)],
                          num_batched_tokens=66, num_decode_seqs=2)
    guard = TpotGuard(target_ms=16)
    guard.observe_step(0.010, 0, 2)
    guard.observe_step(0.040, 64, 2)
    guard.begin_step(0.0)
    guard.prompt_tokens_allowed(0.0, [Stream("a", 30)], 0.0)
    guard.observe_step(0.041, 64, 2)  # the step's own cost: not what it was sized with
    trace.record(12.5, 41.23, out, num_waiting=3, guard=guard)
    trace.record(12.6, 9.0, SchedulerOutput(seqs=out.seqs[:1], num_batched_tokens=1,
                                            num_decode_seqs=1), 0, None)
    trace.close()
    trace.record(12.7, 1.0, out, 0, None)  # after close: nothing, no error
    first, second = [json.loads(x) for x in path.read_text().splitlines()]
    assert first == {"t": 12.5, "ms": 41.23, "decode_seqs": 2, "decode_context": 120,
                     "prompt_seqs": 1, "prompt_tokens": 64, "waiting": 3, "guard": "slack",
                     "guard_step_ms": 10.0, "guard_token_ms": 0.469}
    assert second["guard"] is None and "guard_step_ms" not in second


def test_a_pid_in_the_path_gives_each_engine_process_its_own_file(tmp_path):
    import os

    trace = StepTrace(str(tmp_path / "steps-{pid}.jsonl"))
    trace.close()
    assert trace.path == str(tmp_path / f"steps-{os.getpid()}.jsonl")
    assert os.path.exists(trace.path)


def test_the_guard_says_why_it_answered_and_forgets_it_each_step():
    guard = TpotGuard(target_ms=16, max_hold_ms=1000)
    streams = [Stream("a", 10)]
    assert guard.prompt_tokens_allowed(0.0, streams, 0.0) is None
    assert guard.last_decision == "unmeasured"
    guard.observe_step(0.015, 0, 1)
    guard.observe_step(0.040, 64, 1)
    guard.stream_token("a", 0.0)
    assert guard.prompt_tokens_allowed(1.0, streams, 0.0) == 0  # 1 s for 0 tokens: no slack
    assert guard.last_decision == "held"
    assert guard.prompt_tokens_allowed(1.0, streams, 2.0) is None
    assert guard.last_decision == "hold limit"
    guard.begin_step(1.1)
    assert guard.last_decision == ""


def test_summary_prices_prompt_chunks_against_decode_only_steps_of_the_same_batch():
    steps = ([_step(i * 0.02, 10.0, decode_seqs=2, ctx=300) for i in range(5)]
             + [_step(0.2, 50.0, decode_seqs=2, prompt_tokens=64, guard="slack"),
                _step(0.3, 45.0, decode_seqs=2, prompt_tokens=64, guard="hold limit"),
                _step(0.4, 35.0, decode_seqs=3),  # a slow step without a prompt
                _step(0.5, 300.0, prompt_tokens=512)])  # no streams: no stall
    sm = summarize(steps, slow_ms=30)
    assert sm["steps"] == 9 and sm["with_streams"] == 8
    assert sm["decode_only_by_batch"][2] == {"steps": 5, "ms_p50": 10.0, "ms_p90": 10.0,
                                             "context_p50": 300, "between_ms_p50": 10.0}
    assert sm["decode_only_by_batch"][3]["between_ms_p50"] is None  # one step: no gap
    riding = sm["prompts_beside_streams"]
    assert riding["slack"] == {"steps": 1, "prompt_tokens": 64, "stall_stream_ms": 80.0}
    assert riding["hold limit"]["stall_stream_ms"] == pytest.approx(70.0)
    assert sm["slow_steps_with_streams"] == {"prompt (slack)": 1, "prompt (hold limit)": 1,
                                             "decode only": 1}
    assert sm["busy_s"] == pytest.approx(0.48)
    assert sm["prompt_only"] == {"steps": 1, "prompt_tokens": 512, "tokens_p50": 512,
                                 "ms_p50": 300.0, "ms_p90": 300.0}
    text = format_summary(sm)
    assert "hold limit" in text and "decode only 1" in text
    assert "prompt-only steps (no streams): 1, 512 tokens" in text
    assert sm["guard_measured_over_estimate"] == {}  # no estimates in these lines


def test_summary_says_how_long_the_loop_spends_between_decode_steps():
    # 25 ms steps 25.4 ms apart: 0.4 ms between them; an idle wait (2 s) and the step
    # after a prompt chunk do not count
    steps = ([_step(i * 0.0254, 25.0, decode_seqs=1) for i in range(4)]
             + [_step(2.5, 25.0, decode_seqs=1), _step(2.6, 40.0, decode_seqs=1, prompt_tokens=8),
                _step(2.9, 25.0, decode_seqs=1)])
    d = summarize(steps)["decode_only_by_batch"][1]
    assert d["between_ms_p50"] == pytest.approx(0.4)
    assert "between p50 (ms)" in format_summary(summarize(steps))
    assert "0.40" in format_summary(summarize(steps))


def test_summary_sets_the_guards_estimates_against_the_steps():
    steps = ([_step(0.0, 10.0, decode_seqs=2, est=(8.0, 0.5)),  # 1.25x the step estimate
              _step(0.1, 12.0, decode_seqs=2, est=(12.0, 0.5)),
              _step(0.2, 44.0, decode_seqs=2, prompt_tokens=64, est=(12.0, 0.5)),  # 32 / 32
              _step(0.3, 28.0, decode_seqs=2, prompt_tokens=32, est=(12.0, 0.5)),  # 16 / 16
              _step(0.4, 9.0, decode_seqs=1, est=(None, None))])  # not measured yet
    acc = summarize(steps)["guard_measured_over_estimate"]
    assert acc["step"] == {"p10": 1.0, "p50": 1.0, "p90": 1.25}  # (nearest rank)
    assert acc["prompt_stall"] == {"p10": 1.0, "p50": 1.0, "p90": 1.0}
    assert "guard's prompt stall estimate, measured / estimated" in format_summary(
        summarize(steps))
    assert summarize([]) == {"steps": 0} and format_summary({"steps": 0}) == "no steps"


def test_a_simulated_engine_traces_every_step(tmp_path):
    """The engine loop writes one line per step it ran: the prompt's chunks, then its
    stream's decode steps beside a second prompt that the TPOT guard is asked about."""
    from xllm_py.engine.cli import build_parser, config_from_args
    from xllm_py.engine.llm_engine import EngineRequest
    from xllm_py.sim.engine import SimulatedEngine
    from xllm_py.model.tiny import ensure_tiny_model
    from xllm_py.sampling_params import SamplingParams
    from xllm_py.utils.config_file import write_settings

    profile = tmp_path / "profile.json"
    TimeModel(prefill_base_ms=1.0, prefill_ms_per_token=0.02, decode_base_ms=1.0,
              decode_ms_per_seq=0.2, decode_ms_per_ctx_token=0.0).save(profile)
    trace = tmp_path / "steps.jsonl"
    settings = write_settings(tmp_path / "settings.yaml", {
        "simulate": str(profile), "batch_window_ms": 0, "prompt_tpot_target_ms": 50,
        "step_trace": str(trace)})
    cfg = config_from_args(build_parser().parse_args(
        [*settings, "--model", str(ensure_tiny_model("tiny")),
         "--num-blocks", "64", "--max-num-batched-tokens", "16", "--max-num-seqs", "4"]))
    engine = SimulatedEngine(cfg)
    engine.start()
    q: queue.Queue = queue.Queue()

    class Sink:
        def emit(self, out):
            q.put(out)

    try:
        engine.submit(EngineRequest("r0", [11] * 40, SamplingParams(max_tokens=20), Sink()))
        finished, sent_r1 = set(), False
        while len(finished) < 2:
            out = q.get(timeout=30)
            if out.request_id == "r0" and not sent_r1:  # r0 decodes: r1 arrives beside it
                sent_r1 = True
                engine.submit(EngineRequest("r1", [12] * 24, SamplingParams(max_tokens=4),
                                            Sink()))
            if out.finished:
                finished.add(out.request_id)
        num_steps = engine.num_steps
    finally:
        engine.stop()
    steps = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(steps) == num_steps
    assert sum(s["prompt_tokens"] for s in steps) == 40 + 24
    assert [s["prompt_tokens"] for s in steps[:3]] == [16, 16, 8]  # r0's chunks, no streams
    assert all(s["decode_seqs"] == 0 for s in steps[:3])
    assert sum(s["decode_seqs"] for s in steps) == (20 - 1) + (4 - 1)
    beside = [s for s in steps if s["decode_seqs"] and s["prompt_tokens"]]
    assert beside and all(s["guard"] for s in beside)  # the guard was asked for each
