"""Speculative sampling of sampled rows (verify.py) without a model: the tokens it emits
are distributed as the model's (a chi-square test against p, first and second
position, on a fixed seed), and a seeded request draws at each output position what a
one-token step draws there."""
from __future__ import annotations

import dataclasses

import torch

from xllm_py.engine.sampler import Sampler, request_row
from xllm_py.engine.spec_decode.verify import accept_greedy, sampled_targets, verify
from xllm_py.request import Request
from xllm_py.sampling_params import SamplingParams

# Chi-square critical value at p = 0.001 for 5 degrees of freedom (6 tokens).
CHI2_DF5_P001 = 20.52
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5],   # at the last known token
                       [0.0, 2.5, 1.0, 0.2, 0.3, -1.0]])  # at the guess
DRAFTS = [5, 1]  # 5 is likely at position 0 (p ~ 0.3), 1 at position 1 (p ~ 0.6)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _request(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=16, **params))


def test_emitted_tokens_are_distributed_as_the_model():
    """Many independent trials: position 0 drawn by the sampler as the step does, the
    guess rows by sampled_targets; emitted tokens counted per position."""
    trials, temperature = 20000, 0.8
    sampler = Sampler(seed=1234)
    req = _request(temperature=temperature)
    rows = [request_row(req)] * trials
    first = sampler(LOGITS[:1].expand(trials, -1).contiguous(), rows).token_ids
    p = torch.softmax(LOGITS / temperature, dim=-1)
    first_counts, second_counts = torch.zeros(6), torch.zeros(6)
    accepted = 0
    for t in range(trials):
        emitted = accept_greedy([DRAFTS[0]], [first[t]] + sampled_targets(
            sampler, req, LOGITS[1:2]))
        first_counts[emitted[0]] += 1
        if len(emitted) == 2:  # the guess kept: the bonus token is position 1's
            accepted += 1
            second_counts[emitted[1]] += 1
    assert _chi2(first_counts, p[0]) < CHI2_DF5_P001
    assert _chi2(second_counts, p[1]) < CHI2_DF5_P001
    assert abs(accepted / trials - float(p[0, DRAFTS[0]])) < 0.02  # P(keep) = p(d)
    # a wrong rule fails the same test: always keeping the guess puts all mass on 5
    wrong = torch.zeros(6)
    wrong[DRAFTS[0]] = trials
    assert _chi2(wrong, p[0]) > CHI2_DF5_P001


def test_a_seeded_request_draws_what_one_token_steps_draw():
    """Each guess row j draws from (seed, output position n + 1 + j): with guesses equal
    to the plain draws, every one is kept and the tokens are the plain steps' tokens."""
    sampler = Sampler(seed=0)
    req = _request(temperature=1.0, seed=42)
    plain = []
    for step in range(3):  # one-token steps at output positions 0, 1, 2
        row = dataclasses.replace(request_row(req), num_output_tokens_so_far=step)
        plain.append(sampler(LOGITS[step % 2:step % 2 + 1], [row]).token_ids[0])
    rows = torch.stack([LOGITS[1], LOGITS[0]])  # the logits at positions 1 and 2
    assert sampled_targets(sampler, req, rows) == plain[1:]
    # guesses for positions 0 and 1 equal to the plain draws; rows at them (positions 1, 2)
    seq = type("Seq", (), {"request_id": "r", "spec_token_ids": plain[:2]})()
    kept = verify([seq], [(0, rows)], {"r": plain[0]}, sampler, {"r": req})
    assert kept == {"r": plain[1:]}
    greedy = _request(temperature=0.0)  # the argmax of each row: 1, then 0
    kept = verify([seq], [(0, rows)], {"r": plain[0]}, sampler, {"r": greedy})
    assert kept == {"r": [1, 0] if plain[1] == 1 else [1]}
