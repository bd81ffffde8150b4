"""EngineRequest: what the engine thread takes in (a request, its sink, and for PD and
migration where it came from), with its intake (`admit`) and the helpers of it: sequence
params, the error output, the model directory a name resolves to."""
from __future__ import annotations

import dataclasses
import time

from xllm_py.engine.output_processor import OutputProcessor, OutputSink, child_id
from xllm_py.request import Request, prompt_token_error
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


def admit(req: EngineRequest, outputs: OutputProcessor, eos_token_ids: list[int],
          vocab_size: int, max_model_len: int, limit_what: str) -> list[Request] | str:
    """The one intake of a request: its params completed (EOS ids), checked (token
    ids, length), its outputs registered in `outputs`, and its sequences as Requests for
    the scheduler. Returns those, or why it is refused (nothing registered then)."""
    params = req.params
    if not params.eos_token_ids:
        params = dataclasses.replace(params, eos_token_ids=list(eos_token_ids))
    best_of = params.best_of or params.n
    error = prompt_token_error(req.prompt_token_ids, vocab_size)
    if error is not None:
        return error
    if len(req.prompt_token_ids) + 1 > max_model_len:
        return (f"prompt has {len(req.prompt_token_ids)} tokens; "
                + limit_what.format(max_model_len))
    bad_ids = [t for t in (*params.logit_bias, *params.allowed_token_ids,
                           *params.prediction_token_ids) if t >= vocab_size]
    if bad_ids:  # (a prediction's ids would be the model's input as guesses)
        return (f"token id {bad_ids[0]} (logit_bias / allowed_token_ids / prediction) is out "
                f"of range: the vocabulary has {vocab_size} tokens")
    if req.usage_prompt_tokens is not None and params.prompt_logprobs is not None:
        # migrated: its prompt logprobs went out with its first output elsewhere
        params = dataclasses.replace(params, prompt_logprobs=None)
    want_logprobs = params.logprobs is not None
    outputs.add_parent(
        req.request_id, req.prompt_token_ids, req.sink, n=params.n, best_of=best_of,
        stop=list(params.stop or []), include_stop_str=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens, want_logprobs=want_logprobs,
        first_index=req.first_index, num_prompt_tokens=req.usage_prompt_tokens,
        generated_offset=req.generated_offset, num_unread=req.num_unread,
        arrival_time=req.arrival_time,
        want_prompt_logprobs=params.prompt_logprobs is not None)
    requests = []
    for i in range(req.first_index, req.first_index + best_of):
        cp = child_params(params, i)
        if best_of > params.n and cp.logprobs is None:
            cp = dataclasses.replace(cp, logprobs=0)  # cumulative logprob ranks best_of
        requests.append(Request(child_id(req.request_id, i), list(req.prompt_token_ids), cp,
                                remote_decode=req.remote_decode, offline=req.offline,
                                tpot_slo_ms=req.tpot_slo_ms))
    return requests
