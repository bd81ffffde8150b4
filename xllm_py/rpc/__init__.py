"""Conversions between domain objects and the protobuf messages of protos/xllm.proto."""
