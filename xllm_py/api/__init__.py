"""OpenAI-compatible HTTP layer shared by the engine (MIX instance) and the master service.

Light imports only (no FastAPI here): backends import the contract and errors from this
package; the app lives in `xllm_py.api.app.build_app`, the server helpers in
`xllm_py.api.server`.

Layout (one file per thing it owns):
  protocol.py            OpenAI request models -> one GenerateRequest per prompt, carrying
                         the request's SamplingParams (made in `to_generate_request`)
  unsupported.py         the known parameters answered with a 400 (tools, response_format, ...)
  backend.py             GenerateBackend / GenerateRequest: the contract with the producer
  serving_base.py        request intake, stream and non-stream responses, errors, metrics
  serving_completions.py /v1/completions: prompts, echo, rendering of its choices
  serving_chat.py        /v1/chat/completions: chat template, rendering of its choices
  serving_responses.py   /v1/responses (OpenAI's Responses API) on the chat path;
    responses_protocol.py  its request -> a chat request; response_store.py: stored responses
  serving_messages.py    /v1/messages (Anthropic's Messages API) on the chat path;
    messages_protocol.py   its request -> a chat request
  output_blocks.py       a choice as text and tool-call blocks (Responses items, Messages blocks)
  chat_messages.py       chat messages as the template reads them
  vllm_extras.py         allowed_token_ids, bad_words, truncate_prompt_tokens
  beam_search.py         use_beam_search on /v1/completions, over the backend
  serving_tokenization.py  /tokenize and /detokenize (vLLM's shapes)
  logprobs.py            the two OpenAI logprobs formats, and vLLM's prompt_logprobs
  context.py             per-request state: prompts, choices, the fold of backend outputs
  generations.py         backend stream pumps and the client-disconnect race
  app.py                 routes (generation endpoints, models, tokenizer, /version, probes,
                         /metrics)
  errors.py, sse.py, metrics.py, server.py, testing.py
A new generation endpoint subclasses serving_base.OpenAIServing; a new plain route (a
tokenizer or model endpoint) goes in app.py or, once it has logic, its own serving_*.py.
"""
from xllm_py.api.backend import GenerateBackend, GenerateRequest, TokenizerLike
from xllm_py.api.errors import (
    APIError,
    BackendBusyError,
    BackendError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
)

__all__ = [
    "APIError",
    "BackendBusyError",
    "BackendError",
    "GenerateBackend",
    "GenerateRequest",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServiceUnavailableError",
    "TokenizerLike",
]
