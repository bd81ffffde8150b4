"""Bulk vs streamed PD hand-over (engine/pd/kv_stream.py): what is left to move after the
first token, and TTFT, at prompt lengths.

    python benchmarks/bench_kv_transfer.py --stream [--lengths 256 1024 4096] [--rounds 3]
        [--backend tcp|ucx] [--chunk 512] [--model DIR] [--json]

The model: ``--model``, else the ``tiny`` preset's shape with an 8192-token context,
written into the logs directory (the preset stops at 2048). Two PD clusters on loopback
(one embedded etcd, two namespaces), each a service, one PREFILL and one DECODE in PUSH
mode with a step budget of ``--chunk`` tokens (chunked prefill): "bulk" never streams
(``kv_stream_min_tokens: 0``), "stream" streams every prompt (1). Per length and round,
one request to each, interleaved (the order flips every round), each a prompt of fresh
random ids (no prefix hits, in the pool or the tiers), 2 tokens out, streamed. Figures
(medians over rounds): TTFT at the client (send to first token chunk) and the hand-over
after the first token, from the prefill's log line (the last push plus FirstGeneration
until the decode took over), and their stream / bulk ratios.
"""
from __future__ import annotations

import argparse
import json
import random
import pathlib
import re
import statistics
import sys
import tempfile
import time

import httpx

from benchmarks.common import random_token_prompts, report_environment

_HANDED = re.compile(r"PD prefill handed request \S+ to \S+: (\d+) blocks \((\d+) streamed.*"
                     r" in ([\d.]+) ms")


def _cluster(etcd: str, tag: str, args, logs: pathlib.Path, stream_min: int) -> list:
    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import engine_args, free_port, spawn

    hp, rp = free_port(), free_port()
    svc = spawn(f"service-{tag}", "xllm_service", [
        "--model", args.model, "--etcd", etcd, "--etcd-namespace", f"{tag}/",
        "--http-port", str(hp), "--rpc-port", str(rp), "--load-balance-policy", "LEAST_LOAD",
        "--etcd-ttl", "15", *write_settings(logs / f"service-{tag}.yaml", {"evict_grace_s": 10})],
        logs, http_url=f"http://127.0.0.1:{hp}")
    procs = [svc]
    for role in ("PREFILL", "DECODE"):
        port = free_port()
        procs.append(spawn(f"{role.lower()}-{tag}", "xllm_py.engine", engine_args(
            role, port, etcd=etcd, model=args.model, extra=[
                "--etcd-namespace", f"{tag}/", *write_settings(
                    logs / f"{role.lower()}-{tag}.yaml",
                    {"etcd_ttl": 15, "latency_profile": "off",
                     "kv_stream_min_tokens": stream_min}),
                "--kv-cache-transfer-mode", "PUSH", "--kv-transfer-backend", args.backend,
                "--max-num-batched-tokens", str(args.chunk), "--max-num-seqs", "8",
                "--max-model-len", str(max(args.lengths) + 64)]),
            logs, http_url=f"http://127.0.0.1:{port}"))
    return procs


def _request(svc_url: str, model: str, prompt: list[int], prefill_log: pathlib.Path) -> dict:
    seen = len(_HANDED.findall(prefill_log.read_text(errors="replace")))
    t0 = time.monotonic()
    ttft = None
    with httpx.stream("POST", f"{svc_url}/v1/completions", trust_env=False, timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and ttft is None:
                ttft = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while True:  # the prefill logs the hand-over once the decode confirmed it
        found = _HANDED.findall(prefill_log.read_text(errors="replace"))
        if len(found) > seen or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(found) <= seen:
        raise RuntimeError(f"no hand-over logged in {prefill_log}")
    blocks, streamed, ms = found[-1]
    return {"ttft_ms": ttft * 1000, "handover_ms": float(ms), "blocks": int(blocks),
            "streamed": int(streamed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_kv_transfer.py --stream",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="tcp", choices=("tcp", "ucx"))
    ap.add_argument("--chunk", type=int, default=512, help="the prefill's step budget (tokens)")
    ap.add_argument("--model", default=None, help="a model directory (default: see above)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from xllm_py.cluster.etcd_server import EmbeddedEtcd

    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-kv-stream-"))
    if args.model is None:
        from xllm_py.model.tiny import PRESETS, build_model_dir

        args.model = str(build_model_dir(logs / "tiny-8k", max_position_embeddings=8192,
                                         **PRESETS["tiny"]))
    name = pathlib.Path(args.model).name
    etcd = EmbeddedEtcd().start()
    variants = {"bulk": 0, "stream": 1}
    procs: dict[str, list] = {}
    results: dict = {"backend": args.backend, "chunk": args.chunk, "model": args.model,
                     "logs": str(logs), "lengths": {}}
    try:
        for variant, stream_min in variants.items():
            procs[variant] = _cluster(etcd.endpoint, f"stream-{variant}", args, logs, stream_min)
        for variant in variants:
            for p in procs[variant][1:]:
                p.wait_ready(300)
            procs[variant][0].wait_ready(120, path="/readiness")
            svc = procs[variant][0].http_url  # warm-up: links, first transfers
            _request(svc, name, random_token_prompts(1, 64, 500, seed=1)[0],
                     procs[variant][1].log_path)
        # fresh prompts every run: the disk KV tier outlives the engines, and a prefix it
        # holds would be loaded, not computed (and so not streamed)
        seed = random.SystemRandom().randrange(1 << 30)
        for length in args.lengths:
            runs: dict[str, list[dict]] = {n: [] for n in variants}
            for rnd in range(args.rounds):
                order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
                for variant in order:
                    seed += 1
                    prompt = random_token_prompts(1, length, 500, seed=seed)[0]
                    runs[variant].append(_request(procs[variant][0].http_url, name, prompt,
                                                  procs[variant][1].log_path))
            row = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                   for n, rs in runs.items()}
            row["handover_ratio"] = row["stream"]["handover_ms"] / max(row["bulk"]["handover_ms"], 1e-9)
            row["ttft_ratio"] = row["stream"]["ttft_ms"] / row["bulk"]["ttft_ms"]
            results["lengths"][length] = row
            if not args.json:
                b, s = row["bulk"], row["stream"]
                print(f"{length:>6} tokens: hand-over after first token bulk {b['handover_ms']:.1f} "
                      f"ms, stream {s['handover_ms']:.1f} ms ({row['handover_ratio']:.2f}x; "
                      f"{s['streamed']:.0f}/{s['blocks']:.0f} blocks streamed); TTFT bulk "
                      f"{b['ttft_ms']:.0f} ms, stream {s['ttft_ms']:.0f} ms "
                      f"({row['ttft_ratio']:.2f}x)", flush=True)
    finally:
        for ps in procs.values():
            for p in reversed(ps):
                p.terminate()
        etcd.stop()
    report_environment(results, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
