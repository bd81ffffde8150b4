"""ServiceConfig: built from the master's command line, validated, and split into the
sub-configs its components take."""
from __future__ import annotations

import pytest

from xllm_service.config import RegistryConfig, RelayConfig, RouterConfig, ServiceConfig
from xllm_service.__main__ import main
from xllm_service.cli import build_parser, config_from_args


def test_defaults_match_the_flags_defaults():
    cfg = config_from_args(build_parser().parse_args(["--etcd", "e:1"]))
    assert cfg == ServiceConfig(etcd_addr="e:1")
    assert cfg.model_name == "gemma-3-270m"
    # no flags: the decision per request over SLO_AWARE, targets from the profiles
    assert cfg.router.slo_aware and cfg.router.conditional
    assert (cfg.router.ttft_slo_ms, cfg.router.tpot_slo_ms) == (None, None)


def test_flags_reach_their_sub_configs():
    cfg = config_from_args(build_parser().parse_args([
        "--etcd", "e:1", "--etcd_namespace", "ns/", "--etcd-ttl", "2", "--http-port", "1",
        "--rpc-port", "2", "--model", "/m/qwen/", "--max-model-len", "512",
        "--load-balance-policy", "cache_aware", "--evict-grace-s", "0.5",
        "--rpc-timeout", "7", "--request-idle-timeout", "9", "--tpot-slo-ms", "25"]))
    assert (cfg.etcd_namespace, cfg.etcd_ttl_s, cfg.http_port, cfg.rpc_port) == ("ns/", 2, 1, 2)
    assert cfg.model_name == "qwen" and cfg.max_model_len == 512
    assert cfg.router == RouterConfig(load_balance_policy="CACHE_AWARE", tpot_slo_ms=25)
    assert cfg.registry == RegistryConfig(evict_grace_s=0.5)
    assert cfg.relay == RelayConfig(rpc_timeout_s=7, idle_timeout_s=9)


@pytest.mark.parametrize("make", [
    lambda: RegistryConfig(evict_grace_s=-1), lambda: RegistryConfig(resync_backoff_s=()),
    lambda: RouterConfig(load_balance_policy="random"), lambda: RouterConfig(tpot_slo_ms=-1),
    lambda: RelayConfig(rpc_timeout_s=0),
    lambda: ServiceConfig(etcd_ttl_s=0), lambda: ServiceConfig(max_model_len=0)])
def test_invalid_values_raise(make):
    with pytest.raises(ValueError):
        make()


def test_a_bad_value_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--etcd", "e:1", "--rpc-timeout", "0"])
    assert e.value.code == 2 and "rpc_timeout_s must be > 0" in capsys.readouterr().err
