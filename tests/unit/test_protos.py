"""The committed stubs must match protos/*.proto (run scripts/gen_protos.py after editing)."""
import pathlib
import sys

from google.protobuf import descriptor_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
