"""proto <-> domain conversions at the gRPC boundary (no pb2 objects beyond this module).

Proto3 scalars have no "unset": zero means "default" for the fields whose default is not
zero (n, best_of, top_p, repetition_penalty); temperature, seed and prompt_logprobs carry
explicit has_* flags, and so does max_tokens (0 is valid: score the prompt only; a sender
without has_max_tokens means unset by 0). The rules are read from the schemas
(`_field_rules`, above params_to_proto). tests/unit/project/test_protos.py
round-trips every SamplingParams field, so a new field that is not carried here fails there.
"""
from __future__ import annotations

import dataclasses

from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob
from xllm_py.proto import xllm_pb2 as pb
from xllm_py.sampling_params import SamplingParams
from xllm_py.structured.spec import GrammarSpec

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
    # latency targets (ms) the service routed for (0: none); a prefill orders its queue
    # by the TTFT one (cluster/prefill_order.py)
    ttft_slo_ms: int = 0
    tpot_slo_ms: int = 0


# How SamplingParams travels in a DisaggRequest. Every rule is read from the two schemas,
# not listed by field, except _OWN: the fields whose proto form differs (top_k's 0 = off,
# stop as StopSequence, logprobs as a flag + top_logprobs, max_tokens's legacy 0, the
# logit_bias map, the grammar message, bad words as TokenSequence), converted by hand below. Of the others, each with
# a proto field of its name: one with a `has_<name>` flag in the proto is sent with it
# (_FLAGGED); a number whose SamplingParams default is None or not 0 has "zero means
# unset" (_ZERO_UNSET); the rest (flags, lists, numbers defaulting to 0) travel as they are
# (_SAME_NAME). A SamplingParams field with no proto field of its name and not in _OWN
# fails at import.
_OWN = ("top_k", "stop", "logprobs", "max_tokens", "logit_bias", "structured",
        "bad_words_token_ids")


def _field_rules() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    proto_fields = pb.DisaggRequest.DESCRIPTOR.fields_by_name
    same, zero_unset, flagged = [], [], []
    for f in dataclasses.fields(SamplingParams):
        if f.name in _OWN:
            continue
        if f.name not in proto_fields:
            raise RuntimeError(f"SamplingParams.{f.name} has no DisaggRequest field: add one "
                               f"to xllm.proto or a rule in rpc/convert.py")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if "has_" + f.name in proto_fields:
            flagged.append(f.name)
        elif default is None or (isinstance(default, (int, float))
                                 and not isinstance(default, bool) and default != 0):
            zero_unset.append(f.name)
        else:
            same.append(f.name)
    return tuple(same), tuple(zero_unset), tuple(flagged)


_SAME_NAME, _ZERO_UNSET, _FLAGGED = _field_rules()


def params_to_proto(params: SamplingParams, msg: pb.DisaggRequest) -> None:
    for name in _SAME_NAME:
        value = getattr(params, name)
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    for name in _ZERO_UNSET:
        value = getattr(params, name)
        setattr(msg, name, 0 if value is None else value)
    for name in _FLAGGED:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, "has_" + name, True)
            setattr(msg, name, value)
    msg.top_k = params.top_k if params.top_k and params.top_k > 0 else 0
    for s in params.stop or []:
        msg.stop_sequences.add(text=s)
    msg.logprobs = params.logprobs is not None
    msg.top_logprobs = params.logprobs or 0
    if params.max_tokens is not None:
        msg.has_max_tokens = True
        msg.max_tokens = params.max_tokens
    for token_id, bias in params.logit_bias.items():
        msg.logit_bias[token_id] = bias
    for seq in params.bad_words_token_ids:
        msg.bad_words.add(token_ids=seq)
    if params.structured is not None:
        g = params.structured
        msg.structured_output.kind, msg.structured_output.value = g.kind, g.value
        if g.whitespace_pattern is not None:
            msg.structured_output.has_whitespace_pattern = True
            msg.structured_output.whitespace_pattern = g.whitespace_pattern


def params_from_proto(msg: pb.DisaggRequest) -> SamplingParams:
    """Raises ValueError (SamplingParamsError) on invalid values."""
    kwargs = {}
    for name in _SAME_NAME:
        value = getattr(msg, name)
        kwargs[name] = list(value) if not isinstance(value, (bool, int, float)) else value
    for name in _ZERO_UNSET:
        value = getattr(msg, name)
        if value != 0:  # a negative value reaches validation and is refused
            kwargs[name] = value
    for name in _FLAGGED:
        if getattr(msg, "has_" + name):
            kwargs[name] = getattr(msg, name)
    kwargs["top_k"] = msg.top_k if msg.top_k > 0 else -1
    kwargs["stop"] = [s.text for s in msg.stop_sequences if s.text]
    kwargs["logprobs"] = msg.top_logprobs if msg.logprobs else None
    if msg.has_max_tokens or msg.max_tokens:
        kwargs["max_tokens"] = msg.max_tokens
    kwargs["logit_bias"] = dict(msg.logit_bias)
    kwargs["bad_words_token_ids"] = [list(seq.token_ids) for seq in msg.bad_words]
    if msg.HasField("structured_output"):
        so = msg.structured_output
        kwargs["structured"] = GrammarSpec(
            so.kind, so.value, so.whitespace_pattern if so.has_whitespace_pattern else None)
    return SamplingParams(**kwargs)


def spec_to_proto(spec: EngineRequestSpec) -> pb.DisaggRequest:
    msg = pb.DisaggRequest(
        req_id=spec.request_id, service_req_id=spec.service_request_id,
        tokens_num=len(spec.prompt_token_ids), stream=spec.stream,
        x_request_id=spec.x_request_id, source_xservice_addr=spec.source_xservice_addr,
        offline=spec.offline, priority=spec.priority, schema_version=SCHEMA_VERSION,
        ttft_slo=spec.ttft_slo_ms, tpot_slo=spec.tpot_slo_ms,
        routing=pb.RoutingInfo(prefill_name=spec.prefill_name, decode_name=spec.decode_name))
    msg.prompt_tokens.extend(spec.prompt_token_ids)
    params_to_proto(spec.params, msg)
    return msg


def spec_from_proto(msg: pb.DisaggRequest) -> EngineRequestSpec:
    if not msg.req_id:
        raise ValueError("req_id is empty")
    if not msg.prompt_tokens:
        raise ValueError("prompt_tokens is empty")
    if msg.ttft_slo < 0 or msg.tpot_slo < 0:
        raise ValueError(f"ttft_slo and tpot_slo must be >= 0 (ms; 0: none), got "
                         f"{msg.ttft_slo} and {msg.tpot_slo}")
    return EngineRequestSpec(
        request_id=msg.req_id, service_request_id=msg.service_req_id or msg.req_id,
        prompt_token_ids=list(msg.prompt_tokens), params=params_from_proto(msg),
        stream=msg.stream, x_request_id=msg.x_request_id,
        source_xservice_addr=msg.source_xservice_addr,
        prefill_name=msg.routing.prefill_name, decode_name=msg.routing.decode_name,
        offline=msg.offline, priority=msg.priority, ttft_slo_ms=msg.ttft_slo,
        tpot_slo_ms=msg.tpot_slo)


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
                       num_cached_tokens=out.num_cached_tokens,
                       num_accepted_prediction_tokens=out.num_accepted_prediction_tokens,
                       num_rejected_prediction_tokens=out.num_rejected_prediction_tokens))
    if out.prompt_token_ids is not None:
        gen.prompt_token_ids.extend(out.prompt_token_ids)
    for d in out.outputs:
        so = gen.outputs.add(index=d.index, text=d.text, finish_reason=d.finish_reason or "")
        if isinstance(d.stop_reason, str):
            so.stop_str = d.stop_reason
        elif d.stop_reason is not None:
            so.has_stop_token, so.stop_token = True, d.stop_reason
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
        stop_reason = so.stop_token if so.has_stop_token else (so.stop_str or None)
        outputs.append(CompletionDelta(index=so.index, text=so.text,
                                       token_ids=list(so.token_ids), logprobs=lps,
                                       finish_reason=so.finish_reason or None,
                                       stop_reason=stop_reason))
    return RequestOutput(
        request_id=gen.service_req_id or gen.req_id, outputs=outputs, finished=gen.finished,
        num_prompt_tokens=gen.usage.num_prompt_tokens,
        num_generated_tokens=gen.usage.num_generated_tokens,
        num_cached_tokens=gen.usage.num_cached_tokens,
        num_accepted_prediction_tokens=gen.usage.num_accepted_prediction_tokens,
        num_rejected_prediction_tokens=gen.usage.num_rejected_prediction_tokens,
        prompt_token_ids=list(gen.prompt_token_ids) if len(gen.prompt_token_ids) else None,
        error_code=0 if code in (0, 200) else code, error_message=gen.gen_status.status_msg,
        unreachable_instance=gen.unreachable_instance,
        prompt_logprobs=[_logprob_from_proto(e) if e.HasField("data") else None
                         for e in gen.prompt_logprobs] if len(gen.prompt_logprobs) else None)
