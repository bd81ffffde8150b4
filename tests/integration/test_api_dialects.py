"""The API dialects beyond chat completions end to end: OpenAI's Responses API and
Anthropic's Messages API through the official openai and anthropic SDKs, and vLLM's
request extras, on a MIX engine (responses stored in its memory) and on a PD pair behind
the service (responses stored in etcd, the extras carried to the decode): greedy
equalities with the chat path, a conversation continued through previous_response_id,
text.format under a schema, tool calls and their results fed back, and bad requests
answered in each API's error shape without reaching an engine."""
from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.integration.cluster_harness import (Harness, client, metric, standalone_mix,
                                               wait_drained)
from xllm_py.api.response_store import ResponseStoreLimits
from xllm_py.cluster.etcd_client import EtcdClient
from xllm_py.utils.config_file import write_settings
from xllm_service.response_store import EtcdResponseStore

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "unit": {"enum": ["C", "F"]}}}
SHIRT = {"type": "object", "additionalProperties": False, "required": ["color", "size"],
         "properties": {"color": {"enum": ["red", "green"]}, "size": {"enum": ["S", "M"]}}}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "weather in a city",
             "parameters": WEATHER}
ANTH_TOOL = {"name": "get_weather", "description": "weather in a city", "input_schema": WEATHER}


@pytest.fixture(scope="module", params=["MIX", "PD"])
def target(request, etcd_server, tmp_path_factory):
    """(the process the client talks to, [every engine's URL])."""
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    common = ["--block-size", "8", "--num-blocks", "512"]
    trust = write_settings(logs / "engine.yaml",  # (the chat_template test)
                           {"trust_request_chat_template": True})
    if request.param == "MIX":
        proc = standalone_mix(logs, [*common, *trust])
        try:
            proc.wait_ready(180)
            yield proc, [proc.http_url]
        finally:
            proc.terminate()
        return
    h = Harness(etcd_server.endpoint, "resp-msg/", logs)
    try:
        svc, prefill, decode = h.pd_tp_cluster(
            common, 1, 1, service_settings={"trust_request_chat_template": True})
        yield svc, [prefill.http_url, decode.http_url]
    finally:
        h.stop()


def aclient_of(proc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proc.http_url, api_key="x", max_retries=0, timeout=60)


def test_a_response_streamed_and_not_equals_the_chat_completion(target):
    proc, _ = target
    c = client(proc)
    kwargs = dict(model="tiny", instructions="Answer briefly.", max_output_tokens=24,
                  temperature=0)
    full = c.responses.create(input="Name a color.", **kwargs)
    events = list(c.responses.create(input="Name a color.", stream=True, **kwargs))
    chat = c.chat.completions.create(model="tiny", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a color."}])
    text = chat.choices[0].message.content
    assert full.output_text == text and text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
    assert full.usage.output_tokens == chat.usage.completion_tokens
    assert full.usage.input_tokens == chat.usage.prompt_tokens
    assert c.responses.retrieve(full.id).output_text == text


def test_previous_response_id_over_three_turns_equals_the_history_sent_whole(target):
    proc, _ = target
    c = client(proc)
    kwargs = dict(model="tiny", max_output_tokens=12, temperature=0)
    turns = ["Hello there.", "Tell me more.", "And then?"]
    prev, history = None, []
    for turn in turns:
        r = c.responses.create(input=turn, previous_response_id=prev, **kwargs)
        history += [{"role": "user", "content": turn}]
        last = r
        prev = r.id
        history += [item.model_dump(exclude_none=True) for item in r.output]
    whole = c.responses.create(input=history[:-len(last.output)], **kwargs)
    assert whole.output_text == last.output_text
    assert whole.usage.input_tokens == last.usage.input_tokens
    # a deleted response cannot be continued
    c.responses.delete(prev)
    with pytest.raises(openai.NotFoundError, match=prev):
        c.responses.create(input="x", previous_response_id=prev, **kwargs)


def test_text_format_json_schema_follows_the_schema(target):
    proc, _ = target
    c = client(proc)
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "extra_body": {"seed": 4}}):
        r = c.responses.create(model="tiny", input="A shirt as JSON.", max_output_tokens=80,
                               text={"format": {"type": "json_schema", "name": "shirt",
                                                "schema": SHIRT, "strict": True}}, **kwargs)
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), SHIRT)


def test_a_function_call_and_its_result_fed_back(target):
    proc, _ = target
    c = client(proc)
    # (one call: a random-weight model under "required" adds calls to the list for long)
    kwargs = dict(model="tiny", tools=[RESP_TOOL], max_output_tokens=60, temperature=0,
                  parallel_tool_calls=False)
    r = c.responses.create(input="Weather in Paris?", tool_choice="required", **kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(c.responses.create(input="Weather in Paris?", tool_choice="required",
                                     stream=True, **kwargs))
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.name, d.arguments) for d in done] == [("get_weather", calls[0].arguments)]
    answer = c.responses.create(previous_response_id=r.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C, sunny"}],
        **kwargs)
    assert answer.output[0].type == "message" and answer.output_text
    # the same turn with the call sent as an item, not through the stored response
    whole = c.responses.create(tool_choice="none", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C, sunny"}],
        **kwargs)
    assert whole.output_text == answer.output_text


def test_anthropic_create_stream_and_a_tool_use_round_trip(target):
    proc, _ = target
    a = aclient_of(proc)
    # (this SDK has no sampling parameters of its own: the server takes them in the body)
    greedy = {"extra_body": {"temperature": 0}}
    kwargs = dict(model="tiny", max_tokens=20, system="Answer briefly.", **greedy)
    user = [{"role": "user", "content": "Name a color."}]
    m = a.messages.create(messages=user, **kwargs)
    with a.messages.stream(messages=user, **kwargs) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    chat = client(proc).chat.completions.create(
        model="tiny", max_tokens=20, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, *user])
    assert m.content[0].text == streamed == final.content[0].text == \
        chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason in ("end_turn", "max_tokens")

    ask = [{"role": "user", "content": "Weather in Paris?"}]
    call = a.messages.create(model="tiny", max_tokens=60, **greedy, tools=[ANTH_TOOL],
                             tool_choice={"type": "any", "disable_parallel_tool_use": True},
                             messages=ask)
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    with a.messages.stream(model="tiny", max_tokens=60, **greedy, tools=[ANTH_TOOL],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                             messages=ask) as s:
        streamed_call = s.get_final_message()
    assert [b.input for b in streamed_call.content if b.type == "tool_use"] == [uses[0].input]
    answer = a.messages.create(model="tiny", max_tokens=20, **greedy, tools=[ANTH_TOOL],
                               messages=[*ask, {"role": "assistant", "content": call.content},
                                         {"role": "user", "content": [
                                             {"type": "tool_result", "tool_use_id": uses[0].id,
                                              "content": "22 C, sunny"}]}])
    assert answer.content and answer.content[0].type == "text"


def test_bad_requests_in_each_apis_shape_allocate_nothing(target):
    proc, urls = target
    before = [metric(u, "xllm_generation_tokens_total") for u in urls]
    c, a = client(proc), aclient_of(proc)
    bad_responses = [dict(input="x", max_output_tokens=0),
                     dict(input=[{"type": "input_image", "image_url": "http://x"}]),
                     dict(input="x", text={"format": {"type": "json_schema", "name": "n",
                                                      "schema": {"type": "objectx"}}})]
    for kwargs in bad_responses:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="tiny", **kwargs)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"]
    with pytest.raises(openai.NotFoundError, match="resp_missing"):
        c.responses.create(model="tiny", input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.NotFoundError, match="resp_missing"):
        c.responses.retrieve("resp_missing")
    bad_messages = [dict(max_tokens=0, messages=[{"role": "user", "content": "x"}]),
                    dict(max_tokens=5, messages=[{"role": "user", "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
                    dict(max_tokens=5, messages=[{"role": "user", "content": "x"}],
                         tools=[ANTH_TOOL], tool_choice={"type": "tool", "name": "nope"})]
    for kwargs in bad_messages:
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="tiny", **kwargs)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(proc.http_url + "/v1/messages", json={"model": "tiny", "max_tokens": 5,
                   "messages": "nope"}, timeout=10, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert [metric(u, "xllm_generation_tokens_total") for u in urls] == before
    asyncio.run(wait_drained(urls))


def test_vllm_extras_hold_on_every_token(target):
    """allowed_token_ids and bad_words bound every greedy token (on PD the prefill's first
    and the decode's rest); truncate_prompt_tokens keeps the prompt's tail; a chat_template
    of the request's own renders the prompt the completions endpoint is given."""
    proc, _ = target
    c = client(proc)
    base = dict(model="tiny", prompt="The story so far:", max_tokens=12, temperature=0)
    free = c.completions.create(extra_body={"return_token_ids": True}, **base)
    free_ids = free.choices[0].model_extra["token_ids"]
    allowed = sorted(set(free_ids[1:4]) | {11, 12, 13})
    bound = c.completions.create(extra_body={"return_token_ids": True,
                                             "allowed_token_ids": allowed}, **base)
    ids = bound.choices[0].model_extra["token_ids"]
    assert ids and set(ids) <= set(allowed)
    word = free.choices[0].text.strip().split()[0]
    banned = c.completions.create(extra_body={"bad_words": [word], "return_token_ids": True},
                                  **base)
    out = banned.choices[0].model_extra["token_ids"]
    for seq in (_token_ids(proc, word), _token_ids(proc, " " + word)):
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out))), (word, out)
    assert out != free_ids
    cut = c.completions.create(extra_body={"truncate_prompt_tokens": 3}, **base)
    tail = c.completions.create(**{**base, "prompt": _token_ids(proc, base["prompt"], True)[-3:]})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == tail.choices[0].text
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{{ suffix }}"
    chat = c.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template": template, "chat_template_kwargs": {"suffix": " ok"}})
    same = c.completions.create(model="tiny", max_tokens=8, temperature=0,
                                prompt=_token_ids(proc, "<<hi>> ok"))
    assert chat.choices[0].message.content == same.choices[0].text


@pytest.mark.parametrize("n, length_penalty", [(2, 1.0), (4, 0.5)])
def test_beam_search_best_beam_equals_transformers(target, n, length_penalty):
    """use_beam_search on /v1/completions: the best beam equals transformers'
    generate(num_beams=n, do_sample=False) on the same checkpoint, on MIX and through PD."""
    transformers = pytest.importorskip("transformers")
    import torch

    proc, urls = target
    hf = _hf_tiny(transformers, torch)
    c = client(proc)
    for text in ("The story so far:", "Once upon a time"):
        ids = _token_ids(proc, text, True)
        resp = c.completions.create(model="tiny", prompt=ids, max_tokens=10, n=n, extra_body={
            "use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True})
        out = hf.generate(torch.tensor([ids]), num_beams=n, do_sample=False, max_new_tokens=10,
                          length_penalty=length_penalty)[0].tolist()[len(ids):]
        eos = hf.generation_config.eos_token_id
        end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        assert resp.choices[0].model_extra["token_ids"] == out[:end]
        assert len(resp.choices) == n
    asyncio.run(wait_drained(urls))


_HF: dict = {}


def _hf_tiny(transformers, torch):
    if "tiny" not in _HF:
        from xllm_py.model.tiny import ensure_tiny_model
        _HF["tiny"] = transformers.AutoModelForCausalLM.from_pretrained(
            str(ensure_tiny_model("tiny")), dtype=torch.float32).eval()
    return _HF["tiny"]


def _token_ids(proc, text, add_special_tokens=False):
    r = httpx.post(proc.http_url + "/tokenize", json={
        "model": "tiny", "prompt": text, "add_special_tokens": add_special_tokens},
        timeout=10, trust_env=False)
    return r.json()["tokens"]


async def test_the_etcd_store_is_shared_bounded_and_expires(etcd_server, etcd_namespace):
    """Two replicas' stores on one etcd: what one writes the other reads; the oldest go
    beyond max_responses; a record expires with its lease; a delete is seen by both."""
    async with EtcdClient(etcd_server.endpoint, namespace=etcd_namespace) as e1, \
            EtcdClient(etcd_server.endpoint, namespace=etcd_namespace) as e2:
        limits = ResponseStoreLimits(max_responses=2, max_bytes=400, ttl_s=1.0)
        one, two = EtcdResponseStore(e1, limits), EtcdResponseStore(e2, limits)
        assert await one.put("resp_a", {"n": 1}) and await one.put("resp_b", {"n": 2})
        assert await two.get("resp_a") == {"n": 1}
        assert await two.put("resp_c", {"n": 3})
        assert await one.get("resp_a") is None and await one.get("resp_c") == {"n": 3}
        assert not await one.put("resp_big", {"x": "y" * 500})
        assert await two.delete("resp_b") and await one.get("resp_b") is None
        assert not await one.delete("resp_b")
        t0 = time.monotonic()  # (etcd expires a lease within about a second of its TTL)
        while await two.get("resp_c") is not None:
            assert time.monotonic() - t0 < 10.0, "the record outlived its lease"
            await asyncio.sleep(0.2)
