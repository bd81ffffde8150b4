"""Tools on chat completions: the request side over the scripted backend
(tools reach the chat template, tool_choice required / named become a grammar, bad
tools and unknown names are a 400 that never reaches the backend) and the parsers of
each model family's tool-call format, whole and streamed in pieces."""
import json

import httpx
import pytest

from xllm_py.api.tool_parsers import ToolStream, format_for, parse
from xllm_py.structured import grammar

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
BASE = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2}


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1].base_url, timeout=10, trust_env=False) as c:
        yield c


def _post(http, **fields):
    return http.post("/v1/chat/completions", json={**BASE, **fields})


def test_tools_reach_the_template_and_choices_become_grammars(http, backend):
    tok = backend.tokenizer()
    for choice, spec_kind in (("auto", None), (None, None), ("required", "json"),
                              ({"type": "function", "function": {"name": "get_time"}}, "json")):
        backend.reset()
        body = {"tools": [WEATHER, TIME]}
        if choice is not None:
            body["tool_choice"] = choice
        assert _post(http, **body).status_code == 200
        req = backend.requests[0]
        assert tok.decode(req.prompt_token_ids).startswith("<|tool|>get_weather\n<|tool|>get_time")
        assert (req.sampling.structured.kind if req.sampling.structured else None) == spec_kind
        if spec_kind:
            assert grammar.check(req.sampling.structured) is None
    named = json.loads(req.sampling.structured.value)
    assert named == TIME["function"]["parameters"]
    backend.reset()
    assert _post(http, tools=[WEATHER], tool_choice="none").status_code == 200
    req = backend.requests[0]
    assert "<|tool|>" not in tok.decode(req.prompt_token_ids) and req.sampling.structured is None


def test_required_grammar_covers_every_tool_and_parallel_calls():
    from xllm_py.api.tool_choice import tool_request

    many = json.loads(tool_request([WEATHER, TIME], "required", None).grammar().value)
    assert many["minItems"] == 1 and "maxItems" not in many
    assert [a["properties"]["name"]["const"] for a in many["items"]["anyOf"]] == \
        ["get_weather", "get_time"]
    one = json.loads(tool_request([WEATHER], "required", False).grammar().value)
    assert one["maxItems"] == 1


@pytest.mark.parametrize("fields,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", "bad name!"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1", "two functions"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tool_choice", "objectx"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tools_are_a_400_before_the_backend(http, backend, fields, param, words):
    resp = _post(http, **fields)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert backend.requests == []


def test_tools_stay_unsupported_on_completions(http, backend):
    resp = http.post("/v1/completions", json={"prompt": "a", "tools": [WEATHER]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"


def test_earlier_tool_calls_and_results_reach_the_template(http, backend):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = http.post("/v1/chat/completions", json={**BASE, "messages": messages,
                                                   "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text


_TEXTS = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Pa\\"ris", "days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", '
               '"arguments": {"tz": "UTC"}}</tool_call>',
     "Checking.\n\n", [("get_weather", '{"city": "Pa\\"ris", "days": 2}'),
                       ("get_time", '{"tz": "UTC"}')]),
    ("hermes", "Just text, a <b>tag</b> and <tool", "Just text, a <b>tag</b> and <tool", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": ', 
     '<tool_call>{"name": "get_time", "arguments": {"tz": ', []),  # cut off: content
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {}}',
     "", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]),
    ("llama3_json", "The {weather} is fine", "The {weather} is fine", []),
    ("pythonic", '```tool_code\n[get_weather(city="Oslo", days=3), get_time(tz="CET")]\n```',
     "", [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", '{"tz": "CET"}')]),
    ("pythonic", "[not a call", "[not a call", []),
    ("json_array", '[{"name":"get_weather","parameters":{"city":"Lima"}},\n '
                   '{"name":"get_time","parameters":{"tz":"UTC"}}]',
     "", [("get_weather", '{"city":"Lima"}'), ("get_time", '{"tz":"UTC"}')]),
    ("arguments", '{"city": "Kyiv"}', "", [("get_weather", '{"city": "Kyiv"}')]),
]


@pytest.mark.parametrize("fmt,text,content,calls", _TEXTS)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_parsers_whole_and_streamed_agree(fmt, text, content, calls, piece):
    name = "get_weather" if fmt == "arguments" else None
    got_content, got_calls = parse(text, fmt, True, name)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    stream = ToolStream(fmt, name)
    streamed, args, names, ids = "", {}, {}, {}
    for i in range(0, len(text), piece):
        delta, tool_deltas = stream.feed(text[i:i + piece], i + piece >= len(text))
        streamed += delta
        for d in tool_deltas:
            if "id" in d:  # the first delta of a call: id, type, name
                assert d["type"] == "function" and d["index"] not in ids
                ids[d["index"]], names[d["index"]] = d["id"], d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"].get("arguments", "")
    if calls:
        assert streamed.strip() == content.strip()
        assert [(names[i], args[i]) for i in range(len(calls))] == calls
        assert len(set(ids.values())) == len(calls)
    else:  # (a call cut off mid-stream was streamed as one: its text follows as content)
        assert streamed == content
        assert not names or "<tool_call>{" in text


def test_format_follows_the_chat_template():
    class Tok:
        def __init__(self, template):
            self.chat_template = template
    assert format_for(Tok("{% if tools %}<tool_call>{% endif %}")) == "hermes"
    assert format_for(Tok("<|start_header_id|>ipython<|end_header_id|>")) == "llama3_json"
    assert format_for(Tok("<start_of_turn>user ```tool_code")) == "pythonic"
    assert format_for(Tok(None)) == "hermes"
