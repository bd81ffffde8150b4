"""xllm_service: the master of an xllm-py cluster (registry, routing, OpenAI front door)."""
