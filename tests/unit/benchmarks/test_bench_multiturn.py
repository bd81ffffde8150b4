"""The pure parts of benchmarks/bench_multiturn.py: exact, reproducible histories, the turn
order, what it reads from the service's log and the engines' metrics, and its figures."""
from __future__ import annotations

import pytest

from benchmarks.bench_multiturn import (Conversations, Turn, compare, landings, metric_deltas,
                                        parse_metrics, parse_routes, per_tier, summarize_run,
                                        turn_order, wrong_tokens)


def test_histories_are_system_then_each_turns_message_and_answer():
    a = Conversations(num=2, system_len=10, user_len=4, vocab_size=50, seed=3)
    b = Conversations(num=2, system_len=10, user_len=4, vocab_size=50, seed=3)
    assert a.system == b.system and len(a.system) == 10
    assert a.user_message(1, 0) == b.user_message(1, 0)
    assert a.user_message(1, 0) != a.user_message(0, 0)
    assert a.user_message(1, 0) != a.user_message(1, 1)
    p0 = a.prompt(1, 0)
    assert p0 == a.system + a.user_message(1, 0)
    a.answer(1, 0, [7, 8])
    assert a.prompt(1, 1) == p0 + [7, 8] + a.user_message(1, 1)
    assert a.prompt(0, 0) == a.system + a.user_message(0, 0)  # the other one untouched
    assert all(5 <= t < 50 for t in a.prompt(1, 1))


def test_turn_order_is_a_seeded_permutation_that_changes_per_turn():
    orders = [turn_order(8, t, seed=0) for t in range(4)]
    assert all(sorted(o) == list(range(8)) for o in orders)
    assert orders == [turn_order(8, t, seed=0) for t in range(4)]
    assert len({tuple(o) for o in orders}) > 1


def test_routes_from_the_service_log():
    log = ("2026-12-07 03:20:01,443 INFO xllm_service.backend: request cmpl-9dfa-0-412a3476: "
           "384 prompt tokens, path mix on 127.0.0.1:24239\n"
           "x INFO xllm_service.backend: request cmpl-77-0-0123abcd: 9 prompt tokens, path pd "
           "on 127.0.0.1:1/127.0.0.1:2 (short)\n"
           "x INFO xllm_service.backend: request cmpl-77-0-99999999: 9 prompt tokens, path pd "
           "on 127.0.0.1:3/127.0.0.1:2\n")
    assert parse_routes(log) == {"cmpl-9dfa": "127.0.0.1:24239",
                                 "cmpl-77": "127.0.0.1:3/127.0.0.1:2"}  # the last attempt


def test_metrics_deltas_per_tier():
    before = parse_metrics('# HELP x\nxllm_kv_tier_hit_blocks_total{tier="host"} 2\n'
                           'xllm_other 5\n', ("xllm_kv_tier",))
    after = parse_metrics('xllm_kv_tier_hit_blocks_total{tier="host"} 7\n'
                          'xllm_kv_tier_hit_blocks_total{tier="store"} 3\n'
                          'xllm_kv_tier_dropped_blocks_total 0\n', ("xllm_kv_tier",))
    assert before == {'xllm_kv_tier_hit_blocks_total{tier="host"}': 2.0}
    deltas = metric_deltas(before, after)
    assert deltas == {'xllm_kv_tier_hit_blocks_total{tier="host"}': 5.0,
                      'xllm_kv_tier_hit_blocks_total{tier="store"}': 3.0}
    assert per_tier({f"{k}@{i}": v for i, (k, v) in enumerate(deltas.items())}
                    | {'xllm_kv_tier_hit_blocks_total{tier="host"}@9': 1.0}) == {
        "host": {"xllm_kv_tier_hit_blocks_total": 6.0},
        "store": {"xllm_kv_tier_hit_blocks_total": 3.0}}


def _turn(conv, turn, instance="a", cached=0, history=100, tokens=(1, 2), ttft=0.1, ok=True):
    return Turn(conv, turn, ok=ok, instance=instance, ttft_s=ttft, tpot_s=0.01,
                prompt_tokens=history + 10, cached_tokens=cached, history_tokens=history,
                completion_tokens=len(tokens), token_ids=list(tokens))


def test_landings_and_a_summary():
    recs = [_turn(0, 0, "a"), _turn(0, 1, "b", cached=90), _turn(0, 2, "b", cached=100),
            _turn(1, 0, "a"), _turn(1, 1, "", cached=5), _turn(1, 2, "a", ttft=0.3)]
    assert [(r.conv, r.turn, moved) for r, moved in landings(recs)] == [
        (0, 1, True), (0, 2, False)]  # conv 1: turn 2's instance unknown, so is 3's previous
    s = summarize_run(recs, wall_s=2.0, turns=3)
    assert s["failed"] == 0 and s["output_tok_s"] == 6.0
    assert s["prompt_tokens"] == 660 and s["cached_tokens"] == 195
    assert s["computed_tokens"] == 465
    assert [t["n"] for t in s["per_turn"]] == [2, 2, 2]
    assert s["per_turn"][2]["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["cross_instance"] == {"turns": 2, "moved": 1, "share": 0.5, "history_tokens": 100,
                                   "history_not_computed": 90, "per_turn_fraction_min": 0.9}


def test_wrong_tokens_against_the_reference():
    ref = [_turn(0, 0, tokens=(1, 2, 3)), _turn(0, 1, tokens=(4, 5))]
    assert wrong_tokens(ref, ref) == []
    run = [_turn(0, 0, tokens=(1, 9, 8)), _turn(0, 1, tokens=(4,))]
    assert wrong_tokens(ref, run) == [{"conv": 0, "turn": 1, "tokens": 2, "first": 1},
                                      {"conv": 0, "turn": 2, "tokens": 1, "first": 1}]


def test_ratios_round_by_round():
    def run(p50s, tpot):
        return {"per_turn": [{"ttft_p50_ms": v, "ttft_p90_ms": v} for v in p50s],
                "tpot_p50_ms": tpot, "output_tok_s": 10.0}

    r = compare([run([100, 10, 20], 5.0), run([100, 30, 30], 5.0)],
                [run([100, 100, 100], 5.0), run([100, 100, 150], 4.0)], turns=3)
    assert r["ttft_p50_per_turn"][0] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 2}
    assert r["ttft_p50_per_turn"][1] == {"median": 0.2, "min": 0.1, "max": 0.3, "n": 2}
    assert r["ttft_p50_turns_2_on"]["min"] == pytest.approx(0.15)
    assert r["tpot_p50"] == {"median": 1.125, "min": 1.0, "max": 1.25, "n": 2}


def test_pooled_landings_are_counted_run_by_run():
    from benchmarks.bench_multiturn import pooled

    runs = []
    for port in ("1", "2"):  # each run's instances have their own names
        recs = [_turn(0, 0, port), _turn(0, 1, port, cached=100)]
        runs.append((summarize_run(recs, 1.0, 2), recs))
    x = pooled(runs, 2)["cross_instance"]
    assert (x["turns"], x["moved"], x["share"]) == (2, 0, 0.0)
