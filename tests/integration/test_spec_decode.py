"""Speculative decoding (n-gram prompt lookup) is exact under greedy: a MIX engine with
speculation emits what it emits without, and what transformers emits, token for token, on
every family of tp_models.py (Gemma 3: a 6-token sliding window crossed many times),
batched and each request alone, with
guesses both kept and rolled back; beside a prefix-cache hit, and with preemption in a
pool too small for the batch. Its counters say guesses were proposed and accepted.
Rows whose sampling does more than an argmax speculate too, exactly (n-gram and
Predicted Outputs): logprobs and top logprobs (the same floats), logit bias, penalties,
a grammar (guesses it refuses cut; its end where it ends), n > 1."""
from __future__ import annotations

import threading

import pytest
import torch

from tests.integration.tp_models import FAMILIES, VOCAB, build_hf_model
from xllm_py.config import CacheConfig, EngineConfig
from xllm_py.speculative_config import SpeculativeConfig
from xllm_py.engine.llm_engine import EngineRequest, LLMEngine
from xllm_py.sampling_params import SamplingParams
from xllm_py.structured.spec import GrammarSpec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

BLOCK = 4
MAX_TOKENS = 24
# (every guess verified, whatever a step's price: each test exercises the verify path)
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1,
                         cost_aware=False)


class _Sink:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.token_ids: list[int] = []
        self.last = None
        # per sequence index: (token ids, logprobs or None, finish reason)
        self.seqs: dict[int, tuple[list[int], list | None, list]] = {}
        self.prompt_logprobs = None

    def emit(self, output) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            self.token_ids += delta.token_ids
            tokens, logprobs, finish = self.seqs.setdefault(delta.index, ([], None, []))
            tokens += delta.token_ids
            if delta.logprobs is not None:
                logprobs = (logprobs or []) + delta.logprobs
                self.seqs[delta.index] = (tokens, logprobs, finish)
            if delta.finish_reason is not None:
                finish.append(delta.finish_reason)
        if output.finished:
            self.last = output
            self.done.set()


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (the lookup finds matches) and one that does not."""
    g = torch.Generator().manual_seed(11)
    unit = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 3, 7)]
    return [unit[0] * 3 + unit[0][:2], unit[1] * 5, (unit[2] + unit[0]) * 2 + unit[2][:3],
            torch.randint(0, VOCAB, (9,), generator=g).tolist()]


def _run(model_dir, spec: SpeculativeConfig | None, prompts: list[list[int]], num_blocks: int,
         max_tokens: int = MAX_TOKENS, one_by_one: bool = False,
         predictions: list[list[int]] | None = None) -> tuple[list[list[int]], LLMEngine]:
    """Greedy outputs of `prompts`, submitted together (or each after the last finished)."""
    sinks, engine = _run_sinks(model_dir, spec, prompts, num_blocks, max_tokens, one_by_one,
                               predictions)
    return [s.token_ids for s in sinks], engine


def _run_sinks(model_dir, spec, prompts, num_blocks, max_tokens=MAX_TOKENS, one_by_one=False,
               predictions=None, parallel=None, **sampling) -> tuple[list[_Sink], LLMEngine]:
    """`parallel`: EngineConfig's tensor/pipeline parallel sizes."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_threads=1, speculative=spec,
                                    cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                                    **(parallel or {})))
    engine.start()
    try:
        sinks = [_Sink() for _ in prompts]
        params = [SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens,
                                 ignore_eos=True,
                                 prediction_token_ids=predictions[i] if predictions else [])
                  for i in range(len(prompts))]  # (made first: the requests arrive together)
        for i, (p, s) in enumerate(zip(prompts, sinks)):
            engine.submit(EngineRequest(f"r{i}", p, params[i], s))
            if one_by_one:
                assert s.done.wait(120), "request timed out"
        for s in sinks:
            assert s.done.wait(120), "request timed out"
            assert not s.last.failed, s.last.error_message
        return sinks, engine
    finally:
        engine.stop()


def _hf_greedy(hf, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_is_exact_per_family(family, tmp_path):
    hf = build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    off, _ = _run(tmp_path, None, prompts, 96)
    on, engine = _run(tmp_path, SPEC, prompts, 96)
    alone, _ = _run(tmp_path, SPEC, prompts, 96, one_by_one=True)  # (one row a step off)
    for prompt, a, b, c in zip(prompts, off, on, alone):
        assert len(a) == MAX_TOKENS
        assert c == b == a == _hf_greedy(hf, prompt)
    assert engine.speculator.stats["ngram"].accepted > 0, engine.speculator.stats
    assert engine.stats()["kv_blocks_used"] == 0
    # A prefix-cache hit of three blocks (a 13-token prompt's, cached by its request).
    first = prompts[1][:13]
    hit_prompt = first[:12] + first[:3]
    hits, engine = _run(tmp_path, SPEC, [first, hit_prompt], 96, one_by_one=True)
    assert engine.stats()["prefix_hit_tokens"] == 12
    assert engine.speculator.stats["ngram"].accepted > 0
    assert hits == [_hf_greedy(hf, first), _hf_greedy(hf, hit_prompt)]


@pytest.mark.parametrize("family,parallel", [
    ("llama-bias", {"tensor_parallel_size": 2}), ("gemma3-kv1", {"tensor_parallel_size": 2}),
    ("llama-bias", {"pipeline_parallel_size": 2}),
    ("gemma3-kv1", {"pipeline_parallel_size": 2})])
def test_speculation_is_exact_across_ranks(family, parallel, tmp_path):
    """TP 2 (each rank its heads: the verify rows' all-reduce sums per row, as a decode
    step's) and PP 2 (the rows pass stage to stage): the tokens and logprobs of TP 1
    without speculation."""
    build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    off, _ = _run_sinks(tmp_path, None, prompts, 96, logprobs=1)
    on, engine = _run_sinks(tmp_path, SPEC, prompts, 96, parallel=parallel, logprobs=1)
    for a, b in zip(off, on):
        assert b.token_ids == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(b.seqs[0][1], a.seqs[0][1])) < 1e-4
    assert engine.speculator.stats["ngram"].accepted > 0, engine.speculator.stats
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_speculation_is_exact_under_preemption(family, tmp_path, caplog):
    """A pool of 32 blocks for four sequences of up to 55 tokens: some are preempted and
    recomputed while the others speculate."""
    hf = build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    with caplog.at_level("INFO", logger="xllm_py.engine.scheduler_rules"):
        on, engine = _run(tmp_path, SPEC, prompts, 32, max_tokens=32)
    assert any("preempted" in r.getMessage() for r in caplog.records)
    assert engine.scheduler.kv.block_pool.num_used_blocks == 0
    assert engine.speculator.stats["ngram"].accepted > 0
    for prompt, b in zip(prompts, on):
        assert b == _hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_prediction_is_exact_and_counted(family, tmp_path):
    """Predicted Outputs on an engine without a speculative method: each request's
    prediction is its own greedy output edited (a token changed, two inserted, a tail
    cut): the output is the one without a prediction and transformers', the guesses
    kept and not kept are in each request's usage and add up to the counters."""
    hf = build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    off, _ = _run(tmp_path, None, prompts, 96)
    predictions = [o[:6] + [(o[6] + 1) % VOCAB] + o[7:12] + [1, 2] + o[12:20] for o in off]
    sinks, engine = _run_sinks(tmp_path, None, prompts, 96, predictions=predictions)
    for prompt, a, s in zip(prompts, off, sinks):
        assert s.token_ids == a == _hf_greedy(hf, prompt)
    stats = engine.speculator.stats["prediction"]
    # (whether the edited part's guesses were tried depends on the step's price: the
    # rejected count is checked exactly in tests/unit/engine/test_spec_prediction.py)
    assert stats.accepted > 0
    assert list(engine.speculator.stats) == ["prediction"]
    assert sum(s.last.num_accepted_prediction_tokens for s in sinks) == stats.accepted
    assert sum(s.last.num_rejected_prediction_tokens for s in sinks) == (
        stats.proposed - stats.accepted)
    assert engine.stats()["kv_blocks_used"] == 0


SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                           suffix_decoding_max_cached_requests=8, cost_aware=False)


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_suffix_decoding_is_exact(family, tmp_path):
    """Suffix decoding, batched and each request alone (the later ones also guessing from
    the earlier ones' cached outputs), and the same prompts a second time (their outputs
    cached whole): what speculation off and transformers emit."""
    hf = build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    off, _ = _run(tmp_path, None, prompts, 96)
    on, engine = _run(tmp_path, SUFFIX, prompts, 96)
    assert engine.speculator.stats["suffix"].accepted > 0
    again, engine = _run(tmp_path, SUFFIX, prompts + prompts, 96, one_by_one=True)
    for prompt, a, b, c, d in zip(prompts, off, on, again, again[len(prompts):]):
        assert d == c == b == a == _hf_greedy(hf, prompt)
    stats = engine.speculator.stats["suffix"]
    assert stats.accepted > 0 and list(engine.speculator.stats) == ["suffix"]
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_seeded_sampling_with_speculation_is_reproducible(family, tmp_path):
    """Sampled requests (temperature 0.1, top_p 0.95) with a seed: speculative sampling
    draws each output position from (seed, position) as a one-token step does, so the
    output is the same twice, and the same as with speculation off."""
    build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    sampling = dict(temperature=0.1, top_p=0.95, seed=7)
    off, _ = _run_sinks(tmp_path, None, prompts, 96, **sampling)
    runs = []
    for _ in range(2):
        sinks, engine = _run_sinks(tmp_path, SPEC, prompts, 96, **sampling)
        runs.append([s.token_ids for s in sinks])
        stats = engine.speculator.stats["ngram"]
        assert 0 < stats.accepted < stats.proposed  # (guesses kept and drawn against)
    assert runs[0] == runs[1] == [s.token_ids for s in off]
    assert len({tuple(r) for r in runs[0]}) == len(prompts)


def _same_with_and_without(tmp_path, max_tokens=MAX_TOKENS, num_prompts=4, **sampling):
    """Greedy with `sampling` (logprobs, bias, penalties, a grammar, n): speculation off,
    n-gram, and Predicted Outputs (each output without, edited: a token changed, two
    inserted) emit the same tokens, logprobs (equal floats) and finish reasons; guesses
    were kept. Returns the outputs without speculation and the prediction run's engine."""
    prompts = _prompts()[:num_prompts]
    off, _ = _run_sinks(tmp_path, None, prompts, 96, max_tokens, **sampling)
    on, engine = _run_sinks(tmp_path, SPEC, prompts, 96, max_tokens, **sampling)
    edited = [o[:6] + [(o[6] + 1) % VOCAB] + o[7:12] + [1, 2] + o[12:]
              for o in (s.seqs[0][0] for s in off)]
    predicted, p_engine = _run_sinks(tmp_path, None, prompts, 96, max_tokens,
                                     predictions=edited, **sampling)
    for a, b, c in zip(off, on, predicted):
        assert a.seqs == b.seqs == c.seqs
        assert a.prompt_logprobs == b.prompt_logprobs == c.prompt_logprobs
    assert engine.speculator.stats["ngram"].proposed > 0
    assert p_engine.speculator.stats["prediction"].accepted > 0
    for e in (engine, p_engine):
        assert e.stats()["kv_blocks_used"] == 0
    return off, engine


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_logprobs_and_logit_bias_are_exact(family, tmp_path):
    """Logprobs with the top 3 (and prompt logprobs) of every emitted token from the
    verify rows, a logit bias on each row: what one-token steps give, to the bit."""
    hf = build_hf_model(transformers, family, tmp_path)
    off, engine = _same_with_and_without(tmp_path, logprobs=3, prompt_logprobs=2)
    assert engine.speculator.stats["ngram"].accepted > 0
    for prompt, s in zip(_prompts(), off):
        tokens, logprobs, _ = s.seqs[0]
        assert tokens == _hf_greedy(hf, prompt)
        assert len(logprobs) == MAX_TOKENS and all(len(lp.top) == 3 for lp in logprobs)
        assert [lp.token_id for lp in logprobs] == tokens
    favoured = off[0].seqs[0][0][3]  # (a token the model emits: biased down, it is not)
    biased, _ = _same_with_and_without(tmp_path, logprobs=1,
                                       logit_bias={favoured: -100.0, 7: 2.5})
    assert all(favoured not in s.seqs[0][0] for s in biased)


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
@pytest.mark.parametrize("penalties", [dict(frequency_penalty=0.1, presence_penalty=0.05),
                                       dict(repetition_penalty=1.3)])
def test_penalties_are_exact(family, penalties, tmp_path):
    """Each verify row penalised with the history before its position (the output and
    the guesses before it): the tokens and logprobs of one-token steps."""
    build_hf_model(transformers, family, tmp_path)
    plain, _ = _run(tmp_path, None, _prompts(), 96)
    off, _ = _same_with_and_without(tmp_path, logprobs=2, **penalties)
    assert [s.seqs[0][0] for s in off] != plain  # (the penalties changed the outputs)


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_structured_outputs_are_exact(family, tmp_path):
    """A grammar of 60 characters from a set: guesses it refuses are cut (the edited
    predictions hold tokens out of its set), and before the token that completes it;
    each verify row masked by the grammar after the guesses before it; the grammar ends
    each output where it ends without speculation (finish reason stop, before
    max_tokens)."""
    build_hf_model(transformers, family, tmp_path)
    spec = GrammarSpec("regex", "[a-z0-9 ]{60}")
    off, _ = _same_with_and_without(tmp_path, max_tokens=80, logprobs=1, structured=spec)
    for s in off:
        tokens, _, finish = s.seqs[0]
        assert finish == ["stop"] and len(tokens) < 80


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_n_sequences_are_exact(family, tmp_path):
    """n = 3 with logprobs: each sequence is its own request and speculates as one (two
    prompts: six sequences, within the batch cut-off)."""
    build_hf_model(transformers, family, tmp_path)
    off, engine = _same_with_and_without(tmp_path, num_prompts=2, n=3, logprobs=1)
    assert engine.speculator.stats["ngram"].accepted > 0
    for s in off:
        assert sorted(s.seqs) == [0, 1, 2] and s.seqs[0] == s.seqs[1] == s.seqs[2]


@pytest.mark.parametrize("family", ["llama-bias", "gemma3-kv1"])
def test_seeded_sampling_with_penalties_logprobs_and_best_of_is_exact(family, tmp_path):
    """Sampled rows (seeded) with a frequency penalty, logprobs and best_of 2: each guess
    row draws from (seed, position) on its penalised distribution, so speculation emits
    what it emits without, the same logprobs, and best_of ranks the same sequences."""
    build_hf_model(transformers, family, tmp_path)
    prompts = _prompts()
    sampling = dict(temperature=0.3, seed=7, frequency_penalty=0.2, logprobs=2, best_of=2)
    off, _ = _run_sinks(tmp_path, None, prompts, 96, **sampling)
    on, engine = _run_sinks(tmp_path, SPEC, prompts, 96, **sampling)
    assert [s.seqs for s in on] == [s.seqs for s in off]
    assert engine.speculator.stats["ngram"].proposed > 0
    # the outputs as predictions: the sequence that made each is guessed right
    predicted, engine = _run_sinks(tmp_path, None, prompts, 96,
                                   predictions=[s.seqs[0][0] for s in off], **sampling)
    assert [s.seqs for s in predicted] == [s.seqs for s in off]
    assert engine.speculator.stats["prediction"].accepted > 0
