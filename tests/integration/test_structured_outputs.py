"""Structured outputs end to end through the official openai SDK: a MIX
engine, and a PD pair (service + PREFILL + DECODE, PULL and PUSH) where the prefill
samples the first token under the grammar and the decode resumes the same matcher.
Outputs are checked against their schema with jsonschema, greedy and sampled, n > 1."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.cluster_harness import (Harness, client,
                                               kill_mid_stream_and_check_migration, metric,
                                               standalone_mix, start_mix_cluster,
                                               wait_drained)

pytestmark = pytest.mark.integration

ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size", "ok"],
         "properties": {"color": {"enum": ["red", "green", "blue"]},
                        "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}}}
MESSAGES = [{"role": "user", "content": "Describe a shirt as JSON."}]


class Shirt(pydantic.BaseModel):
    color: str = pydantic.Field(pattern="^(red|green|blue)$")
    size: int = pydantic.Field(ge=1, le=60)
    in_stock: bool


@pytest.fixture(scope="module", params=["MIX", "PD-PULL", "PD-PUSH"])
def target(request, etcd_server, tmp_path_factory):
    """(the process the client talks to, [every engine's URL], kind)."""
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    common = ["--block-size", "8", "--num-blocks", "512"]
    if request.param == "MIX":
        proc = standalone_mix(logs, common)
        try:
            proc.wait_ready(180)
            yield proc, [proc.http_url], request.param
        finally:
            proc.terminate()
        return
    mode = request.param.split("-")[1]
    h = Harness(etcd_server.endpoint, f"so-{mode}/", logs)
    try:
        svc = h.service()
        extra = [*common, "--kv-cache-transfer-mode", mode]
        prefill = h.engine("PREFILL", "prefill", extra=extra)
        decode = h.engine("DECODE", "decode", extra=extra)
        for p in (prefill, decode):
            p.wait_ready(180)
        svc.wait_ready(60, path="/readiness")
        yield svc, [prefill.http_url, decode.http_url], request.param
    finally:
        h.stop()


def _json_schema_format(schema, name="enums"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_with_a_pydantic_model_greedy_and_sampled(target):
    proc, _, _ = target
    c = client(proc)
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 3}):
        resp = c.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Shirt,
                                        max_tokens=200, **kwargs)
        assert len(resp.choices) == kwargs.get("n", 1)
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, Shirt)
            jsonschema.validate(json.loads(choice.message.content), Shirt.model_json_schema())


def test_json_schema_of_enums_ends_within_a_few_dozen_tokens(target):
    proc, _, _ = target
    c = client(proc)
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 11, "n": 4}):
        resp = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=500,
                                         response_format=_json_schema_format(ENUMS), **kwargs)
        for choice in resp.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), ENUMS)
        assert resp.usage.completion_tokens <= 60 * len(resp.choices)


def test_json_object_mode_gives_a_json_object(target):
    """Any JSON object: a random-weight model may write a string without end, so an
    output cut by max_tokens only has to start as one."""
    proc, _, _ = target
    resp = client(proc).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=2, n=4,
        response_format={"type": "json_object"})
    for choice in resp.choices:
        text = choice.message.content
        assert text.lstrip().startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length"


def test_greedy_stream_equals_full_response_with_raw_logprobs(target):
    proc, _, _ = target
    c = client(proc)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
                  logprobs=True, top_logprobs=2, response_format=_json_schema_format(ENUMS))
    full = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(stream=True, **kwargs))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    jsonschema.validate(json.loads(text), ENUMS)
    entries = full.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 for e in entries)
    # raw logprobs: the grammar forces tokens the free model would not rank first
    assert any(e.top_logprobs[0].token != e.token for e in entries)


def test_completions_regex_choice_grammar_and_guided_json(target):
    proc, _, _ = target
    c = client(proc)
    cases = [({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,5}"}},
              lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,5}", t)),
             ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
             ({"structured_outputs": {"grammar": 'start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'}},
              lambda t: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", t)),
             ({"guided_json": ENUMS}, lambda t: jsonschema.validate(json.loads(t), ENUMS) or True)]
    for extra, ok in cases:
        for kwargs in ({"temperature": 0}, {"temperature": 0.9, "seed": 3, "n": 2}):
            resp = c.completions.create(model="tiny", prompt="The answer:", max_tokens=80,
                                        extra_body=extra, **kwargs)
            for choice in resp.choices:
                assert choice.finish_reason == "stop", (extra, choice.text)
                assert ok(choice.text), (extra, choice.text)


def test_invalid_constraints_are_a_400_and_allocate_nothing(target):
    proc, urls, _ = target
    c = client(proc)
    before = [metric(u, "xllm_generation_tokens_total") for u in urls]
    bad = [({"response_format": _json_schema_format({"type": "objectx"})}, "objectx"),
           ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "unclosed group"),
           ({"extra_body": {"guided_grammar": "start: nothing_here"}}, "nothing_here")]
    for kwargs, words in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kwargs)
        assert words in str(e.value)
    # refused by the HTTP layer: no engine saw them (no token, no block)
    assert [metric(u, "xllm_generation_tokens_total") for u in urls] == before
    asyncio.run(wait_drained(urls))


_MIX_GREEDY: dict[str, list] = {}  # filled by the MIX run, compared by the PD runs


def test_greedy_pd_equals_mix_token_for_token(target):
    """The prefill samples the first token under the grammar, the decode resumes the
    matcher after it: the greedy tokens are those of MIX."""
    proc, _, kind = target
    c = client(proc)
    outputs = []
    for extra in ({"guided_json": ENUMS}, {"structured_outputs": {"regex": "[a-z]{4,9} [0-9]{2}"}},
                  {"guided_choice": ["alpha beta", "gamma"]}):
        resp = c.completions.create(model="tiny", prompt="Answer:", max_tokens=80, temperature=0,
                                    extra_body={**extra, "return_token_ids": True})
        outputs.append(resp.choices[0].model_extra["token_ids"])
    if kind == "MIX":
        _MIX_GREEDY["outputs"] = outputs
    elif "outputs" not in _MIX_GREEDY:
        pytest.skip("the MIX run (the reference) did not run in this session")
    else:
        assert outputs == _MIX_GREEDY["outputs"]


# -- tools ---------------------------------------------------------------------------------

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                 "unit": {"enum": ["C", "F"]}}}
TIME_PARAMS = {"type": "object", "additionalProperties": False, "required": ["tz"],
               "properties": {"tz": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# tool_choice auto reads the model's own format (Hermes for the tiny Qwen-style model); a
# random-weight model never writes it, so this regex makes it (the parsing path is real)
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"unit": "(C|F)"\}\}\n</tool_call>')


def _check_calls(message, names=None, max_calls=None):
    assert message.tool_calls, message
    assert max_calls is None or len(message.tool_calls) <= max_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(chunks):
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for d in ch.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert entry["id"] is None
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_tool_choice_required_and_named_follow_the_schemas(target):
    proc, _, _ = target
    c = client(proc)
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}):
        resp = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=300, **kwargs)
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message, set(SCHEMAS))
        one = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_tokens=300, **kwargs)
        for choice in one.choices:
            _check_calls(choice.message, set(SCHEMAS), max_calls=1)
        named = c.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=300,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **kwargs)
        for choice in named.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check_calls(choice.message, {"get_time"}, max_calls=1)


def test_tool_choice_none_and_auto(target):
    proc, _, _ = target
    c = client(proc)
    plain = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                      tool_choice="none", max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}):
        resp = c.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=100,
            extra_body={"structured_outputs": {"regex": HERMES_CALL}}, **kwargs)
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            _check_calls(choice.message, {"get_weather"}, max_calls=1)


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_streamed_tool_calls_equal_the_full_response(target, mode):
    proc, _, _ = target
    c = client(proc)
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=0)
    if mode == "required":
        kwargs["tool_choice"] = "required"
    elif mode == "named":
        kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    else:
        kwargs.update(tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    full = c.chat.completions.create(**kwargs)
    calls, finish = _streamed_calls(c.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" == full.choices[0].finish_reason
    expected = full.choices[0].message.tool_calls
    assert [(x["name"], x["arguments"]) for x in calls] == \
        [(t.function.name, t.function.arguments) for t in expected]
    assert all(x["id"].startswith("call_") for x in calls)


# -- migration -------------------------------------------------------------------------------

# Never complete within the test's tokens (at least 20,000 characters): every stream runs to
# max_tokens, so the kill finds them all mid-stream.
LONG_TEXT = "[a-z ]{20000,}"


async def test_migrated_stream_resumes_its_grammar(etcd_server, tmp_path):
    """SIGKILL the MIX engine that serves more constrained greedy streams: each resumes on
    the other engine, whose matcher replays the tokens generated so far, and ends with
    exactly the tokens of an uninterrupted constrained run (and within the grammar)."""
    h = Harness(etcd_server.endpoint, "so-migrate/", tmp_path)
    try:
        svc, engines = start_mix_cluster(h, 2)
        prompts = [f"a constrained story {i} begins" for i in range(4)]
        survivor = await kill_mid_stream_and_check_migration(
            svc, engines, prompts, max_tokens=1500, pause_bound_s=h.ttl_s + 2.0 + 6.0,
            extra_body={"structured_outputs": {"regex": LONG_TEXT}})
        resp = client(survivor).completions.create(
            model="tiny", prompt=prompts[0], max_tokens=600, temperature=0,
            extra_body={"ignore_eos": True, "structured_outputs": {"regex": LONG_TEXT}})
        assert re.fullmatch("[a-z ]+", resp.choices[0].text)
        await wait_drained([survivor.http_url])
    finally:
        h.stop()
