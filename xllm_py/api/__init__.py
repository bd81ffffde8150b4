"""OpenAI-compatible HTTP layer shared by the engine (MIX instance) and the master service.

Light imports only (no FastAPI here): backends import the contract and errors from this
package; the app lives in `xllm_py.api.app.build_app`, the server helpers in
`xllm_py.api.server`.
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
