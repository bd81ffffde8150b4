"""Sampler: greedy, filters, penalties (exact numbers), seeded draws, distribution, logprobs."""
import math

import pytest
import torch

from tests.unit.sampling_rows import srow
from xllm_py.engine.sampler import Sampler, SamplingRow, apply_penalties, compute_probs
from xllm_py.outputs import TokenLogprob

VOCAB = 32


def random_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, vocab), generator=gen) * 3.0


def test_greedy_is_argmax():
    logits = random_logits(8)
    out = Sampler(seed=0)(logits, [srow(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_empty_batch():
    out = Sampler()(torch.empty((0, VOCAB)), [])
    assert out.token_ids == [] and out.logprobs == []


def test_bad_input_raises():
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(random_logits(3), [srow(temperature=0.0)] * 2)
    with pytest.raises(ValueError, match="temperature"):
        srow(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        srow(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="out of range"):
        apply_penalties(random_logits(1), [srow(temperature=1.0, presence_penalty=1.0,
                                                       output_token_ids=[VOCAB])])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 100.0])
def test_top_k_1_equals_greedy(temperature):
    logits = random_logits(16, seed=1)
    rows = [srow(temperature=temperature, top_k=1) for _ in range(16)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_picks_the_max_token():
    logits = random_logits(16, seed=2)
    rows = [srow(temperature=5.0, top_p=1e-6) for _ in range(16)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    # 1e-300 is 0 in float32: every token was dropped and the id drawn was the vocabulary
    # size (out of range: the next step failed). The best token always stays.
    rows = [srow(temperature=1.0, top_p=1e-300) for _ in range(16)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_probs():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]]))
    rows = [srow(temperature=1.0, top_k=2), srow(temperature=1.0, top_p=0.65)]
    probs = compute_probs(logits, rows)
    # top_k=2 keeps 0.4, 0.3; top_p=0.65 keeps the smallest set reaching 0.65: 0.4, 0.3.
    expected = torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [0.0, 4 / 7, 0.0, 3 / 7]])
    assert torch.allclose(probs, expected, atol=1e-6)
    assert (probs == 0).tolist() == [[True, False, True, False]] * 2


def test_min_p_filters_relative_to_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = compute_probs(logits, [srow(temperature=1.0, min_p=0.5)])
    # threshold 0.5 * 0.5 = 0.25: keep 0.5 and 0.3.
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    assert probs[0, 2].item() == 0.0 and probs[0, 3].item() == 0.0
    # Sampling never picks a filtered token.
    rows = [srow(temperature=1.0, min_p=0.5) for _ in range(200)]
    tokens = Sampler(seed=0)(logits.expand(200, 4).contiguous(), rows).token_ids
    assert set(tokens) == {0, 1}


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = compute_probs(logits, [srow(temperature=0.5)])
    assert torch.allclose(probs, torch.softmax(logits / 0.5, dim=-1), atol=1e-7)


def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 4.0]])
    row = srow(temperature=1.0, repetition_penalty=2.0,
                      prompt_token_ids=[0, 1], output_token_ids=[1, 4])
    out = apply_penalties(logits, [row])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 2.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 4.0]]  # input untouched


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 4.0]])
    row = srow(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25,
                      prompt_token_ids=[3, 3, 3], output_token_ids=[0, 0, 0, 2])
    out = apply_penalties(logits, [row])
    # token 0: 2 - 0.5*3 - 0.25 = 0.25; token 2: 1 - 0.5 - 0.25 = 0.25; prompt tokens ignored.
    assert out.tolist() == [[0.25, -2.0, 0.25, -1.0, 4.0]]


def test_penalties_per_row():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    rows = [srow(temperature=0.0),
            srow(temperature=0.0, presence_penalty=1.0, output_token_ids=[2]),
            srow(temperature=0.0, repetition_penalty=4.0, prompt_token_ids=[1])]
    out = apply_penalties(logits, rows)
    assert out.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.25, 1.0]]


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    row = srow(temperature=0.0, frequency_penalty=2.0, output_token_ids=[0])
    assert Sampler()(logits, [row]).token_ids == [1]


def _seeded_row(seed: int, step: int) -> SamplingRow:
    return srow(temperature=1.0, top_p=0.95, seed=seed, num_output_tokens_so_far=step)


def test_seeded_draw_independent_of_batch():
    logits = random_logits(6, seed=3)
    target = logits[0:1]
    sampler = Sampler()
    alone = [sampler(target, [_seeded_row(1234, step)]).token_ids[0] for step in range(20)]
    for position in (0, 3, 5):
        batch = logits.clone()
        batch[position] = target[0]
        for step in range(20):
            rows = [srow(temperature=0.7, top_k=5) for _ in range(6)]
            rows[1] = srow(temperature=0.0)
            rows[2] = _seeded_row(99, step)
            rows[4] = srow(temperature=1.3, min_p=0.1, presence_penalty=0.5,
                                  output_token_ids=[1, 2])
            rows[position] = _seeded_row(1234, step)
            assert sampler(batch, rows).token_ids[position] == alone[step]
    # A fresh sampler gives the same tokens too.
    assert [Sampler(seed=7)(target, [_seeded_row(1234, s)]).token_ids[0]
            for s in range(20)] == alone


def test_seeded_top_k_top_p_independent_of_batch_width():
    # Alone, the row is filtered with topk(10); batched, with topk(20) or a full sort.
    logits = random_logits(3, seed=5, vocab=64)

    def row(step: int) -> SamplingRow:
        return srow(temperature=0.9, top_k=10, top_p=0.8, seed=42,
                           num_output_tokens_so_far=step)

    sampler = Sampler()
    alone = [sampler(logits[:1], [row(step)]).token_ids[0] for step in range(30)]
    assert len(set(alone)) > 1
    for other in (srow(temperature=1.0, top_k=20), srow(temperature=1.0)):
        batch = torch.stack([logits[1], logits[0], logits[2]])
        batched = [sampler(batch, [other, row(step), other]).token_ids[1] for step in range(30)]
        assert batched == alone


def test_different_seeds_differ_on_flat_distribution():
    logits = torch.zeros((1, 1000))
    sampler = Sampler()
    draws = [sampler(logits, [srow(temperature=1.0, seed=seed)]).token_ids[0]
             for seed in range(10)]
    assert len(set(draws)) >= 8
    steps = [sampler(logits, [srow(temperature=1.0, seed=5, num_output_tokens_so_far=s)])
             .token_ids[0] for s in range(10)]
    assert len(set(steps)) >= 8


def test_sampled_frequencies_follow_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    num = 20000
    logits = torch.log(probs).expand(num, 5).contiguous()
    tokens = Sampler(seed=0)(logits, [srow(temperature=1.0)] * num).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    expected = probs * num
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30.0  # 4 degrees of freedom: p ~ 5e-6 at 30


def test_seeded_frequencies_follow_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    sampler = Sampler()
    tokens = [sampler(logits, [srow(temperature=1.0, seed=s)]).token_ids[0]
              for s in range(1500)]
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float()
    expected = probs * 1500
    assert (((counts - expected) ** 2) / expected).sum().item() < 25.0


def test_logprobs_equal_log_softmax_of_raw_logits():
    logits = random_logits(3, seed=4)
    rows = [srow(temperature=0.0, logprobs=3, frequency_penalty=2.0,
                        output_token_ids=[int(logits[0].argmax())]),
            srow(temperature=0.0),
            srow(temperature=0.8, logprobs=0)]
    out = Sampler(seed=0)(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert isinstance(first, TokenLogprob)
    assert first.token_id == out.token_ids[0]
    # The penalty changed the choice, not the reported logprobs.
    assert out.token_ids[0] != int(logits[0].argmax())
    assert math.isclose(first.logprob, expected[0, out.token_ids[0]].item(), abs_tol=1e-6)
    top_values, top_ids = expected[0].topk(3)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third.top == [] and third.token_id == out.token_ids[2]
    assert math.isclose(third.logprob, expected[2, out.token_ids[2]].item(), abs_tol=1e-6)


def test_sampling_stays_inside_top_k():
    logits = random_logits(1, seed=6).expand(500, VOCAB).contiguous()
    tokens = Sampler(seed=1)(logits, [srow(temperature=2.0, top_k=3)] * 500).token_ids
    assert set(tokens) == set(logits[0].topk(3).indices.tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_plus_100_forces_a_token_and_minus_100_removes_one(temperature):
    logits = random_logits(6, seed=7)
    best = logits.argmax(dim=-1).tolist()
    worst = logits.argmin(dim=-1).tolist()
    sampler = Sampler(seed=3)
    forced = sampler(logits, [srow(temperature=temperature, logit_bias={w: 100.0})
                              for w in worst])
    assert forced.token_ids == worst
    # every row but the untouched last one loses its best token
    rows = [srow(temperature=temperature, logit_bias={b: -100.0}) for b in best[:-1]]
    rows.append(srow(temperature=0.0))
    for _ in range(20 if temperature else 1):
        removed = sampler(logits, rows).token_ids
        assert all(t != b for t, b in zip(removed[:-1], best[:-1]))
        assert removed[-1] == best[-1]
    if not temperature:
        second = logits.topk(2, dim=-1).indices[:, 1].tolist()
        assert removed[:-1] == second[:-1]


def test_logit_bias_comes_before_penalties_and_leaves_logprobs_raw():
    logits = torch.zeros((1, VOCAB))
    logits[0, 4] = 2.0
    # +1 on token 5 (0 -> 1), then repetition penalty 2 on it (1 -> 0.5): token 4 stays best
    row = srow(temperature=0.0, logit_bias={5: 1.0}, repetition_penalty=2.0,
                      prompt_token_ids=[5], logprobs=1)
    out = Sampler()(logits, [row])
    assert out.token_ids == [4]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0].logprob == pytest.approx(raw[4].item(), abs=1e-6)
    row = srow(temperature=0.0, logit_bias={5: 3.0}, logprobs=1)
    out = Sampler()(logits, [row])
    assert out.token_ids == [5]
    assert out.logprobs[0].logprob == pytest.approx(raw[5].item(), abs=1e-6)


def test_logit_bias_outside_the_vocabulary_raises():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(random_logits(1), [srow(temperature=0.0, logit_bias={VOCAB: 1.0})])


def test_prompt_logprobs_are_log_softmax_with_top_k(monkeypatch):
    from xllm_py.engine import sampler as sampler_module

    logits = random_logits(5, seed=11)
    targets = [3, 0, 31, 7, 7]
    expected = torch.log_softmax(logits, dim=-1)
    for k in (0, 3):
        got = sampler_module.prompt_logprobs(logits, targets, k)
        assert [e.token_id for e in got] == targets
        for row, entry in enumerate(got):
            assert entry.logprob == pytest.approx(expected[row, targets[row]].item(), abs=1e-6)
            values, ids = expected[row].topk(k)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    # more rows than one pass takes: the same result
    whole = sampler_module.prompt_logprobs(logits, targets, 3)
    monkeypatch.setattr(sampler_module, "_PROMPT_ROWS_PER_PASS", 2)
    assert sampler_module.prompt_logprobs(logits, targets, 3) == whole
