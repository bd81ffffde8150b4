"""EngineRequest: what the engine thread takes in (a request, its sink, and for PD and
migration where it came from), with the helpers of its intake: sequence params, the
error output, the model directory a name resolves to."""
from __future__ import annotations

import dataclasses
import time

from xllm_py.engine.output_processor import OutputSink
from xllm_py.sampling_params import SamplingParams


@dataclasses.dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # PD: the prefill side holds the KV after the first token (see engine/pd/prefill.py).
    remote_decode: bool = False
    first_index: int = 0
    # Offline (batch) work: runs only in the room online requests leave (scheduler_offline.py).
    offline: bool = False
    tpot_slo_ms: float = 0.0  # the client's TPOT target (0: none), kept beside offline work
    # Migration (MultiGenerations): the client's prompt length, how many of the prompt
    # tokens here were generated elsewhere, and how many of those the client has no text
    # for yet (None: inferred, see IncrementalDetokenizer).
    usage_prompt_tokens: int | None = None
    generated_offset: int = 0
    num_unread: int | None = None


def resolve_model_dir(model: str) -> str:
    from xllm_py.model.catalog import resolve_model

    return resolve_model(model)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of a request: n=1, seed+index (reproducible per sequence)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, best_of=None, seed=seed)


def error_output(req: EngineRequest, code: int, message: str):
    from xllm_py.outputs import RequestOutput

    return RequestOutput(request_id=req.request_id, finished=True,
                         num_prompt_tokens=len(req.prompt_token_ids),
                         error_code=code, error_message=message)
