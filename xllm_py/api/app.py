"""FastAPI app serving the OpenAI API over a GenerateBackend (engine MIX instance or service).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET /
DELETE /v1/responses/{id}, serving_responses.py), POST /v1/messages (Anthropic's,
serving_messages.py), GET /v1/models,
GET /v1/models/{id}, POST /tokenize, POST /detokenize (vLLM's shapes), GET /version,
GET /health, GET /readiness, GET /metrics, GET /openapi.json (the request bodies' real
schemas). Limits (xllm_py.config.APILimits): body size (413) and admission (429), see
limits.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

import xllm_py
from xllm_py.api.auth import APIKeyMiddleware, APIKeys
from xllm_py.api.backend import GenerateBackend
from xllm_py.api.errors import APIError, ModelNotFoundError, error_body
from xllm_py.api.limits import Admission, BodyLimitMiddleware
from xllm_py.api.metrics import APIMetrics
from xllm_py.api.openapi import body_schema, install_openapi
from xllm_py.api.serving_base import OFFLOOP_BODY_BYTES
from xllm_py.api.serving_chat import OpenAIServingChat
from xllm_py.api.serving_completions import OpenAIServingCompletion
from xllm_py.api.response_store import MemoryResponseStore, ResponseStore
from xllm_py.api.responses_protocol import ResponsesRequest
from xllm_py.api.serving_responses import OpenAIServingResponses
from xllm_py.api.messages_protocol import MessagesRequest
from xllm_py.api.serving_messages import AnthropicServingMessages
from xllm_py.api.serving_tokenization import OpenAIServingTokenization
from xllm_py.config import APILimits

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(backend: GenerateBackend, *, served_model_name: str | None = None,
              api_keys: Sequence[str] = (), protect_metrics: bool = False,
              limits: APILimits | None = None,
              response_store: ResponseStore | None = None) -> FastAPI:
    """The OpenAI-compatible app; `app.state.completions` / `.chat` / `.metrics` /
    `.admission` for introspection. With `api_keys`, every route but the probes (and
    /metrics unless `protect_metrics`) needs `Authorization: Bearer <key>`
    (xllm_py.api.auth). `response_store` keeps the Responses API's stored responses
    (default: in this process, MemoryResponseStore)."""
    limits = limits or APILimits()
    metrics = APIMetrics(getattr(backend, "metrics_registry", None))
    admission = Admission(limits)
    completions = OpenAIServingCompletion(backend, metrics, served_model_name, admission)
    chat = OpenAIServingChat(backend, metrics, served_model_name, admission)
    chat.trust_chat_template = limits.trust_request_chat_template
    responses = OpenAIServingResponses(backend, metrics, served_model_name, admission,
                                       response_store or MemoryResponseStore())
    messages = AnthropicServingMessages(backend, metrics, served_model_name, admission)
    model_name = completions.model_name
    created = int(time.time())
    app = FastAPI(title="xllm-py", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes)
    app.state.admission = admission
    app.state.completions = completions
    app.state.chat = chat
    app.state.responses = responses
    app.state.messages = messages
    app.state.metrics = metrics
    app.state.backend = backend
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=APIKeys(api_keys), protect_metrics=protect_metrics)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return JSONResponse(e.to_dict(), status_code=e.status_code, headers=e.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> Response:
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(e.detail), error_type, code=e.status_code), status_code=e.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> Response:
        logger.error("unhandled error in the HTTP layer: %s", type(e).__name__, exc_info=e)
        return JSONResponse(
            error_body(f"internal error ({type(e).__name__})", "server_error", code=500),
            status_code=500,
        )

    app.add_api_route("/v1/completions", completions.handle, methods=["POST"],
                      openapi_extra=body_schema(completions.request_cls))
    app.add_api_route("/v1/chat/completions", chat.handle, methods=["POST"],
                      openapi_extra=body_schema(chat.request_cls))

    app.add_api_route("/v1/responses", responses.handle, methods=["POST"],
                      openapi_extra=body_schema(ResponsesRequest))

    app.add_api_route("/v1/messages", messages.handle, methods=["POST"],
                      openapi_extra=body_schema(MessagesRequest))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse(await responses.get(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return JSONResponse(await responses.delete(response_id))

    model_card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "xllm-py",
        "root": backend.model_name,
        "max_model_len": backend.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in (model_name, backend.model_name):
            raise ModelNotFoundError(model_id)
        return JSONResponse(model_card)

    tokenization = OpenAIServingTokenization(backend, completions.check_model)

    async def off_loop_if_large(fn, body: bytes):  # (a large body never holds the loop)
        if len(body) > OFFLOOP_BODY_BYTES:
            return await asyncio.to_thread(fn, body)
        return fn(body)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return JSONResponse(await off_loop_if_large(tokenization.tokenize, await raw.body()))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return JSONResponse(await off_loop_if_large(tokenization.detokenize, await raw.body()))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": xllm_py.__version__})

    def probe(check) -> Callable[[], Awaitable[Response]]:
        async def answer() -> Response:
            ok, reason = check()
            if ok:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return answer

    # /health: alive (a draining engine is, and must not be restarted for it);
    # /readiness: takes new requests.
    live = getattr(backend, "check_live", None) or backend.check_ready
    app.add_api_route("/health", probe(live), methods=["GET"])
    app.add_api_route("/readiness", probe(backend.check_ready), methods=["GET"])

    refresh_metrics = getattr(backend, "refresh_metrics", None)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if refresh_metrics is not None:  # (what lives in other processes: TP ranks)
            await refresh_metrics()
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type=PROMETHEUS_CONTENT_TYPE)

    install_openapi(app, [completions.request_cls, chat.request_cls, ResponsesRequest,
                           MessagesRequest])
    return app
