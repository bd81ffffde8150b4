"""Config dataclasses: validation, env overrides, advertised addresses, the engine's
command line and settings file."""
import pathlib
import re
import socket

import pytest

from xllm_py.cluster.prefill_order import ORDERS
from xllm_py.config import (PREFILL_ORDERS, CacheConfig, InstanceRole, KernelConfig,
                            PDSchedulerConfig, SchedulerConfig, UCXConfig, advertised_host,
                            etcd_credentials_from_env, model_cache_dir_from_env)
from xllm_py.engine.cli import build_parser, config_from_args
from xllm_py.engine.model_setup import HOST_POOL_BYTES, kv_pool_bytes
from xllm_py.utils.config_file import write_settings


def test_validation_messages():
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="unknown instance role 'both'"):
        InstanceRole.parse("both")
    assert InstanceRole.parse("decode") is InstanceRole.DECODE


def test_advertised_host_never_a_wildcard():
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"
    assert advertised_host("0.0.0.0", "pod-7.svc") == "pod-7.svc"
    assert advertised_host("0.0.0.0", None) == socket.gethostname()
    assert advertised_host("::", None) == socket.gethostname()


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("ETCD_USERNAME", "u")
    with pytest.raises(ValueError, match="both ETCD_USERNAME and ETCD_PASSWORD"):
        etcd_credentials_from_env()
    monkeypatch.setenv("ETCD_PASSWORD", "p")
    assert etcd_credentials_from_env() == ("u", "p")


def test_ucx_kernel_and_model_settings_from_env(monkeypatch):
    assert UCXConfig.from_env().map_peer_pools and KernelConfig.from_env().enabled  # (unset: on)
    monkeypatch.setenv("XLLM_UCX_MAP", "off")
    monkeypatch.setenv("XLLM_UCX_IOV_TLS", "self")
    monkeypatch.setenv("UCXPY_ENABLE_PYTHON_FUTURE", "0")
    ucx = UCXConfig.from_env(warmup_pulls=3)
    assert not ucx.map_peer_pools and dict(ucx.iov_overrides)["TLS"] == "self" and not ucx.python_future
    assert ucx.warmup_pulls == 3 and ucx.progress_mode == "thread"
    assert config_from_args(build_parser().parse_args([])).transfer.ucx == UCXConfig.from_env()
    with pytest.raises(ValueError, match="direct_max_msgs"):
        UCXConfig(direct_max_msgs=0)
    monkeypatch.setenv("XLLM_CPU_KERNELS", "0")
    monkeypatch.setenv("XLLM_KERNEL_CACHE", "/tmp/k")
    monkeypatch.setenv("CC", "clang")
    monkeypatch.delenv("XLLM_CPU_ISA", raising=False)
    assert KernelConfig.from_env() == KernelConfig(enabled=False, cache_dir="/tmp/k", cc="clang")
    monkeypatch.setenv("XLLM_CPU_ISA", "AVX2")
    assert KernelConfig.from_env().isa == "avx2"
    monkeypatch.setenv("XLLM_CPU_ISA", "auto")
    assert KernelConfig.from_env().isa is None
    monkeypatch.setenv("XLLM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="XLLM_CPU_ISA"):
        KernelConfig.from_env()
    monkeypatch.setenv("XLLM_CACHE_DIR", "/tmp/m")
    assert model_cache_dir_from_env() == "/tmp/m"


def test_environment_is_read_in_config_only():
    root = pathlib.Path(__file__).resolve().parents[3]
    readers = [f"{path.relative_to(root)}:{n}"
               for pkg in ("xllm_py", "xllm_service") for path in sorted((root / pkg).rglob("*.py"))
               if path != root / "xllm_py" / "config.py"
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"os\.environ|getenv", line)]
    assert readers == [], "environment variables are read in xllm_py/config.py only"


def test_cli_accepts_xllm_spellings():
    args = build_parser().parse_args([
        "--instance_role", "PREFILL", "--block_size", "32", "--etcd_addr", "127.0.0.1:2379",
        "--kv_cache_transfer_mode", "push", "--advertise-host", "node-1", "--host", "0.0.0.0"])
    cfg = config_from_args(args)
    assert cfg.role is InstanceRole.PREFILL and cfg.cache.block_size == 32
    assert cfg.etcd_addr == "127.0.0.1:2379" and cfg.transfer.mode.value == "PUSH"
    assert cfg.advertise_host == "node-1"


def test_settings_file_of_the_engine(tmp_path):
    default = config_from_args(build_parser().parse_args([]))
    assert default.num_threads is None and default.pack_weights is True
    assert default.pd == PDSchedulerConfig() and default.cache.kv_cache_memory_bytes is None
    settings = write_settings(tmp_path / "s.yaml", {
        "num_threads": 3, "pack_weights": False, "kv_cache_memory_mb": 512,
        "transfer_timeout": 5, "rpc_timeout": 3,
        "pd_prefill_order": "fcfs", "pd_max_dispatching": 8, "etcd_ttl": 2})
    cfg = config_from_args(build_parser().parse_args([*settings, "--num-blocks", "64"]))
    assert cfg.num_threads == 3 and cfg.pack_weights is False and cfg.cache.num_blocks == 64
    assert cfg.cache.kv_cache_memory_bytes == 512 << 20 and cfg.rpc_timeout_s == 3
    assert (cfg.transfer.timeout_s, cfg.etcd_ttl_s) == (5, 2)
    assert cfg.pd == PDSchedulerConfig(prefill_order="fcfs", max_dispatching=8)
    assert set(PREFILL_ORDERS) == set(ORDERS)
    with pytest.raises(SystemExit):  # a setting of the file, not a flag
        build_parser().parse_args(["--batch-window-ms", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(write_settings(tmp_path / "b.yaml", {"pd_prefill_order": "x"}))


def test_engine_help_lists_at_most_40_flags():
    lines = build_parser().format_help().split("settings of --config FILE")[0].splitlines()
    flags = [x for x in lines if re.match(r"\s+--", x)]
    assert len(flags) <= 40, flags


def test_the_kv_pool_is_sized_from_the_memory_there_is(monkeypatch):
    import xllm_py.engine.model_setup as setup

    assert kv_pool_bytes(CacheConfig(kv_cache_memory_bytes=1 << 30), 80 << 30) == 1 << 30
    assert kv_pool_bytes(CacheConfig(), 10 << 30) == int(0.9 * (10 << 30))  # a GPU: its free memory
    monkeypatch.setattr(setup, "available_memory_bytes", lambda: 64 << 30)
    assert kv_pool_bytes(CacheConfig(), None) == HOST_POOL_BYTES
    monkeypatch.setattr(setup, "available_memory_bytes", lambda: 512 << 20)  # short of memory
    assert kv_pool_bytes(CacheConfig(), None) == 128 << 20
    monkeypatch.setattr(setup, "available_memory_bytes", lambda: 0)  # unknown
    assert kv_pool_bytes(CacheConfig(), None) == HOST_POOL_BYTES
