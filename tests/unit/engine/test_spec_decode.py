"""Speculative decoding's parts without a model: the n-gram lookup, greedy acceptance, the
Speculator's choices (who proposes, how many, its rests, what a step's price leaves), and the
scheduler's verify step (the guesses scheduled with the last token, the KV rolled back,
no block holding a rejected guess hashed, stops applied token by token)."""
from __future__ import annotations

import dataclasses

import pytest

from tests.unit.sched_utils import DEFAULTS
from xllm_py.cluster.latency_profile import LatencyProfile
from xllm_py.config import CacheConfig, SchedulerConfig
from xllm_py.speculative_config import SpeculativeConfig
from xllm_py.engine.block_pool import BlockPool
from xllm_py.engine.hybrid_kv import HybridKVCacheManager
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.engine.spec_decode import speculator as spec_mod
from xllm_py.engine.spec_decode.ngram import NgramIndex
from xllm_py.engine.spec_decode.speculator import Speculator
from xllm_py.engine.spec_decode.step_cost import StepCost, plan_guesses
from xllm_py.engine.spec_decode.verify import accept_greedy
from xllm_py.request import Request, RequestStatus
from xllm_py.sampling_params import SamplingParams

K4 = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)


# -- the parts ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_first_longest_match():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4]
    assert index.propose(tokens, 3) == [5, 9, 2]  # (2, 3, 4) first seen at 1..3
    assert index.propose(tokens + [8], 3) == []  # (4, 8), (3, 4, 8): never seen
    assert NgramIndex(2, 3).propose([5, 6, 1, 2, 5, 6], 4) == [1, 2, 5, 6]
    assert NgramIndex(2, 2).propose([1, 2, 3, 1, 2], 8) == [3, 1, 2]  # to the end only
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_ngram_index_is_incremental():
    index, tokens = NgramIndex(1, 2), [4, 5]
    assert index.propose(tokens, 2) == []
    tokens += [6, 4]
    assert index.propose(tokens, 2) == [5, 6]


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_models_next_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]


def test_speculative_config_parse():
    assert SpeculativeConfig.parse("off") is None and SpeculativeConfig.parse(None) is None
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 1)
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 16}', "[1]", "{x",
                '{"prompt_lookup_min": 5, "prompt_lookup_max": 4}', '{"draft": 1}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


def _req(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 32)
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return Request(rid, prompt, SamplingParams(**params))


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2 + [1, 2]


def test_decodes_propose_within_max_tokens_and_the_context():
    """Every decode proposes (logprobs, penalties, bias, n, prompt logprobs: each guess row
    is sampled as its position's step would be), but a PD prefill's hand-over; under a
    grammar only the guesses it takes."""
    spec = Speculator(K4)
    plain = _req("a", REPEATING)
    sampled = _req("s", REPEATING, temperature=0.7, top_p=0.9, seed=3)
    others = [_req("l", REPEATING, logprobs=0),
              _req("p", REPEATING, presence_penalty=0.5), _req("b", REPEATING, logit_bias={3: 1.0}),
              _req("n", REPEATING, n=2), _req("q", REPEATING, prompt_logprobs=0)]
    short = _req("m", REPEATING, max_tokens=3)  # 3 left: at most 2 guesses
    last = _req("z", REPEATING, max_tokens=1)
    assert spec.propose([plain, short, last], max_model_len=256) == {"a": [3, 4, 5, 6],
                                                                     "m": [3, 4]}
    assert spec.propose(others, max_model_len=256) == {r.request_id: [3, 4, 5, 6]
                                                      for r in others}
    assert spec.propose([sampled], max_model_len=256) == {"s": [3, 4, 5, 6]}
    assert spec.propose([plain], max_model_len=len(REPEATING) + 3) == {"a": [3, 4]}
    handover = Request("h", REPEATING, SamplingParams(max_tokens=8, temperature=0.0),
                       remote_decode=True)
    assert spec.propose([handover], 256) == {}
    constrained = _req("g", REPEATING)
    constrained.grammar = _Grammar(takes=2)
    assert spec.propose([constrained], 256) == {"g": [3, 4]}


class _Grammar:
    """A SequenceGrammar taking the first `takes` guesses."""

    def __init__(self, takes: int) -> None:
        self.takes = takes

    def num_guessable(self, token_ids) -> int:
        return min(self.takes, len(token_ids))


def test_plan_takes_the_guesses_that_raise_tokens_per_ms():
    # One sequence, a step of 10 ms, a row 1 ms: a guess worth g pays while g > tokens / ms.
    assert plan_guesses([("a", 4, 0.9)], 1, 10.0, 1.0) == {"a": 4}
    # Sixteen sequences at 40 ms: the bar is 0.4 a row; 0.9, 0.81, ... then 0.53 < 0.55.
    many = plan_guesses([(f"r{i}", 4, 0.9) for i in range(16)], 16, 40.0, 1.5)
    assert set(many.values()) <= {1, 2, 3} and len(many) == 16
    assert plan_guesses([("a", 4, 0.3)], 16, 40.0, 1.5) == {}  # 0.3 * 40 < 1.5 * 16
    # The likelier sequence's guesses first; none from a sequence never kept.
    two = plan_guesses([("lo", 4, 0.5), ("hi", 4, 0.95), ("no", 4, 0.0)], 2, 10.0, 2.0)
    assert two["hi"] > two.get("lo", 0) and "no" not in two
    assert plan_guesses([("a", 3, 0.5)], 4, 10.0, 0.0) == {"a": 3}  # rows free: all


def test_step_cost_fits_the_decode_steps():
    cost = StepCost()
    assert cost.fit() is None
    for rows in (1, 5, 9, 1, 5, 9, 1, 5):
        cost.add(rows, 10.0 + 1.5 * rows)
    base, per_row = cost.fit()
    assert base == pytest.approx(10.0) and per_row == pytest.approx(1.5)
    same = StepCost()
    for _ in range(20):
        same.add(4, 12.0)  # every step of one size: the slope is unknown
    assert same.fit() is None


def test_a_compute_bound_step_verifies_no_guesses_and_probes_later():
    spec = Speculator(K4)
    for rows in (8, 12, 16, 24, 8, 16):  # 5 ms + 4 ms a row: 16 seqs, 69 ms a step
        spec.step_cost.add(rows, 5.0 + 4.0 * rows)
    batch = [_req(f"r{i}", REPEATING) for i in range(16)]
    # One sequence (9 ms): 0.8 * 9 > 4 * 1, 0.64 * 13 > 4 * 1.8, not 0.512 * 17 > 4 * 2.44
    assert len(spec.propose(batch[:1], 256)["r0"]) == 2
    for _ in range(spec_mod.PRICED_OUT_STEPS):
        assert spec.propose(batch, 256) == {}  # bar 64 / 69: a rate of 0.8 is not
    probes = spec.propose(batch, 256)  # then each verifies a short probe
    assert len(probes) == 16 and {len(g) for g in probes.values()} == {spec_mod.PROBE_TOKENS}


def test_a_sequence_left_alone_after_a_large_batch_guesses_at_once():
    spec = Speculator(K4)
    for rows in (8, 12, 16, 24, 8, 16):  # 5 ms + 4 ms a row
        spec.step_cost.add(rows, 5.0 + 4.0 * rows)
    batch = [_req(f"r{i}", REPEATING) for i in range(16)]
    probing_steps = sum(bool(spec.propose(batch, 256)) for _ in range(100))
    # priced out all along, but for a probe every PRICED_OUT_STEPS + 1 steps
    assert probing_steps == 100 // (spec_mod.PRICED_OUT_STEPS + 1)
    # the batch drains: alone, the survivor's guesses pay (bar 4 / 9) and it guesses now
    assert len(spec.propose(batch[:1], 256)["r0"]) == 2


def test_a_fully_kept_verify_makes_the_next_rest_short_again():
    spec = Speculator(K4)
    req, kv = _req("a", REPEATING), _FakeKV()

    def rest_after_rejections() -> int:
        while "a" in spec.propose([req], 256):
            spec.settle(req, 4, 0, 1, kv)  # every guess rejected
        rested = 1
        while "a" not in spec.propose([req], 256):
            rested += 1
        return rested

    first = spec_mod.FIRST_REST_STEPS
    assert [rest_after_rejections() for _ in range(3)] == [first, 2 * first, 4 * first]
    spec.settle(req, 2, 2, 3, kv)  # the probe after the rest: both guesses kept
    assert rest_after_rejections() == spec_mod.FIRST_REST_STEPS


def test_a_predictions_guesses_are_priced_like_the_others():
    """A prediction's rows pay their way like the lookup's: alone, some; in a compute-bound
    step (a row costs more than the step's share of a token) none, the lookup's neither."""
    spec = Speculator(K4)
    for rows in (8, 12, 16, 24, 8, 16):  # 5 ms + 2 ms a row
        spec.step_cost.add(rows, 5.0 + 2.0 * rows)

    def predicted(rid: str) -> Request:
        r = _req(rid, [1, 2, 3], prediction_token_ids=list(range(10, 30)))
        r.append_output_token(10)
        return r

    assert 0 < len(spec.propose([predicted("alone")], 256)["alone"]) <= spec_mod.PREDICTION_TOKENS
    batch = [predicted(f"p{i}") for i in range(24)] + [_req(f"a{i}", REPEATING) for i in range(8)]
    assert spec.propose(batch, 256) == {}


def test_the_latency_profile_prices_a_step_until_the_fit_does():
    # A decode step of 20 ms + 1 ms a sequence; a guess costs like a prompt token, 2 ms.
    profile = LatencyProfile(prefill_base_ms=5, prefill_ms_per_token=2, decode_base_ms=20,
                             decode_ms_per_seq=1, decode_ms_per_ctx_token=0)
    spec = Speculator(K4, lambda: profile)
    assert spec.step_price([_req("a", REPEATING)] * 4) == (24, 2)
    for rows in (1, 3, 5, 1, 3):
        spec.step_cost.add(rows, 3.0 + 0.5 * rows)
    assert spec.step_price([_req("a", REPEATING)] * 4) == pytest.approx((5.0, 0.5))


def test_a_sequence_whose_guesses_fail_rests_then_tries_again():
    spec = Speculator(K4)
    req = _req("a", REPEATING)
    kv = _FakeKV()
    rests = []
    for _ in range(3):
        steps = 0
        while "a" in spec.propose([req], 256):
            spec.settle(req, 4, 0, 1, kv)  # every guess rejected
            steps += 1
        rested = 1  # (the call that ended the loop above)
        while "a" not in spec.propose([req], 256):
            rested += 1
        rests.append(rested)
    assert rests == [spec_mod.FIRST_REST_STEPS, 2 * spec_mod.FIRST_REST_STEPS,
                     4 * spec_mod.FIRST_REST_STEPS]
    stats = spec.stats["ngram"]
    assert stats.proposed == 4 * stats.verify_steps and stats.accepted == 0


class _FakeKV:
    block_size = 4

    def truncate(self, request, num_blocks):
        pass

    def cache_full_blocks(self, request):
        pass


# -- the scheduler's verify step -----------------------------------------------------------
def _scheduler(windows=(0,), num_blocks=65, **cfg) -> ContinuousScheduler:
    values = {**DEFAULTS, "num_blocks": num_blocks, **cfg}
    sched = SchedulerConfig(**{k: v for k, v in values.items()
                               if k in {f.name for f in dataclasses.fields(SchedulerConfig)}})
    cache = CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True)
    pool = BlockPool(num_blocks, 4, True, num_groups=len(windows))
    kv = None if len(windows) == 1 else HybridKVCacheManager(pool, windows)
    return ContinuousScheduler(sched, cache, num_blocks, kv_cache_manager=kv,
                               group_windows=windows, speculator=Speculator(K4))


def _prefill(sched: ContinuousScheduler, req: Request, first_token: int) -> None:
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {req.request_id: first_token})


@pytest.mark.parametrize("windows", [(0,), (0, 6)])
def test_verify_step_keeps_accepted_tokens_and_rolls_the_rest_back(windows):
    sched = _scheduler(windows)
    req = _req("a", REPEATING)  # 20 tokens: 5 full blocks
    _prefill(sched, req, 3)  # 21 tokens, 20 computed
    out = sched.schedule()
    [seq] = out.seqs
    assert seq.token_ids == [3, 4, 5, 6, 7] and seq.spec_token_ids == [4, 5, 6, 7]
    assert seq.start_pos == 20 and out.num_batched_tokens == 5
    assert len(req.block_ids) == 7  # slots for positions 20..24
    # The model agrees with 4 and 5, then says 9: emitted 4, 5, 9.
    [upd] = sched.update_from_output(out, {"a": 4}, {"a": [5, 9]})
    assert upd.new_token_ids == [4, 5, 9] and not upd.finished
    assert req.output_token_ids == [3, 4, 5, 9]
    assert req.num_computed_tokens == 23 == req.num_tokens - 1
    assert len(req.block_ids) == 6  # the block of positions 24.. went back
    for table in sched.kv.tables(req):
        assert len(table) == 6
    # Hashed: the five full blocks of computed tokens (positions 0..19), not block 5,
    # which holds 3 computed tokens and the slot of a rejected guess.
    assert len(req.block_hashes) == 5
    pool = sched.kv.block_pool
    assert pool.block_hash(req.block_ids[5]) is None
    sched.abort_request("a")
    assert pool.num_used_blocks == 0


def test_verify_step_never_passes_max_tokens_and_stops_at_a_stop_token():
    sched = _scheduler()
    capped = _req("a", REPEATING, max_tokens=4)
    _prefill(sched, capped, 3)
    out = sched.schedule()
    assert out.seqs[0].spec_token_ids == [4, 5]  # 3 tokens left: 2 guesses
    [upd] = sched.update_from_output(out, {"a": 4}, {"a": [5, 6]})
    assert upd.finished and upd.finish_reason == "length"
    assert upd.new_token_ids == [4, 5, 6] and capped.num_output_tokens == 4
    stopped = _req("b", REPEATING, stop_token_ids=[5])
    _prefill(sched, stopped, 3)
    out = sched.schedule()
    [upd] = sched.update_from_output(out, {"b": 4}, {"b": [5, 6, 7, 8]})
    assert upd.finished and upd.new_token_ids == [4, 5] and upd.stop_reason == 5
    assert sched.kv.block_pool.num_used_blocks == 0
    # every guess was kept both times: the stop and the cap refused none
    stats = sched.speculator.stats["ngram"]
    assert stats.rejections == 0 and stats.accepted == 2 + 4 and stats.rate == 1.0


def test_guesses_never_preempt():
    # 8 usable blocks: the prompt takes 5 and a sixth for its next token; the guesses
    # would need a seventh, which another request holds.
    sched = _scheduler(num_blocks=9)
    req, other = _req("a", REPEATING), _req("b", [42, 43, 44])
    sched.add_request(req)
    sched.add_request(other)
    sched.update_from_output(sched.schedule(), {"a": 3, "b": 1})
    sched.kv.allocate_slots(other, 4)  # (now holds 2 blocks: none left)
    assert sched.kv.num_free_blocks == 1
    out = sched.schedule()
    seqs = {s.request_id: s for s in out.seqs}
    assert seqs["a"].spec_token_ids == [] and seqs["a"].token_ids == [3]
    assert out.preempted_ids == [] and req.status == RequestStatus.RUNNING


def test_prometheus_counters_per_method():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from xllm_py.engine.metrics import EngineStatsCollector

    spec = Speculator(K4)
    req = _req("a", REPEATING)
    spec.propose([req], 256)
    spec.settle(req, 4, 2, 3, _FakeKV())  # 4 guessed, 2 kept
    spec.propose([req], 256)
    spec.settle(req, 4, 4, 5, _FakeKV())  # 4 guessed, all kept
    samples = {}
    scheduler = SimpleNamespace(kv=SimpleNamespace(held_blocks=dict))
    for engine in (SimpleNamespace(stats=dict, scheduler=scheduler, speculator=spec),
                   SimpleNamespace(stats=dict, scheduler=scheduler, speculator=None)):
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(engine))
        samples[engine.speculator is not None] = {
            (s.name, tuple(s.labels.items())): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples}
    on = samples[True]
    ngram = ("method", "ngram")
    assert on[("xllm_spec_decode_proposed_tokens_total", (ngram,))] == 8
    assert on[("xllm_spec_decode_accepted_tokens_total", (ngram,))] == 6
    assert on[("xllm_spec_decode_verify_steps_total", (ngram,))] == 2
    # the acceptance length histogram: one step kept 2, one kept 4
    bucket = "xllm_spec_decode_acceptance_length_bucket"
    assert [on[(bucket, (("le", le), ngram))] for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")] == [
        0, 1, 1, 2, 2]
    assert on[("xllm_spec_decode_acceptance_length_sum", (ngram,))] == 6
    assert on[("xllm_spec_decode_acceptance_length_count", (ngram,))] == 2
    assert not any(name.startswith("xllm_spec") for name, _ in samples[False])


def test_engine_settings_take_the_speculative_config(tmp_path):
    from xllm_py.engine.cli import build_parser, config_from_args
    from xllm_py.utils.config_file import write_settings

    def parse(value):
        return build_parser().parse_args(
            write_settings(tmp_path / "s.yaml", {"speculative_config": value}))

    default = config_from_args(build_parser().parse_args([])).speculative
    assert default == SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                        prompt_lookup_max=4, prompt_lookup_min=2)
    assert default.cost_aware
    assert config_from_args(parse("off")).speculative is None
    on = parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
               '"prompt_lookup_min": 2}')
    assert config_from_args(on).speculative == SpeculativeConfig(num_speculative_tokens=3)
    mapping = parse({"method": "ngram", "num_speculative_tokens": 3})  # (YAML's own spelling)
    assert config_from_args(mapping).speculative == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(SystemExit):
        parse('{"method": "eagle"}')
