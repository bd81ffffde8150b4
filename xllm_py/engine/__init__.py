"""The xllm-py engine: scheduler, KV cache manager, model runner and the engine process."""
