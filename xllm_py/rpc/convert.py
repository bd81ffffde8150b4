"""proto <-> domain conversions at the gRPC boundary (no pb2 objects beyond this module).

Proto3 scalars have no "unset": zero means "default" for top_p and repetition_penalty;
temperature, seed, prompt_logprobs and max_tokens (0 is valid: score the prompt only)
carry explicit has_* flags (a sender without has_max_tokens: 0 means unset).
tests/unit/test_protos.py round-trips every SamplingParams field, so a new field that is
not carried here fails there.
"""
from __future__ import annotations

import dataclasses

from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.sampling_params import SamplingParams

SCHEMA_VERSION = 1


@dataclasses.dataclass
class EngineRequestSpec:
    """What an engine needs to run a request that arrived over gRPC."""
    request_id: str
    service_request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True
    x_request_id: str = ""
    source_xservice_addr: str = ""
    prefill_name: str = ""
    decode_name: str = ""
    offline: bool = False
    priority: int = 0


def params_to_proto(params: SamplingParams, msg: pb.DisaggRequest) -> None:
    msg.n = params.n
    msg.best_of = params.best_of or 0
    msg.has_temperature = True
    msg.temperature = params.temperature
    msg.top_p = params.top_p
    msg.top_k = params.top_k if params.top_k and params.top_k > 0 else 0
    msg.min_p = params.min_p
    msg.frequency_penalty = params.frequency_penalty
    msg.presence_penalty = params.presence_penalty
    msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.has_seed = True
        msg.seed = params.seed
    msg.max_tokens = params.max_tokens or 0
    msg.has_max_tokens = params.max_tokens is not None
    msg.min_tokens = params.min_tokens
    msg.ignore_eos = params.ignore_eos
    msg.stop_token_ids.extend(params.stop_token_ids or [])
    for s in params.stop or []:
        msg.stop_sequences.add(text=s)
    msg.logprobs = params.logprobs is not None
    msg.top_logprobs = params.logprobs or 0
    if params.prompt_logprobs is not None:
        msg.has_prompt_logprobs = True
        msg.prompt_logprobs = params.prompt_logprobs
    msg.echo = params.echo
    msg.skip_special_tokens = params.skip_special_tokens
    msg.include_stop_str_in_output = params.include_stop_str_in_output
    msg.eos_token_ids.extend(params.eos_token_ids or [])
    for token_id, bias in params.logit_bias.items():
        msg.logit_bias[token_id] = bias


def params_from_proto(msg: pb.DisaggRequest) -> SamplingParams:
    """Raises ValueError (SamplingParamsError) on invalid values."""
    kwargs = dict(
        n=msg.n or 1,
        best_of=msg.best_of or None,
        temperature=msg.temperature if msg.has_temperature else 1.0,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        min_p=msg.min_p,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty > 0 else 1.0,
        seed=msg.seed if msg.has_seed else None,
        max_tokens=msg.max_tokens if msg.has_max_tokens else (msg.max_tokens or None),
        min_tokens=msg.min_tokens,
        stop=[s.text for s in msg.stop_sequences if s.text],
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.top_logprobs if msg.logprobs else None,
        prompt_logprobs=msg.prompt_logprobs if msg.has_prompt_logprobs else None,
        echo=msg.echo,
        skip_special_tokens=msg.skip_special_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias),
    )
    if msg.eos_token_ids:
        kwargs["eos_token_ids"] = list(msg.eos_token_ids)
    return SamplingParams(**kwargs)


def spec_to_proto(spec: EngineRequestSpec) -> pb.DisaggRequest:
    msg = pb.DisaggRequest(
        req_id=spec.request_id, service_req_id=spec.service_request_id,
        tokens_num=len(spec.prompt_token_ids), stream=spec.stream,
        x_request_id=spec.x_request_id, source_xservice_addr=spec.source_xservice_addr,
        offline=spec.offline, priority=spec.priority, schema_version=SCHEMA_VERSION,
        routing=pb.RoutingInfo(prefill_name=spec.prefill_name, decode_name=spec.decode_name))
    msg.prompt_tokens.extend(spec.prompt_token_ids)
    params_to_proto(spec.params, msg)
    return msg


def spec_from_proto(msg: pb.DisaggRequest) -> EngineRequestSpec:
    if not msg.req_id:
        raise ValueError("req_id is empty")
    if not msg.prompt_tokens:
        raise ValueError("prompt_tokens is empty")
    return EngineRequestSpec(
        request_id=msg.req_id, service_request_id=msg.service_req_id or msg.req_id,
        prompt_token_ids=list(msg.prompt_tokens), params=params_from_proto(msg),
        stream=msg.stream, x_request_id=msg.x_request_id,
        source_xservice_addr=msg.source_xservice_addr,
        prefill_name=msg.routing.prefill_name, decode_name=msg.routing.decode_name,
        offline=msg.offline, priority=msg.priority)


def output_to_proto(out: RequestOutput, service_request_id: str = "",
                    finished_on_prefill: bool = False) -> pb.DisaggStreamGeneration:
    gen = pb.DisaggStreamGeneration(
        req_id=out.request_id, service_req_id=service_request_id or out.request_id,
        finished=out.finished, finished_on_prefill_instance=finished_on_prefill,
        gen_status=pb.GenStatus(status_code=out.error_code or 200,
                                status_msg=out.error_message),
        unreachable_instance=out.unreachable_instance,
        usage=pb.Usage(num_prompt_tokens=out.num_prompt_tokens,
                       num_generated_tokens=out.num_generated_tokens,
                       num_total_tokens=out.num_prompt_tokens + out.num_generated_tokens,
                       num_cached_tokens=out.num_cached_tokens))
    if out.prompt_token_ids is not None:
        gen.prompt_token_ids.extend(out.prompt_token_ids)
    for d in out.outputs:
        so = gen.outputs.add(index=d.index, text=d.text, finish_reason=d.finish_reason or "")
        so.token_ids.extend(d.token_ids)
        for lp in d.logprobs or []:
            _logprob_to_proto(lp, so.logprobs.add())
    for plp in out.prompt_logprobs or []:
        entry = gen.prompt_logprobs.add()  # no data: null (the first prompt token)
        if plp is not None:
            _logprob_to_proto(plp, entry)
    return gen


def _logprob_to_proto(lp: TokenLogprob, entry: pb.LogProb) -> None:
    entry.data.token_id, entry.data.logprob = lp.token_id, lp.logprob
    for tid, tlp in lp.top:
        entry.top_logprobs.add(token_id=tid, logprob=tlp)


def _logprob_from_proto(entry: pb.LogProb) -> TokenLogprob:
    return TokenLogprob(token_id=entry.data.token_id, logprob=entry.data.logprob,
                        top=[(t.token_id, t.logprob) for t in entry.top_logprobs])


def output_from_proto(gen: pb.DisaggStreamGeneration) -> RequestOutput:
    code = gen.gen_status.status_code
    outputs = []
    for so in gen.outputs:
        lps = None
        if len(so.logprobs):
            lps = [_logprob_from_proto(e) for e in so.logprobs]
        outputs.append(CompletionDelta(index=so.index, text=so.text,
                                       token_ids=list(so.token_ids), logprobs=lps,
                                       finish_reason=so.finish_reason or None))
    return RequestOutput(
        request_id=gen.service_req_id or gen.req_id, outputs=outputs, finished=gen.finished,
        num_prompt_tokens=gen.usage.num_prompt_tokens,
        num_generated_tokens=gen.usage.num_generated_tokens,
        num_cached_tokens=gen.usage.num_cached_tokens,
        prompt_token_ids=list(gen.prompt_token_ids) if len(gen.prompt_token_ids) else None,
        error_code=0 if code in (0, 200) else code, error_message=gen.gen_status.status_msg,
        unreachable_instance=gen.unreachable_instance,
        prompt_logprobs=[_logprob_from_proto(e) if e.HasField("data") else None
                         for e in gen.prompt_logprobs] if len(gen.prompt_logprobs) else None)
