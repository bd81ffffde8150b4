"""Shared unit-test fixtures: the fake OpenAI server of the API tests, a ScriptedBackend
behind the real app served on a loopback port once per module (`server`), reset before
each test (`backend`). A module that defines its own `server` or `backend` overrides them."""
from __future__ import annotations

import pytest

from xllm_py.api.app import build_app
from xllm_py.api.server import serve_in_thread
from xllm_py.api.testing import ScriptedBackend

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    backend = ScriptedBackend(MODEL, max_model_len=256)
    handle = serve_in_thread(build_app(backend), "127.0.0.1", 0)
    yield backend, handle
    handle.stop()


@pytest.fixture
def backend(server):
    server[0].reset()
    return server[0]
