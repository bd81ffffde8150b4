"""Command line of the master: `python -m xllm_service --help` (flags) and `--config FILE`
(YAML: the flags and the settings listed at the end of --help); `config_from_args` turns
them into a ServiceConfig."""
from __future__ import annotations

import argparse

from xllm_py.api.limits import add_limit_flags, limits_from_args
from xllm_py.api.response_store import ResponseStoreLimits
from xllm_service.config import (ElasticConfig, RegistryConfig, RelayConfig, RouterConfig,
                                 ServiceConfig)
from xllm_py.model.catalog import DEFAULT_MODEL
from xllm_py.utils.cli import add_flag, etcd_endpoints
from xllm_py.utils.config_file import SettingsParser
from xllm_py.utils.security_cli import add_security_flags, security_from_args


def build_parser() -> SettingsParser:
    """The flags an operator sets; the rest are settings of --config FILE (listed at the
    end of --help), with defaults that suit a cluster as it comes."""
    p = SettingsParser(
        prog="python -m xllm_service",
        description="xllm_service: registry (etcd), master election, routing and the "
                    "OpenAI-compatible front door of an xllm-py cluster. Flags also accept "
                    "underscore spellings (--http_port, ...).")
    add_flag(p, "--etcd", "--etcd-addr", required=True, type=etcd_endpoints,
             help="etcd HOST:PORT, or the members of an etcd cluster: HOST:PORT,HOST:PORT,...")
    add_flag(p, "--etcd-namespace", default="", help="prefix for every etcd key")
    add_flag(p, "--etcd-ttl", type=float, default=3.0, help="lease TTL (s) of service keys")
    add_flag(p, "--host", default="127.0.0.1", help="address to bind")
    add_flag(p, "--advertise-host", default=None,
             help="address engines use to reach this service (default: the --host, or "
                  "with a wildcard one the machine's hostname)")
    add_flag(p, "--http-port", type=int, default=8888, help="OpenAI HTTP API port")
    add_flag(p, "--rpc-port", type=int, default=8889, help="XllmRpcService gRPC port")
    add_flag(p, "--model", default=DEFAULT_MODEL,
             help="the engines' model (its tokenizer and chat template): a model directory, a "
                  f".gguf file or a name ({DEFAULT_MODEL}, tiny, ...)")
    add_flag(p, "--served-model-name", default=None, help="model id in the API")
    add_flag(p, "--load-balance-policy", default="SLO_AWARE", type=str.upper,
             choices=["RR", "LEAST_LOAD", "CACHE_AWARE", "SLO_AWARE"],
             help="RR: round robin; LEAST_LOAD: fewest in-flight + waiting requests; "
                  "CACHE_AWARE: the longest cached prompt prefix (engines' heartbeat cache "
                  "events) among instances within 4 requests of the least loaded; "
                  "SLO_AWARE (default): over prefill/decode instances, the path and "
                  "instances whose predicted TTFT/TPOT (the latency profiles the engines "
                  "measure at start-up) meet the request's targets (else miss least); "
                  "without profiles CONDITIONAL's thresholds; CACHE_AWARE over MIX instances")
    add_flag(p, "--ttft-slo-ms", type=float, default=None,
             help="SLO_AWARE: TTFT target of a request without ttft_slo_ms (0: none; "
                  "default: a 2048-token prompt alone on the slowest prefill, by the profiles)")
    add_flag(p, "--tpot-slo-ms", type=float, default=None,
             help="SLO_AWARE: TPOT target of a request without tpot_slo_ms (0: none; "
                  "default: 1.25x a step of 8 streams of 1k context on the slowest decode)")
    add_flag(p, "--elastic-pd", default="off", choices=["off", "on"], type=str.lower,
             help="on: the master assigns the instances started MIX (each with a latency "
                  "profile) prefill or decode duty as the load shifts; off: every role "
                  "stays as started (an assignment in etcd can still pin one)")
    add_flag(p, "--batch-dir", default="",
             help="the Batch API's files and batches, shared by the cluster's services "
                  "(a shared volume across hosts; default: <temp dir>/xllm-batches/"
                  "<etcd namespace>)")
    add_limit_flags(p)
    p.move_to_file("--max-body-bytes", "--retry-after", "--trust-request-chat-template")
    add_flag(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_security_flags(p)
    _add_file_settings(p)
    return p


def _add_file_settings(p: SettingsParser) -> None:
    p.add_file_setting("--max-model-len", type=int, default=None,
                       help="context limit for validation (default: the model's "
                            "max_position_embeddings)")
    p.add_file_setting("--disagg-decision", default=None, type=str.upper,
                       choices=["ALWAYS", "CONDITIONAL"],
                       help="over prefill/decode instances: ALWAYS send the prompt to a "
                            "prefill instance, or decide per request (CONDITIONAL: short or "
                            "cached prompts, or all while prefill is busy, are prefilled on "
                            "the decode); unset: CONDITIONAL under SLO_AWARE, else ALWAYS")
    d = RouterConfig()
    p.add_file_setting("--local-prefill-max-tokens", type=int,
                       default=d.local_prefill_max_tokens,
                       help="CONDITIONAL: prefill on the decode when at most this many prompt "
                            "tokens are not in its prefix cache")
    p.add_file_setting("--pd-overhead-ms", type=float, default=d.pd_overhead_ms,
                       help="SLO_AWARE: TTFT added by disaggregation (KV pull, hand-over RPCs)")
    e = ElasticConfig()
    p.add_file_setting("--elastic-hold-s", type=float, default=e.hold_s,
                       help="--elastic-pd: a better split must be predicted this long before "
                            "instances flip")
    p.add_file_setting("--elastic-min-dwell-s", type=float, default=e.min_dwell_s,
                       help="--elastic-pd: the least time between two flips of one instance")
    p.add_file_setting("--elastic-margin", type=float, default=e.margin,
                       help="--elastic-pd: a flip must raise the predicted SLO attainment by this "
                            "fraction")
    p.add_file_setting("--elastic-utilization", type=float, default=e.utilization,
                       help="--elastic-pd: the share of a side's capacity the split plans to "
                            "use (the rest absorbs bursts)")
    p.add_file_setting("--elastic-max-step", type=int, default=e.max_step,
                       help="--elastic-pd: instances flipped in one decision round, at most")
    p.add_file_setting("--elastic-min-share", type=float, default=e.min_share,
                       help="--elastic-pd: each side keeps at least this share of the fleet")
    p.add_file_setting("--evict-grace-s", type=float, default=RegistryConfig().evict_grace_s,
                       help="seconds a dead instance stays SUSPECT before it is evicted")
    r = RelayConfig()
    p.add_file_setting("--rpc-timeout", type=float, default=r.rpc_timeout_s,
                       help="deadline of service RPCs (s)")
    p.add_file_setting("--request-idle-timeout", type=float, default=r.idle_timeout_s,
                       help="fail a request when its engine sends nothing for this long (s)")
    limits = ResponseStoreLimits()
    p.add_file_setting("--responses-max", type=int, default=limits.max_responses,
                       help="the Responses API's stored responses (in etcd): at most this "
                            "many, the oldest dropped first")
    p.add_file_setting("--responses-ttl-s", type=float, default=limits.ttl_s,
                       help="a stored response expires this long after it was written (s)")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The ServiceConfig of parsed flags (the only place flags become configuration)."""
    return ServiceConfig(
        etcd_addr=args.etcd, etcd_namespace=args.etcd_namespace, etcd_ttl_s=args.etcd_ttl,
        host=args.host, advertise_host=args.advertise_host, http_port=args.http_port,
        rpc_port=args.rpc_port, model=args.model, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        registry=RegistryConfig(evict_grace_s=args.evict_grace_s),
        router=RouterConfig(load_balance_policy=args.load_balance_policy,
                            disagg_decision=args.disagg_decision,
                            local_prefill_max_tokens=args.local_prefill_max_tokens,
                            pd_overhead_ms=args.pd_overhead_ms,
                            ttft_slo_ms=args.ttft_slo_ms,
                            tpot_slo_ms=args.tpot_slo_ms),
        relay=RelayConfig(rpc_timeout_s=args.rpc_timeout,
                          idle_timeout_s=args.request_idle_timeout),
        elastic=ElasticConfig(enabled=args.elastic_pd == "on", hold_s=args.elastic_hold_s,
                              min_dwell_s=args.elastic_min_dwell_s,
                              margin=args.elastic_margin,
                              utilization=args.elastic_utilization,
                              max_step=args.elastic_max_step,
                              min_share=args.elastic_min_share),
        security=security_from_args(args),
        api=limits_from_args(args), batch_dir=args.batch_dir,
        responses=ResponseStoreLimits(max_responses=args.responses_max,
                                      ttl_s=args.responses_ttl_s))
