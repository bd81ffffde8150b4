"""UCX (UCXX) KV transfer backend. Importing this package does not import ucxx."""
from xllm_py.kv_transfer.ucx.env import UCX_ENV_DEFAULTS_CPU, apply_ucx_env_defaults, ucx_env

__all__ = ["UCX_ENV_DEFAULTS_CPU", "apply_ucx_env_defaults", "ucx_env", "UcxKVTransferBackend"]


def __getattr__(name: str):
    if name == "UcxKVTransferBackend":
        from xllm_py.kv_transfer.ucx.backend import UcxKVTransferBackend
        return UcxKVTransferBackend
    raise AttributeError(name)
