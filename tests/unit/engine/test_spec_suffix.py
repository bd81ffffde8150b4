"""Suffix decoding without a model: the index's matches, the most frequent continuation
under the probability cut-off and the spec factor, the engine-wide cache's bound, the
config, and the Speculator caching the outputs of requests that end well."""
from __future__ import annotations

import pytest

from xllm_py.speculative_config import SpeculativeConfig
from xllm_py.engine.spec_decode.speculator import Speculator
from xllm_py.engine.spec_decode.suffix import (SuffixCache, SuffixIndex, SuffixProposer,
                                               best_continuation)
from xllm_py.request import Request, RequestStatus
from xllm_py.sampling_params import SamplingParams

SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=6)


def _proposer(cache=None, min_prob=0.1, factor=1.0, depth=24) -> SuffixProposer:
    return SuffixProposer(cache or SuffixCache(8), depth, min_prob, factor)


def test_occurrences_count_the_match_backwards_up_to_the_depth():
    index = SuffixIndex()
    tokens = [1, 2, 3, 9, 2, 3, 8, 7]
    index.extend("a", tokens)
    found = sorted((n, start) for n, _, start in index.occurrences([5, 1, 2, 3], 24))
    assert found == [(2, 6), (3, 3)]  # "2 3" before 8, "1 2 3" before 9
    assert sorted(n for n, _, _ in index.occurrences([1, 2, 3], 2)) == [2, 2]  # depth 2
    assert index.occurrences([7], 24) == []  # the last token: nothing follows it


def test_the_most_frequent_continuation_wins_while_likely_enough():
    # "4 5" after 1, 2, 3 (then 6 7, 6 7, 6 8) and now after 9: each a match of 2
    tokens = [1, 4, 5, 6, 7, 2, 4, 5, 6, 7, 3, 4, 5, 6, 8, 9, 4, 5]
    assert _proposer().propose(tokens, 8) == [6, 7]  # (at most 1.0 x the match of 2)
    # p = 1, 2/3, then 1/3 (a tie of 2 and 3 after "6 7": the latest place wins), 1/3
    assert _proposer(factor=2).propose(tokens, 8) == [6, 7, 3, 4]
    assert _proposer(min_prob=0.5, factor=2).propose(tokens, 8) == [6, 7]
    assert _proposer(min_prob=0.8).propose(tokens, 8) == [6]
    # a longer match (9 4 5, once, before 6 8 0) is surer than the frequent short one
    longer = [9, 4, 5, 6, 8, 0] + tokens
    assert _proposer().propose(longer, 8) == [6, 8, 0]


def test_best_continuation_prefers_the_larger_expected_acceptance():
    a, b = [9, 1, 2, 3], [8, 5, 6, 7]
    found = [(3, a, 1), (1, b, 1)]
    # the match of 3: one place, 3 tokens sure; the match of 1: two places, 1 token at 1/2
    assert best_continuation(found, 3, 0.1, 1.0) == (3.0, [1, 2, 3])
    assert best_continuation(found[1:] + [(1, a, 1)], 3, 0.1, 1.0) == (0.5, [5])
    assert best_continuation([], 3, 0.1, 1.0) == (0.0, [])


def test_earlier_outputs_in_the_cache_are_proposed_and_the_cache_is_bounded():
    cache = SuffixCache(2)
    cache.add("a", [10, 11, 12, 13, 14])
    assert _proposer(cache).propose([99, 11, 12], 4) == [13, 14]
    cache.add("b", [20, 21, 22])
    cache.add("c", [30, 31, 32])  # "a" is evicted
    assert _proposer(cache).propose([99, 11, 12], 4) == []
    assert _proposer(cache).propose([99, 21], 4) == [22]
    for i in range(20):  # evicted entries are compacted away
        cache.add(f"r{i}", [40 + i, 41 + i])
    assert len(cache.index.seqs) == 2
    assert sum(map(len, cache.index._at.values())) <= 3 * 2 * 2
    assert SuffixCache(0).index.seqs == {} and _proposer().propose([], 4) == []


def test_suffix_config_parse():
    cfg = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8, '
                                  '"suffix_decoding_max_tree_depth": 16, '
                                  '"suffix_decoding_max_cached_requests": 10, '
                                  '"suffix_decoding_min_token_prob": 0.2}')
    assert (cfg.method, cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_min_token_prob,
            cfg.suffix_decoding_max_cached_requests) == ("suffix", 16, 0.2, 10)
    for bad in ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}',
                '{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
                '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
                '{"method": "suffix", "suffix_decoding_max_spec_factor": 0}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))


def test_speculator_caches_outputs_of_requests_that_end_well():
    spec = Speculator(SUFFIX)
    done, failed = _req("a", [1]), _req("b", [1])
    for token in (50, 51, 52, 53):
        done.append_output_token(token)
        failed.append_output_token(token + 10)
    done.status, failed.status = RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ERROR
    spec.finished(done)
    spec.finished(failed)
    later = _req("c", [7, 50, 51])
    fresh = _req("d", [7, 60, 61])
    assert spec.propose([later, fresh], 256) == {"c": [52, 53]}
    assert list(spec.stats) == ["suffix"]
