"""EleutherAI's lm-evaluation-harness (`local-completions`, tokenized requests) against a
cluster (service + MIX engine on a tiny random Llama checkpoint), with local tasks written
here (JSON datasets, no download): a 10-item multiple-choice task whose per-choice
loglikelihoods (from the harness's logged samples) must equal transformers' (log_softmax of
the float32 logits) within 1e-4, and a generate_until task that must complete.

Also, without the harness: the exact request shape it sends for a loglikelihood
(`{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0}`),
checked against transformers, so that the contract is tested where lm-eval is missing."""
from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from tests.integration.cluster_harness import Harness
from tests.integration.test_prompt_logprobs import TOL, _hf_logprobs, _prompt, build_checkpoint

pytestmark = pytest.mark.integration

QUESTIONS = [
    ("The sky is", [" blue", " green", " loud"], 0),
    ("Two plus two is", [" four", " five", " seven"], 0),
    ("Water is", [" wet", " dry", " square"], 0),
    ("The sun rises in the", [" east", " west", " north"], 0),
    ("Cats like to", [" sleep", " swim", " fly"], 0),
    ("A week has seven", [" days", " hours", " cats"], 0),
    ("Ice is", [" cold", " hot", " purple"], 0),
    ("Birds can", [" fly", " read", " cook"], 0),
    ("Fire is", [" hot", " cold", " quiet"], 0),
    ("The opposite of up is", [" down", " left", " blue"], 0),
]


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    """(hf model, checkpoint dir, service url, served model name)."""
    ckpt = tmp_path_factory.mktemp("ckpt-lm-eval")
    hf = build_checkpoint("llama", ckpt)
    h = Harness(etcd_server.endpoint, "lm-eval/", tmp_path_factory.mktemp("logs-lm-eval"))
    try:
        svc = h.service(extra=["--model", str(ckpt)])
        engine = h.engine("MIX", "mix-lm-eval", extra=["--model", str(ckpt), "--dtype", "float32"])
        engine.wait_ready(240)
        svc.wait_ready(60, path="/readiness")
        model = httpx.get(svc.http_url + "/v1/models", timeout=10, trust_env=False).json()
        yield hf, str(ckpt), svc.http_url, model["data"][0]["id"]
    finally:
        h.stop()


def test_the_harness_request_shape_scores_the_prompt_like_transformers(cluster):
    hf, _, url, model = cluster
    prompt = _prompt(12, seed=21)
    resp = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": [prompt], "max_tokens": 1, "logprobs": 1, "echo": True,
        "temperature": 0, "seed": 1234}, timeout=60, trust_env=False)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    ref = _hf_logprobs(hf, prompt)
    assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt, then one generated
    assert lp["token_logprobs"][0] is None
    for j in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, prompt[j]].item()) < TOL, j
        assert abs(max(lp["top_logprobs"][j].values()) - ref[j - 1].max().item()) < TOL, j
    # the generated token is the greedy one, with its logprob
    assert abs(lp["token_logprobs"][-1] - ref[-1].max().item()) < TOL


def _write_tasks(root) -> None:
    with open(root / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for question, choices, _ in QUESTIONS[:4]:
            f.write(json.dumps({"question": question, "answer": choices[0]}) + "\n")
    (root / "xllm_mc.yaml").write_text(textwrap.dedent(f"""\
        task: xllm_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """))
    (root / "xllm_gen.yaml").write_text(textwrap.dedent(f"""\
        task: xllm_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: answer
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 8
          do_sample: false
        metric_list:
          - metric: exact_match
        """))


def test_lm_eval_harness_loglikelihoods_equal_transformers(cluster, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")  # installed through the test extras
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    hf, ckpt, url, model = cluster
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data is local: never download
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path)
    lm = LocalCompletionsAPI(
        base_url=url + "/v1/completions", model=model, tokenizer=ckpt,
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
        max_retries=1, max_length=256, max_gen_toks=8, timeout=120)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["xllm_mc", "xllm_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        bootstrap_iters=0)

    mc = results["samples"]["xllm_mc"]
    assert len(mc) == len(QUESTIONS)
    checked = 0
    for sample in mc:
        assert len(sample["resps"]) == 3  # one loglikelihood request per choice
        for (context, continuation), resp in zip(
                sample["arguments"], sample["resps"]):
            got, _is_greedy = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)
            ids = ctx + cont
            ref = _hf_logprobs(hf, ids)
            want = sum(ref[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))
            assert abs(float(got) - want) < TOL, (context, continuation)
            checked += 1
    assert checked == 3 * len(QUESTIONS)
    assert "acc,none" in results["results"]["xllm_mc"]

    gen = results["samples"]["xllm_gen"]
    assert len(gen) == 4
    assert all(isinstance(s["resps"][0][0], str) for s in gen)
    assert "exact_match,none" in results["results"]["xllm_gen"]

