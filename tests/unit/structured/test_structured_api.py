"""Structured outputs in the HTTP layer, over the scripted backend: each way of
asking (response_format, structured_outputs, guided_*) becomes the one GrammarSpec the
backend receives; a malformed or invalid one is a 400 naming the problem that never
reaches the backend."""
import httpx
import pytest

from xllm_py.structured.spec import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
COMPLETIONS = ("/v1/completions", {"prompt": "a"})


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1].base_url, timeout=10, trust_env=False) as c:
        yield c


def _error(resp, status=400):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("route,base", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "object", "properties": {"a": {"type": '
                                     '"integer"}}, "required": ["a"]}'}},
     GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     GrammarSpec.json_schema(SCHEMA, "")),
    ({"structured_outputs": {"regex": r"\d+"}}, GrammarSpec("regex", r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, GrammarSpec.choices(["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, GrammarSpec("grammar", 'start: "a"+')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     GrammarSpec.json_schema(SCHEMA, " ?")),
    ({"guided_regex": "[ab]+"}, GrammarSpec("regex", "[ab]+")),
    ({"guided_choice": ["x", "y z"]}, GrammarSpec.choices(["x", "y z"])),
    ({"guided_grammar": 'root ::= "a" | "b"', "guided_decoding_backend": "guidance"},
     GrammarSpec("grammar", 'root ::= "a" | "b"')),
    ({"response_format": {"type": "text"}}, None),
])
def test_each_spelling_reaches_the_backend_as_one_spec(http, backend, route, base, fields,
                                                        expected):
    resp = http.post(route, json={**base, "max_tokens": 2, **fields})
    assert resp.status_code == 200, resp.text
    assert [r.sampling.structured for r in backend.requests] == [expected]


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, "response_format", "objectx"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "foo"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "only one"),
    ({"guided_choice": "a", }, "guided_choice", "list"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "llguidance"),
])
def test_a_bad_constraint_is_a_400_naming_it_before_the_backend(http, backend, fields, param,
                                                                 words):
    for route, base in (CHAT, COMPLETIONS):
        err = _error(http.post(route, json={**base, "max_tokens": 2, **fields}))
        assert err["param"] == param, err
        assert words in err["message"], err
    assert backend.requests == []


def test_schema_numbers_do_not_need_to_fit_the_wire(http, backend):
    """A schema travels as text: its integers are not proto int32 values."""
    schema = {"type": "integer", "maximum": 1 << 40}
    resp = http.post(CHAT[0], json={**CHAT[1], "max_tokens": 2, "guided_json": schema})
    assert resp.status_code == 200, resp.text
