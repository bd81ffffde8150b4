"""POST /v1/messages (Anthropic's Messages API) over the scripted backend, through the
official anthropic SDK: system, content blocks, tool_use / tool_result, tools and
tool_choice reach the chat path; stop reasons, usage, the named stream events; errors in
Anthropic's shape that never reach the backend; x-api-key authentication."""
import json

import anthropic
import httpx
import pytest

from xllm_py.api.app import build_app
from xllm_py.api.messages_protocol import MessagesRequest
from xllm_py.api.server import serve_in_thread
from xllm_py.api.testing import ScriptedBackend

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_time", "description": "time",
        "input_schema": {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}}}


@pytest.fixture
def client(server, backend):
    return anthropic.Anthropic(base_url=server[1].base_url, api_key="x", max_retries=0,
                               timeout=10)


def _prompt(backend):
    return backend.tokenizer().decode(backend.requests[-1].prompt_token_ids)


def test_create_renders_the_chat_prompt_with_stop_reasons_and_usage(client, backend):
    m = client.messages.create(model="fake-model", max_tokens=5, system="sys", messages=USER)
    assert _prompt(backend) == "<|system|>sys\n<|user|>hi\n<|assistant|>"
    assert [b.text for b in m.content] == ["abcde"] and m.stop_reason == "max_tokens"
    assert m.id.startswith("msg_") and m.role == "assistant" and m.type == "message"
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        len(backend.requests[-1].prompt_token_ids), 5)
    stopped = client.messages.create(model="fake-model", max_tokens=9, stop_sequences=["d"],
                                     messages=USER)
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "abc", "stop_sequence", "d")


def test_the_stream_sends_anthropic_events(client, backend):
    with client.messages.stream(model="fake-model", max_tokens=3, messages=USER) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1
    assert final.content[0].text == "abc" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3


def test_tool_use_and_tool_result_blocks_become_chat_turns():
    req = MessagesRequest(max_tokens=5, tools=[TOOL], tool_choice={"type": "any",
                          "disable_parallel_tool_use": True}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "time?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me see"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"tz": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
            {"type": "text", "text": "thanks"}]}])
    chat = req.to_chat()
    assert chat.template_messages() == [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "let me see", "tool_calls": [{
            "id": "toolu_1", "type": "function", "name": "get_time", "arguments": {"tz": "UTC"},
            "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "thanks"}]
    tools = chat.tool_request()
    assert (tools.mode, tools.parallel) == ("required", False)


def test_a_named_tool_gives_a_tool_use_block(client, backend):
    m = client.messages.create(model="fake-model", max_tokens=20, tools=[TOOL], messages=USER,
                               tool_choice={"type": "tool", "name": "get_time"})
    assert json.loads(backend.requests[-1].sampling.structured.value) == TOOL["input_schema"]
    # (the scripted backend ignores the grammar and runs to max_tokens: its text is not
    # JSON, so the input is {})
    assert m.stop_reason == "max_tokens" and m.content[-1].type == "tool_use"
    assert m.content[-1].name == "get_time" and m.content[-1].id.startswith("toolu_")


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": 0, "messages": USER}, 400, "max_tokens"),
    ({"messages": USER}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "'image' blocks"),
    ({"max_tokens": 5, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool",
                                                                          "name": "nope"}},
     400, "nope"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled"}}, 400, "thinking"),
    ({"max_tokens": 5, "messages": USER, "model": "claude-x"}, 404, "claude-x"),
])
def test_bad_requests_answer_in_anthropics_shape(server, backend, body, status, words):
    r = httpx.post(server[1].base_url + "/v1/messages", json={"model": "fake-model", **body},
                   timeout=10, trust_env=False)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and words in err["error"]["message"]
    assert err["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert backend.requests == []


def test_x_api_key_authenticates():
    handle = serve_in_thread(build_app(ScriptedBackend("fake-model"), api_keys=["k1"]),
                             "127.0.0.1", 0)
    try:
        ok = anthropic.Anthropic(base_url=handle.base_url, api_key="k1", max_retries=0)
        assert ok.messages.create(model="fake-model", max_tokens=2, messages=USER).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=handle.base_url, api_key="k2", max_retries=0
                                ).messages.create(model="fake-model", max_tokens=2, messages=USER)
    finally:
        handle.stop()
