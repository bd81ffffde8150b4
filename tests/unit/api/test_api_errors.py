"""Error paths of the HTTP layer driven in-process through httpx.ASGITransport."""
import httpx
import pytest

from xllm_py.api.app import build_app
from xllm_py.api.errors import BackendBusyError
from xllm_py.api.testing import ScriptedBackend


class SyncBusyBackend(ScriptedBackend):
    """generate() is a plain function that refuses work before returning an iterator."""

    def generate(self, req):
        self.requests.append(req)
        raise BackendBusyError("queue full")


class BrokenTokenizerBackend(ScriptedBackend):
    def tokenizer(self):
        raise RuntimeError("tokenizer exploded")


def _client(backend, **kwargs):
    app = build_app(backend, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_busy_raised_synchronously_is_503():
    async with _client(SyncBusyBackend()) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "backend_busy"


async def test_unexpected_exception_is_500_with_openai_body():
    async with _client(BrokenTokenizerBackend()) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "tokenizer exploded" not in r.text


async def test_served_model_name_and_unknown_route():
    async with _client(ScriptedBackend("base"), served_model_name="alias") as c:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["alias"]
        r = await c.post("/v1/completions", json={"model": "alias", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "alias"
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()


async def test_metrics_count_outcomes():
    backend = ScriptedBackend()
    async with _client(backend) as c:
        await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        await c.post("/v1/completions", json={"prompt": "x", "n": 0})
        backend.ready = (False, "down")
        await c.post("/v1/completions", json={"prompt": "x"})
        text = (await c.get("/metrics")).text
    assert 'xllm_requests_total{outcome="success"} 1.0' in text
    assert 'xllm_requests_total{outcome="invalid"} 1.0' in text
    assert 'xllm_requests_total{outcome="unavailable"} 1.0' in text


class StrictTemplateBackend(ScriptedBackend):
    def tokenizer(self):
        tok = super().tokenizer()

        class _Strict(type(tok)):
            def apply_chat_template(self, messages, add_generation_prompt=True):
                raise ValueError("Conversation roles must alternate user/assistant")

        return _Strict()


async def test_chat_template_failure_is_400():
    async with _client(StrictTemplateBackend()) as c:
        r = await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
    assert "alternate" in r.json()["error"]["message"]


@pytest.mark.integration
async def test_serve_stops_on_event():
    import asyncio
    import socket

    from xllm_py.api.server import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = asyncio.Event()
    task = asyncio.create_task(serve(build_app(ScriptedBackend()), "127.0.0.1", port, stop_event=stop))
    async with httpx.AsyncClient() as c:
        for _ in range(100):
            try:
                r = await c.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.05)
    assert r.status_code == 200
    stop.set()
    await asyncio.wait_for(task, 5)
