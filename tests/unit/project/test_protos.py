"""The committed stubs must match protos/*.proto (run scripts/gen_protos.py after editing)."""
import pathlib
import sys

from google.protobuf import descriptor_pb2

from xllm_py.structured.spec import GrammarSpec

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_generated_stubs_are_fresh(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    gen_protos.generate(tmp_path)
    from xllm_py.proto import xllm_pb2

    committed = descriptor_pb2.FileDescriptorProto.FromString(xllm_pb2.DESCRIPTOR.serialized_pb)
    fresh_text = (tmp_path / "xllm_pb2.py").read_text()
    namespace: dict = {}
    # Compare descriptors, not text: the header differs between grpcio-tools versions.
    start = fresh_text.index("AddSerializedFile(b") + len("AddSerializedFile(")
    end = fresh_text.index(")\n", start)
    fresh = descriptor_pb2.FileDescriptorProto.FromString(eval(fresh_text[start:end], namespace))
    assert committed == fresh, "xllm_py/proto is stale: run python scripts/gen_protos.py"
    committed_grpc = (ROOT / "xllm_py/proto/xllm_pb2_grpc.py").read_text()
    for service in ("XllmRpcService", "DisaggPDService", "WorkerService"):
        assert f"class {service}Servicer" in committed_grpc


def test_services_expose_xllm_rpcs():
    from xllm_py.proto import xllm_pb2

    services = xllm_pb2.DESCRIPTOR.services_by_name
    assert set(services["XllmRpcService"].methods_by_name) >= {
        "RegisterInstance", "GetInstanceInfo", "Heartbeat",
        "GetStaticDecodeList", "GetStaticPrefillList", "Generations",
    }
    assert set(services["DisaggPDService"].methods_by_name) >= {
        "AddNewRequests", "FirstGeneration", "MultiGenerations",
        "SendPullSignal", "LinkInstance", "UnlinkInstance",
    }
    assert set(services["WorkerService"].methods_by_name) >= {
        "PullKVCache", "LinkCluster", "UnlinkCluster", "GetCacheInfo",
    }


# A valid value other than the default for every SamplingParams field (floats exact in
# float32). A field missing here fails test_every_sampling_param_survives_the_wire.
_NON_DEFAULT = {
    "n": 2, "best_of": 3, "temperature": 0.5, "top_p": 0.75, "top_k": 7, "min_p": 0.125,
    "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.5,
    "seed": 1234, "max_tokens": 40, "min_tokens": 5, "stop": ["END", "\n\n"],
    "stop_token_ids": [3, 9], "ignore_eos": True, "logprobs": 4, "prompt_logprobs": 0,
    "echo": True, "skip_special_tokens": False, "include_stop_str_in_output": True,
    "eos_token_ids": [2, 11], "logit_bias": {5: 100.0, 7: -2.5},
    "structured": GrammarSpec("json", '{"type":"object"}', ""),
    "allowed_token_ids": [5, 9, 300],
    "bad_words_token_ids": [[7], [8, 9, 10]],
    "prediction_token_ids": [4, 5, 6],
}


def _round_trip(params):
    from xllm_py.proto import xllm_pb2
    from xllm_py.rpc.convert import EngineRequestSpec, spec_from_proto, spec_to_proto

    spec = EngineRequestSpec(request_id="r1", service_request_id="s1",
                             prompt_token_ids=[1, 2, 3], params=params)
    wire = spec_to_proto(spec).SerializeToString()
    return spec_from_proto(xllm_pb2.DisaggRequest.FromString(wire)).params


def test_every_sampling_param_survives_the_wire():
    import dataclasses

    from xllm_py.sampling_params import SamplingParams

    default = SamplingParams()
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert set(_NON_DEFAULT) == set(fields), "give the new SamplingParams field a value here"
    assert _round_trip(default) == default
    for name in fields:  # one field at a time: the others keep their defaults
        value = _NON_DEFAULT[name]
        assert value != getattr(default, name), name
        extra = {"n": 2} if name == "best_of" else {}
        params = SamplingParams(**{name: value}, **extra)
        assert getattr(_round_trip(params), name) == value, f"{name} is dropped by convert.py"
    everything = SamplingParams(**_NON_DEFAULT)
    assert _round_trip(everything) == everything


def test_max_tokens_zero_and_unset_stay_apart_on_the_wire():
    from xllm_py.sampling_params import SamplingParams

    zero = SamplingParams(max_tokens=0, prompt_logprobs=1)
    assert _round_trip(zero).max_tokens == 0
    assert _round_trip(SamplingParams(prompt_logprobs=1)).max_tokens is None


def test_max_tokens_zero_from_a_sender_without_the_flag_means_unset():
    from xllm_py.proto import xllm_pb2
    from xllm_py.rpc.convert import params_from_proto

    assert params_from_proto(xllm_pb2.DisaggRequest(max_tokens=0)).max_tokens is None
    assert params_from_proto(xllm_pb2.DisaggRequest(max_tokens=7)).max_tokens == 7


def test_request_output_with_prompt_logprobs_round_trips():
    import dataclasses

    from xllm_py.outputs import CompletionDelta, RequestOutput, TokenLogprob
    from xllm_py.proto import xllm_pb2
    from xllm_py.rpc.convert import output_from_proto, output_to_proto

    out = RequestOutput(
        request_id="r1", finished=False, num_prompt_tokens=3, num_generated_tokens=1,
        num_accepted_prediction_tokens=5, num_rejected_prediction_tokens=2,
        prompt_token_ids=[4, 9, 2],
        prompt_logprobs=[None, TokenLogprob(9, -1.5, [(3, -0.25), (9, -1.5)]),
                         TokenLogprob(2, -0.75, [])],
        outputs=[CompletionDelta(index=0, text="x", token_ids=[8],
                                 logprobs=[TokenLogprob(8, -0.5, [(8, -0.5)])])])
    wire = output_to_proto(out, "r1").SerializeToString()
    back = output_from_proto(xllm_pb2.DisaggStreamGeneration.FromString(wire))
    assert back == out
    later = dataclasses.replace(out, prompt_token_ids=None, prompt_logprobs=None)
    wire = output_to_proto(later, "r1").SerializeToString()
    assert output_from_proto(xllm_pb2.DisaggStreamGeneration.FromString(wire)) == later
    # stop_reason (vLLM's): a stop string, a stop token id (0 included), or none
    for reason in ("\n\n", 0, 7, None):
        ended = dataclasses.replace(later, finished=True, outputs=[CompletionDelta(
            index=0, text="", token_ids=[8], finish_reason="stop", stop_reason=reason)])
        wire = output_to_proto(ended, "r1").SerializeToString()
        assert output_from_proto(xllm_pb2.DisaggStreamGeneration.FromString(wire)) == ended


def test_pyproject_requires_what_the_generated_stubs_check_at_import():
    """The stubs refuse older grpcio / protobuf at import (a GPU image with grpcio 1.84
    failed so): the declared lower bounds must be at least the generators' versions."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[3]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]

    def lower_bound(name: str) -> tuple[int, ...]:
        spec = next(d for d in deps if re.match(rf"{name}\s*>=", d))
        return tuple(int(x) for x in spec.split(">=")[1].split(",")[0].strip().split("."))

    grpc_stub = (root / "xllm_py/proto/xllm_pb2_grpc.py").read_text()
    grpc_needed = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    assert lower_bound("grpcio") >= tuple(int(x) for x in grpc_needed.split("."))
    pb_stub = (root / "xllm_py/proto/xllm_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                  r"\s*(\d+),\s*(\d+),\s*(\d+),", pb_stub)
    assert lower_bound("protobuf") >= tuple(int(x) for x in m.groups())


def test_latency_targets_travel_and_negative_ones_are_refused():
    import pytest

    from xllm_py.proto import xllm_pb2
    from xllm_py.rpc.convert import EngineRequestSpec, spec_from_proto, spec_to_proto
    from xllm_py.sampling_params import SamplingParams

    spec = EngineRequestSpec(request_id="r1", service_request_id="s1", prompt_token_ids=[1],
                             params=SamplingParams(), ttft_slo_ms=2500, tpot_slo_ms=50)
    back = spec_from_proto(xllm_pb2.DisaggRequest.FromString(spec_to_proto(spec).SerializeToString()))
    assert (back.ttft_slo_ms, back.tpot_slo_ms) == (2500, 50)
    msg = spec_to_proto(spec)
    msg.ttft_slo = -1
    with pytest.raises(ValueError, match="ttft_slo and tpot_slo must be >= 0"):
        spec_from_proto(msg)


def test_offline_and_the_tpot_target_survive_the_wire():
    from xllm_py.proto import xllm_pb2
    from xllm_py.rpc.convert import EngineRequestSpec, spec_from_proto, spec_to_proto
    from xllm_py.sampling_params import SamplingParams

    for offline in (True, False):
        spec = EngineRequestSpec("r", "s", [1, 2], SamplingParams(), offline=offline,
                                 tpot_slo_ms=25)
        back = spec_from_proto(xllm_pb2.DisaggRequest.FromString(
            spec_to_proto(spec).SerializeToString()))
        assert (back.offline, back.tpot_slo_ms) == (offline, 25)
