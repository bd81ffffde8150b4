"""ServiceConfig: built from the master's command line, validated, and split into the
sub-configs its components take."""
from __future__ import annotations

import pytest

from xllm_py.api.response_store import ResponseStoreLimits
from xllm_py.utils.config_file import write_settings
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


def test_flags_and_file_settings_reach_their_sub_configs(tmp_path):
    settings = write_settings(tmp_path / "s.yaml", {
        "max_model_len": 512, "evict_grace_s": 0.5, "rpc_timeout": 7, "request_idle_timeout": 9,
        "disagg_decision": "always", "local_prefill_max_tokens": 64, "pd_overhead_ms": 5,
        "responses_max": 3, "responses_ttl_s": 60, "max_body_bytes": 1024, "retry_after": 2,
        "trust_request_chat_template": True})
    cfg = config_from_args(build_parser().parse_args([
        "--etcd", "e:1", "--etcd_namespace", "ns/", "--etcd-ttl", "2", "--http-port", "1",
        "--rpc-port", "2", "--model", "/m/qwen/", "--load-balance-policy", "cache_aware",
        "--tpot-slo-ms", "25", "--max-pending-requests", "7", *settings]))
    assert (cfg.etcd_namespace, cfg.etcd_ttl_s, cfg.http_port, cfg.rpc_port) == ("ns/", 2, 1, 2)
    assert cfg.model_name == "qwen" and cfg.max_model_len == 512
    assert cfg.router == RouterConfig(load_balance_policy="CACHE_AWARE", tpot_slo_ms=25,
                                      disagg_decision="ALWAYS", local_prefill_max_tokens=64,
                                      pd_overhead_ms=5)
    assert cfg.registry == RegistryConfig(evict_grace_s=0.5)
    assert cfg.relay == RelayConfig(rpc_timeout_s=7, idle_timeout_s=9)
    assert cfg.responses == ResponseStoreLimits(max_responses=3, ttl_s=60)
    assert (cfg.api.max_pending_requests, cfg.api.max_body_bytes, cfg.api.retry_after_s,
            cfg.api.trust_request_chat_template) == (7, 1024, 2, True)


def test_help_lists_at_most_27_flags_each_with_its_help():
    text = build_parser().format_help()
    flags_part = text.split("settings of --config FILE only")[0]
    flags = [ln.split()[0] for ln in flags_part.splitlines() if ln.startswith("  --")]
    assert len(flags) <= 27 and "--config" in flags and "--pd-overhead-ms" not in flags


@pytest.mark.parametrize("make", [
    lambda: RegistryConfig(evict_grace_s=-1), lambda: RegistryConfig(resync_backoff_s=()),
    lambda: RouterConfig(load_balance_policy="random"), lambda: RouterConfig(tpot_slo_ms=-1),
    lambda: RelayConfig(rpc_timeout_s=0),
    lambda: ServiceConfig(etcd_ttl_s=0), lambda: ServiceConfig(max_model_len=0)])
def test_invalid_values_raise(make):
    with pytest.raises(ValueError):
        make()


def test_a_bad_value_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--etcd", "e:1", *write_settings(tmp_path / "s.yaml", {"rpc_timeout": 0})])
    assert e.value.code == 2 and "rpc_timeout_s must be > 0" in capsys.readouterr().err


def test_elastic_pd_flag_and_its_settings(tmp_path):
    cfg = config_from_args(build_parser().parse_args(["--etcd", "e:1", "--elastic-pd", "ON"]))
    assert cfg.elastic.enabled
    cfg = config_from_args(build_parser().parse_args(["--etcd", "e:1", *write_settings(
        tmp_path / "e.yaml", {"elastic_utilization": 0.7, "elastic_max_step": 2,
                              "elastic_min_share": 0.125})]))
    assert (cfg.elastic.utilization, cfg.elastic.max_step, cfg.elastic.min_share) == (
        0.7, 2, 0.125)
    for bad in ({"elastic_utilization": 1.5}, {"elastic_max_step": 0},
                {"elastic_min_share": 0.5}):
        with pytest.raises(ValueError, match="elastic: "):
            config_from_args(build_parser().parse_args(
                ["--etcd", "e:1", *write_settings(tmp_path / "bad.yaml", bad)]))
    assert not config_from_args(build_parser().parse_args(["--etcd", "e:1"])).elastic.enabled
