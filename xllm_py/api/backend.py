"""The contract between the OpenAI HTTP layer and whatever produces tokens.

The engine (MIX instance, `AsyncEngine`) and the master service both implement
`GenerateBackend`; `xllm_py.api.app.build_app(backend)` serves the same OpenAI API over
either. The HTTP layer tokenizes, validates and mints ids; it hands the backend one
`GenerateRequest` per prompt and renders the `RequestOutput` deltas it yields.

Metrics: a backend with a `metrics_registry` (prometheus_client CollectorRegistry, one per
process) gets the HTTP layer's metrics registered there, and /metrics renders it; a backend
without one gets a registry of the app's own. Every component of the process registers
into that one registry (no hand-written exposition text anywhere). A backend's optional
`async refresh_metrics()` is awaited before each render (counters fetched from other
processes; it must bound its own time and not raise).

Cancellation: when the HTTP client goes away the layer closes the iterator returned by
`generate` (`aclose()`) or cancels the task awaiting it; the backend must then abort the
request and free its resources.
"""
from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from xllm_py.outputs import RequestOutput
from xllm_py.sampling_params import SamplingParams


@runtime_checkable
class TokenizerLike(Protocol):
    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


@dataclasses.dataclass
class GenerateRequest:
    """One prompt to generate `sampling.n` choices for. `sampling` is the request's
    SamplingParams, checked by the HTTP layer (its max_tokens always resolved against the
    prompt); backends pass it on as it is, to the engine or over the wire."""

    request_id: str  # unique, minted by the HTTP layer ("cmpl-<hex>", "chatcmpl-<hex>-<i>")
    prompt_token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    prompt_text: str | None = None  # for echo only; never log it
    x_request_id: str | None = None  # the client's X-Request-Id header (tracing)
    stream: bool = False
    arrival_time: float = dataclasses.field(default_factory=time.time)
    # Latency targets for the service's SLO_AWARE routing (None: the service's defaults).
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # Offline (batch) work: served only in the room online requests leave.
    offline: bool = False

    def anon_repr(self) -> str:
        """A log-safe description: ids and sizes, no prompt content."""
        s = self.sampling
        return (
            f"GenerateRequest(request_id={self.request_id}, x_request_id={self.x_request_id}, "
            f"num_prompt_tokens={len(self.prompt_token_ids)}, n={s.n}, best_of={s.best_of}, "
            f"max_tokens={s.max_tokens}, stream={self.stream})"
        )


@runtime_checkable
class GenerateBackend(Protocol):
    model_name: str
    max_model_len: int

    def tokenizer(self) -> TokenizerLike: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutput deltas (CompletionDelta.index in [0, n)); may raise BackendBusyError."""
        ...

    def check_ready(self) -> tuple[bool, str]: ...
