"""Beam search (xllm_py/api/beam_search.py) against Hugging Face transformers'
generate(num_beams=W, do_sample=False) on a small random model whose steps the test
computes itself (a vocabulary of 24 with two EOS tokens, so beams do end early): the
finished beams, best first, are transformers' own, for several widths, prompts and length
penalties; and the HTTP layer's refusals of what beam search does not combine with."""
import asyncio

import httpx
import pytest
import torch

from xllm_py.api.beam_search import beam_search

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf():
    """(the model, its two EOS ids: tokens it often picks, so that beams end early)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper distributions than the random init's near-uniform ones
        model.lm_head.weight.mul_(8.0)
        picks = model(torch.tensor([_prompt(seed) for seed in range(4)])).logits.argmax(-1)
    counts = torch.bincount(picks.flatten(), minlength=24)
    counts[:1] = 0  # (not the pad)
    return model, counts.topk(2).indices.tolist()


def _prompt(seed):
    return torch.randint(6, 24, (5,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step(hf, prompt):
    async def step(tokens, k):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
        top = torch.log_softmax(logits, -1).topk(k)
        return list(zip(top.indices.tolist(), top.values.tolist()))
    return step


@pytest.mark.parametrize("width, length_penalty", [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5),
                                                   (3, 2.0), (2, 0.0)])
def test_the_finished_beams_are_transformers_own(hf, width, length_penalty):
    hf, eos = hf
    ended_early = 0
    for seed in range(4):
        prompt = _prompt(seed)
        ours = asyncio.run(beam_search(_step(hf, prompt), width, 12, eos, length_penalty))
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=12, length_penalty=length_penalty,
                          eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
        theirs = []
        for seq in out.sequences.tolist():
            gen = seq[len(prompt):]
            end = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
            theirs.append(gen[:end])
        assert [b.tokens for b in ours] == theirs, (seed, prompt)
        if width > 1:  # (one beam: transformers runs greedy search, with no scores)
            assert [round(b.score, 4) for b in ours] == [
                round(s, 4) for s in out.sequences_scores.tolist()]
        ended_early += sum(b.ended_by_eos for b in ours)
    assert ended_early  # (the cases cover beams that end with an EOS)


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"), ({"n": 30}, "n"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"length_penalty": 1e300}, "length_penalty"),
])
def test_what_beam_search_does_not_combine_with_is_a_400(server, backend, body, param):
    r = httpx.post(server[1].base_url + "/v1/completions", json={
        "prompt": "ab", "max_tokens": 3, "use_beam_search": True, "n": 2, **body},
        timeout=10, trust_env=False)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.requests == []


def test_beam_search_over_the_scripted_backend(server, backend):
    r = httpx.post(server[1].base_url + "/v1/completions", json={
        "prompt": "ab", "max_tokens": 3, "use_beam_search": True, "n": 2},
        timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] == "length" for c in choices)
    assert all(len(req.prompt_token_ids) >= 3 for req in backend.requests)  # one per beam step
    assert all(req.sampling.max_tokens == 1 and req.sampling.logprobs for req in backend.requests)
