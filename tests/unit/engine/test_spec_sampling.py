"""The verify step's sampling (verify.py) without a model: speculative sampling emits
tokens distributed as the model's (a chi-square test against p, first and second
position, on a fixed seed); each guess row is sampled as the one-token step at its
position samples it: a seeded request's draws, and under greedy the tokens and logprobs
with logit bias, penalties (the history with the guesses before each row) and bad words."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from xllm_py.engine.grammars import EngineGrammars
from xllm_py.engine.model_runner import StepLogits
from xllm_py.engine.sampler import Sampler, request_row
from xllm_py.engine.spec_decode.verify import accept_greedy, guess_rows, sample_step
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


def sampled_targets(sampler: Sampler, req: Request, rows: torch.Tensor) -> list[int]:
    """The draws at guess rows `rows` (what they draw does not depend on the guesses)."""
    return sampler(rows, guess_rows(request_row(req), [0] * rows.shape[0])).token_ids


def _verify(req: Request, logits: torch.Tensor, drafts: list[int], sampler: Sampler):
    """sample_step of one speculating seq: `logits` its row at the last token, then its
    guesses' rows."""
    seq = type("Seq", (), {"request_id": req.request_id, "sample": True,
                           "spec_token_ids": drafts})()
    step = StepLogits(logits[:1], spec=[(0, logits[1:])], sample_and_spec=logits)
    return sample_step([seq], step, {req.request_id: req}, sampler,
                       EngineGrammars(None, logits.shape[1], []), request_row)


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
    # guesses for positions 0 and 1 equal to the plain draws: both kept, then position 2
    logits = torch.stack([LOGITS[0], LOGITS[1], LOGITS[0]])
    picked = _verify(req, logits, plain[:2], sampler)
    assert picked.sampled == {"r": plain[0]} and picked.accepted == {"r": plain[1:3]}
    greedy = _request(temperature=0.0)  # the argmax of each row: 0, 1, then 0
    assert _verify(greedy, logits, [0, 1], sampler).accepted == {"r": [1, 0]}
    assert _verify(greedy, logits, [0, 5], sampler).accepted == {"r": [1]}
    assert _verify(greedy, logits, [2, 1], sampler).accepted == {"r": []}


@pytest.mark.parametrize("params", [
    dict(logprobs=3),
    dict(logprobs=0, logit_bias={4: 3.0, 0: -1.0}),
    dict(logprobs=2, frequency_penalty=0.6, presence_penalty=0.4),
    dict(repetition_penalty=1.8, logprobs=1),
    dict(bad_words=[[0, 3]], logprobs=1),
    dict(temperature=0.9, seed=5, frequency_penalty=0.5, logprobs=2),
])
def test_guess_rows_pick_what_one_token_steps_pick(params):
    """Five one-token steps over fixed logits rows, then the same five positions as one
    verify step guessing the tokens they picked: the same tokens, all guesses kept, the
    same logprobs (equal floats); a wrong guess cuts there, its row's token and logprob
    still the one-token step's."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 6, generator=g) * 2
    params = {"temperature": 0.0, **params}
    if "bad_words" in params:
        params["bad_words_token_ids"] = params.pop("bad_words")
    plain_req = Request("r", [1, 3, 3, 4], SamplingParams(max_tokens=16, **params))
    sampler = Sampler(seed=0)
    plain, plain_lps = [], []
    for t in range(5):
        out = sampler(logits[t:t + 1], [request_row(plain_req)])
        plain.append(out.token_ids[0])
        plain_lps.append(out.logprobs[0])
        plain_req.append_output_token(out.token_ids[0])
    req = Request("r", [1, 3, 3, 4], SamplingParams(max_tokens=16, **params))
    picked = _verify(req, logits, plain[:4], sampler)
    assert [picked.sampled["r"], *picked.accepted["r"]] == plain
    assert picked.logprobs["r"] == plain_lps
    wrong = (plain[2] + 1) % 6
    picked = _verify(req, logits, [*plain[:2], wrong, plain[3]], sampler)
    assert picked.accepted["r"] == plain[1:3]
    assert picked.logprobs["r"] == plain_lps[:3]


def test_guess_rows_carry_the_history_with_the_guesses_before_them():
    req = Request("r", [1, 2], SamplingParams(frequency_penalty=1.0))
    req.append_output_token(7)
    rows = guess_rows(request_row(req), [8, 9])
    assert [list(r.output_token_ids) for r in rows] == [[7, 8], [7, 8, 9]]
    assert [r.num_output_tokens_so_far for r in rows] == [2, 3]
    assert list(request_row(req).output_token_ids) == [7]  # (the request's own row as it was)
    plain = guess_rows(request_row(_request()), [8, 9])
    assert [tuple(r.output_token_ids) for r in plain] == [(), ()]
