"""POST /v1/responses over the scripted backend, through the official openai SDK: the
request's translation into the chat path (instructions, items, tools, text.format), the
event sequence of a stream, the stored responses (GET, DELETE, previous_response_id, 404s)
and their bounds; bad requests are a 400 that never reaches the backend."""
import asyncio
import json

import openai
import pytest

from xllm_py.api.response_store import MemoryResponseStore, ResponseStoreLimits
from xllm_py.api.responses_protocol import input_messages
from xllm_py.api.output_blocks import blocks_of, OutputBlocks


@pytest.fixture
def client(server, backend):
    return openai.OpenAI(base_url=server[1].base_url + "/v1", api_key="x", max_retries=0,
                         timeout=10)


def _prompt(backend, i=-1):
    return backend.tokenizer().decode(backend.requests[i].prompt_token_ids)


def test_a_response_renders_the_chat_prompt_and_the_chat_tokens(client, backend):
    r = client.responses.create(model="fake-model", input="hi", instructions="be brief",
                                max_output_tokens=5, temperature=0, metadata={"k": "v"})
    assert _prompt(backend) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert r.output_text == "abcde" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.object == "response" and r.metadata == {"k": "v"}
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        len(backend.requests[0].prompt_token_ids), 5, len(backend.requests[0].prompt_token_ids) + 5)
    chat = client.chat.completions.create(
        model="fake-model", max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == r.output_text
    assert backend.requests[1].prompt_token_ids == backend.requests[0].prompt_token_ids


def test_items_previous_response_id_and_the_same_history_sent_whole(client, backend):
    first = client.responses.create(model="fake-model", input="one", instructions="sys",
                                    max_output_tokens=3)
    second = client.responses.create(model="fake-model", input="two", max_output_tokens=2,
                                     previous_response_id=first.id)
    # instructions are not inherited; the stored input and output are
    assert _prompt(backend) == "<|user|>one\n<|assistant|>abc\n<|user|>two\n<|assistant|>"
    whole = client.responses.create(model="fake-model", max_output_tokens=2, input=[
        {"role": "user", "content": "one"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "abc"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]}])
    assert backend.requests[-1].prompt_token_ids == backend.requests[-2].prompt_token_ids
    assert whole.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id 'resp_gone'"):
        client.responses.create(model="fake-model", input="x", previous_response_id="resp_gone")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    unstored = client.responses.create(model="fake-model", input="x", max_output_tokens=1,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_call_items_become_tool_calls_and_tool_messages():
    messages = input_messages([
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert messages == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_tools_and_text_format_reach_the_chat_request(client, backend):
    tool = {"type": "function", "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}}}
    client.responses.create(model="fake-model", input="t?", tools=[tool],
                            tool_choice={"type": "function", "name": "get_time"},
                            max_output_tokens=3)
    assert _prompt(backend).startswith("<|tool|>get_time\n")
    assert json.loads(backend.requests[-1].sampling.structured.value) == tool["parameters"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(model="fake-model", input="x", max_output_tokens=3, text={
        "format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert json.loads(backend.requests[-1].sampling.structured.value) == schema


def test_the_stream_sends_the_responses_events_in_order(client, backend):
    events = list(client.responses.create(model="fake-model", input="hi", max_output_tokens=3,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "abc"
    assert events[-1].response.output_text == "abc"
    assert client.responses.retrieve(events[-1].response.id).output_text == "abc"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "input_image"}]}, "input.0.type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "objectx"}}}},
     "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"},
      "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ({}, "input"),
])
def test_bad_requests_are_a_400_that_reaches_no_backend(server, backend, body, param):
    import httpx
    r = httpx.post(server[1].base_url + "/v1/responses", json={"model": "fake-model", **body},
                   timeout=10, trust_env=False)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert backend.requests == []


def test_output_blocks_stream_and_whole_agree():
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    whole = blocks_of(text, "hermes")
    stream = OutputBlocks("hermes")
    for k in range(len(text)):
        stream.feed(text[k], k == len(text) - 1)
    for blocks in (whole, stream.blocks):
        assert [(b.kind, b.text.strip(), b.name) for b in blocks] == [
            ("text", "ok", None), ("tool_call", '{"a": 1}', "f")]
        assert all(b.done for b in blocks)


def test_the_memory_store_is_bounded_and_expires():
    now = [0.0]
    store = MemoryResponseStore(ResponseStoreLimits(max_responses=2, max_bytes=200, ttl_s=10),
                                clock=lambda: now[0])

    async def run():
        for i in range(3):
            assert await store.put(f"r{i}", {"i": i})
        assert await store.get("r0") is None and (await store.get("r2"))["i"] == 2
        assert not await store.put("big", {"x": "y" * 300})
        now[0] = 11.0
        assert await store.get("r2") is None and len(store) == 0
    asyncio.run(run())
