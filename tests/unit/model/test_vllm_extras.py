"""vLLM's request extras: allowed_token_ids and bad_words in the sampler (greedy and
sampled, logprobs of the raw logits), and over the scripted backend: bad_words tokenized
into SamplingParams, truncate_prompt_tokens, chat_template / chat_template_kwargs (with
the tiny model's real tokenizer), and their 400s."""

import httpx
import pytest
import torch

from tests.unit.sampling_rows import srow
from xllm_py.api.serving_chat import render_chat
from xllm_py.engine.sampler import Sampler
from xllm_py.model.tiny import ensure_tiny_model
from xllm_py.model.tokenizer import Tokenizer

VOCAB = 32


def _logits(rows, seed=0):
    return torch.randn((rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3.0


def test_allowed_token_ids_bound_greedy_and_sampled_picks():
    logits = _logits(6)
    allowed = [3, 17, 30]
    rows = [srow(temperature=0.0, allowed_token_ids=allowed, logprobs=1),
            *[srow(temperature=1.0, seed=i, allowed_token_ids=allowed) for i in range(5)]]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert all(t in allowed for t in out.token_ids)
    # logprobs are those of the raw logits
    assert out.logprobs[0].logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[out.token_ids[0]].item(), abs=1e-5)


def test_bad_words_ban_the_last_token_only_after_the_rest():
    logits = torch.zeros((3, VOCAB))
    logits[:, 7] = 5.0  # the greedy pick
    logits[:, 8] = 4.0
    rows = [srow(temperature=0.0, bad_words_token_ids=[[7]]),
            srow(temperature=0.0, bad_words_token_ids=[[2, 7]], output_token_ids=[1, 2]),
            srow(temperature=0.0, bad_words_token_ids=[[2, 7]], output_token_ids=[2, 1])]
    assert Sampler()(logits, rows).token_ids == [8, 8, 7]


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1].base_url, timeout=10, trust_env=False) as c:
        yield c


def test_bad_words_and_truncation_reach_the_request(http, backend):
    r = http.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 2,
                                           "bad_words": ["xy"], "truncate_prompt_tokens": 3,
                                           "allowed_token_ids": [97, 98]})
    assert r.status_code == 200, r.text
    req = backend.requests[0]
    assert req.prompt_token_ids == [ord(c) for c in "fgh"]
    assert req.sampling.bad_words_token_ids == [[120, 121], [32, 120, 121]]
    assert req.sampling.allowed_token_ids == [97, 98]
    assert r.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("body, param", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),  # (not trusted)
])
def test_bad_extras_are_a_400(http, backend, body, param):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.requests == []


def test_chat_template_and_its_kwargs_render_with_the_real_tokenizer():
    tok = Tokenizer.from_dir(ensure_tiny_model("tiny", with_weights=False))
    template = ("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                "{% if greeting %}{{ greeting }}{% endif %}")
    ids = render_chat(tok, [{"role": "user", "content": "hi"}], chat_template=template,
                      template_kwargs={"greeting": "HELLO"})
    assert tok.decode(ids) == "[user:hi]HELLO"
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) != ids
