"""What the hybrid KV cache (engine/hybrid_kv.py) saves on Gemma 3: the bytes of a PD
hand-over and the requests one decode pool holds, before and after, in one run.

    python benchmarks/bench_kv_transfer.py --hybrid-kv [--model gemma-3-270m] [--prompt-tokens 2000]
        [--block-size 16] [--mode PULL|PUSH] [--kv-cache-memory-mb 256]
        [--context 4000] [--no-cluster] [--json]

"Before" is the same checkpoint with every layer declared full attention (a twin model
directory: the same files, its config.json's ``layer_types`` all ``full_attention``):
what the pool held before sliding-window layers got blocks of their own (one table,
every layer's KV for the whole context). Its tokens differ; its KV bytes are those of
the old layout.

1. Hand-over: a service, one PREFILL and one DECODE (real etcd, gRPC, the KV workers)
   per variant; one request of ``--prompt-tokens`` random ids, max_tokens 2; the bytes
   from ``xllm_kv_transfer_bytes_total`` of the engine that moved them (PULL: the
   decode; PUSH: the prefill), and their ratio (expected at 2000 tokens, block 16:
   (3 x 125 + 15 x 32) / (18 x 125), the decode's first token reading 32 blocks of
   each sliding layer).
2. Capacity: a decode pool of ``--kv-cache-memory-mb`` (sized as the engine sizes it,
   model_setup.py), filled through the scheduler's own admission (allocate_for_remote,
   as a decode takes prompts from a prefill) with ``--context``-token prompts until
   one no longer fits: how many it holds at once.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import httpx

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import random_token_prompts, report_environment  # noqa: E402
from xllm_py.config import CacheConfig, SchedulerConfig  # noqa: E402
from xllm_py.engine.scheduler import ContinuousScheduler  # noqa: E402
from xllm_py.model.catalog import resolve_model  # noqa: E402
from xllm_py.model.config import FULL, ModelConfig  # noqa: E402
from xllm_py.model.kv_groups import kv_groups  # noqa: E402
from xllm_py.request import Request  # noqa: E402
from xllm_py.sampling_params import SamplingParams  # noqa: E402


def full_attention_twin(model_dir: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """The checkpoint's files linked, its config.json with every layer full attention."""
    into.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["layer_types"] = [FULL] * int(cfg["num_hidden_layers"])
    (into / "config.json").write_text(json.dumps(cfg, indent=2))
    return into


def pool_capacity(model_dir: pathlib.Path, memory_mb: int, block_size: int,
                  context: int) -> dict:
    """Blocks of a pool of `memory_mb` (float32 KV) and the `context`-token prompts a
    decode admits into it at once."""
    mc = ModelConfig.from_dir(model_dir)
    groups = kv_groups([mc.layer_window(i) for i in range(mc.num_layers)])
    block_bytes = 2 * groups.num_slots * block_size * mc.num_kv_heads * mc.head_dim * 4
    num_blocks = max(2, memory_mb * 1024 * 1024 // block_bytes)
    sched = ContinuousScheduler(SchedulerConfig(max_num_seqs=1024, max_model_len=context + 8),
                                CacheConfig(block_size=block_size, enable_prefix_caching=False),
                                num_blocks, group_windows=groups.group_windows)
    held = 0
    while sched.remote.allocate_for_remote(Request(f"r{held}", [7] * context,
                                            SamplingParams(max_tokens=8))) is not None:
        held += 1
    return {"kv_slots": groups.num_slots, "kv_groups": len(groups.group_windows),
            "block_bytes": block_bytes, "num_blocks": num_blocks, "requests_held": held}


def _bytes_moved(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return int(sum(float(v) for v in re.findall(
        r"^xllm_kv_transfer_bytes_total\{[^}]*\} (\S+)$", text, re.M)))


def handover_bytes(model_dir: pathlib.Path, etcd: str, args, logs: pathlib.Path,
                   tag: str) -> dict:
    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import engine_args, free_port, spawn

    procs = []
    try:
        hp, rp = free_port(), free_port()
        svc = spawn(f"service-{tag}", "xllm_service", [
            "--model", str(model_dir), "--etcd", etcd, "--etcd-namespace", f"{tag}/",
            "--http-port", str(hp), "--rpc-port", str(rp), "--load-balance-policy",
            "LEAST_LOAD", "--etcd-ttl", "15",
            *write_settings(logs / f"service-{tag}.yaml", {"evict_grace_s": 10})],
            logs, http_url=f"http://127.0.0.1:{hp}")
        procs.append(svc)
        engines = {}
        for role in ("PREFILL", "DECODE"):
            port = free_port()
            engines[role] = spawn(f"{role.lower()}-{tag}", "xllm_py.engine", engine_args(
                role, port, etcd=etcd, model=str(model_dir), extra=[
                    "--etcd-namespace", f"{tag}/", *write_settings(
                        logs / f"{role.lower()}-{tag}.yaml",
                        {"etcd_ttl": 15, "latency_profile": "off"}),
                    "--block-size", str(args.block_size), "--kv-cache-transfer-mode", args.mode,
                    "--max-model-len", str(args.prompt_tokens + 64)]),
                logs, http_url=f"http://127.0.0.1:{port}")
            procs.append(engines[role])
        for p in engines.values():
            p.wait_ready(300)
        svc.wait_ready(120, path="/readiness")
        mover = engines["DECODE" if args.mode == "PULL" else "PREFILL"].http_url
        before = _bytes_moved(mover)
        prompt = random_token_prompts(1, args.prompt_tokens, 262_144, seed=5)[0]
        t0 = time.monotonic()
        r = httpx.post(f"{svc.http_url}/v1/completions", trust_env=False, timeout=600, json={
            "model": model_dir.name, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        moved = _bytes_moved(mover) - before
        if moved <= 0:
            raise RuntimeError(f"{tag}: no KV was handed over (logs in {logs})")
        return {"bytes": moved, "seconds": time.monotonic() - t0}
    finally:
        for p in reversed(procs):
            p.terminate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_kv_transfer.py --hybrid-kv",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mode", default="PULL", choices=("PULL", "PUSH"))
    ap.add_argument("--kv-cache-memory-mb", type=int, default=256)
    ap.add_argument("--context", type=int, default=4000, help="prompt tokens of part 2")
    ap.add_argument("--no-cluster", action="store_true", help="part 2 only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    hybrid = pathlib.Path(resolve_model(args.model))
    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-hybrid-kv-"))
    twin = full_attention_twin(hybrid, logs / "full-attention-twin")
    variants = {"before": twin, "after": hybrid}
    result: dict = {"model": args.model, "block_size": args.block_size, "logs": str(logs),
                    "capacity": {k: pool_capacity(d, args.kv_cache_memory_mb, args.block_size,
                                                  args.context) for k, d in variants.items()}}
    cap = result["capacity"]
    result["capacity_ratio"] = cap["after"]["requests_held"] / max(1, cap["before"]["requests_held"])
    if not args.no_cluster:
        from xllm_py.cluster.etcd_server import EmbeddedEtcd

        etcd = EmbeddedEtcd().start()
        try:
            moved = {k: handover_bytes(d, etcd.endpoint, args, logs, f"hybrid-{k}")
                     for k, d in variants.items()}
        finally:
            etcd.stop()
        result["handover"] = moved
        result["handover_ratio"] = moved["after"]["bytes"] / max(1, moved["before"]["bytes"])
    report_environment(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
        return 0
    if "handover" in result:
        h = result["handover"]
        print(f"hand-over of a {args.prompt_tokens}-token prompt ({args.mode}, block "
              f"{args.block_size}): before {h['before']['bytes']} bytes, after "
              f"{h['after']['bytes']} bytes: {result['handover_ratio']:.3f}x")
    print(f"decode pool of {args.kv_cache_memory_mb} MB: {args.context}-token requests held "
          f"at once: before {cap['before']['requests_held']} ({cap['before']['num_blocks']} "
          f"blocks of {cap['before']['block_bytes']} B), after {cap['after']['requests_held']} "
          f"({cap['after']['num_blocks']} blocks of {cap['after']['block_bytes']} B): "
          f"{result['capacity_ratio']:.2f}x")
    return 0

