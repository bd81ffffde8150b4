"""Generated gRPC stubs (scripts/gen_protos.py) for protos/xllm.proto."""
from . import xllm_pb2, xllm_pb2_grpc

__all__ = ["xllm_pb2", "xllm_pb2_grpc"]
