"""Bulk vs streamed PD hand-over (engine/pd/kv_stream.py): what is left to move after the
first token, and TTFT, at prompt lengths.

    python benchmarks/bench_kv_transfer.py --stream [--lengths 256 1024 4096] [--rounds 3]
        [--backend tcp|ucx] [--chunk 512] [--model DIR] [--rate-mbit R ...] [--json]

The model: ``--model``, else the ``tiny`` preset's shape with a context of 8192 tokens
(or the longest prompt + 64), written into the logs directory (the preset stops at 2048):
4 layers x 2 KV heads x 64 dims, float32, 4 KiB of KV a token (an 8K prompt's 32 MiB
take 1.3 s at 200 Mbit/s). Two PD clusters on loopback
(one embedded etcd, two namespaces), each a service, one PREFILL and one DECODE in PUSH
mode with a step budget of ``--chunk`` tokens (chunked prefill): "bulk" never streams
(``kv_stream_min_tokens: 0``), "stream" streams every prompt (1). Per length and round,
one request to each, interleaved (the order flips every round), each a prompt of fresh
random ids (no prefix hits, in the pool or the tiers), 2 tokens out, streamed. Figures
(medians over rounds): TTFT at the client (send to first token chunk) and the hand-over
after the first token, from the prefill's log line (the last push plus FirstGeneration
until the decode took over), and their stream / bulk ratios, with their range over rounds.

``--rate-mbit R ...`` (root, Linux: netns_lab.py): the same over a network instead of
loopback: etcd and both services on a router host, each prefill on a host of its own on
one subnet, each decode on the other, KV over the TCP backend; a token bucket (tc tbf) at
R Mbit/s on the router's leg into the decodes' subnet (0: no bucket): the pushed KV
crosses it, a prefill's first token to its service does not. Every round goes through the
rates in turn (the bucket changed between requests), so rates, lengths and variants are all
interleaved.
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


class _Loopback:
    """Every process on this machine's loopback."""

    def __init__(self, logs: pathlib.Path) -> None:
        from xllm_py.cluster.etcd_server import EmbeddedEtcd

        self.logs = logs
        self._etcd = EmbeddedEtcd().start()
        self.etcd = self._etcd.endpoint

    def address(self, host: str) -> tuple[str, int]:
        from xllm_py.utils.procs import free_port

        return "127.0.0.1", free_port()

    def spawn(self, host: str, name: str, module: str, args: list[str], url: str):
        from xllm_py.utils.procs import spawn

        return spawn(name, module, args, self.logs, http_url=url)

    def close(self) -> None:
        self._etcd.stop()


class _Network:
    """Hosts of a NetLab: etcd and the services on ``ctl``, prefills on subnet A, decodes
    on B (the router ctl between them), KV pushed across it."""

    def __init__(self, logs: pathlib.Path) -> None:
        from benchmarks.netns_lab import NetLab, unavailable_reason

        why = unavailable_reason()
        if why is not None:
            raise SystemExit(f"--rate-mbit: {why}")
        self.logs = logs
        self.lab = NetLab()
        self._ports = 8000
        try:
            ctl = self.lab.hosts["ctl"]
            self.etcd = f"{ctl}:2379"
            self._etcd = self.lab.spawn("ctl", "etcd", "xllm_py.cluster.etcd_server",
                                        ["--host", ctl, "--port", "2379"], logs)
        except BaseException:
            self.lab.close()
            raise

    def address(self, host: str) -> tuple[str, int]:
        if host not in self.lab.hosts:
            self.lab.add_host(host, "a" if host.startswith("prefill") else "b")
        self._ports += 2  # (a service's second port: its RPC)
        return self.lab.hosts[host], self._ports

    def spawn(self, host: str, name: str, module: str, args: list[str], url: str):
        return self.lab.spawn(host, name, module, args, self.logs, http_url=url)

    def rate(self, mbit: float) -> None:
        """The path into the decodes' subnet at ``mbit`` (0: unlimited): the pushed KV and
        whatever else a prefill sends a decode, not what it sends the service."""
        # A bucket of 2 ms at the rate (a fast rate is reached too), and at least 80 KB: a
        # smaller one splits every 64 KB GSO packet into MTU packets, whose per-packet work
        # on this host's cores (which a real link's NIC does not cost) lands on the
        # prefill's steps while the KV streams.
        if mbit > 0:
            self.lab.slow("ctl", f"{mbit:g}mbit", burst=f"{max(80, int(mbit * 250 / 1024))}kb",
                          dev="eth1")
        else:
            self.lab.unslow("ctl", dev="eth1")

    def close(self) -> None:
        self._etcd.terminate()
        self.lab.close()


def _cluster(net, tag: str, args, stream_min: int) -> list:
    from xllm_py.utils.config_file import write_settings
    from xllm_py.utils.procs import engine_args

    logs = net.logs
    host, hp = net.address("ctl")
    svc = net.spawn("ctl", f"service-{tag}", "xllm_service", [
        "--model", args.model, "--etcd", net.etcd, "--etcd-namespace", f"{tag}/",
        "--host", host, "--http-port", str(hp), "--rpc-port", str(hp + 1),
        "--load-balance-policy", "LEAST_LOAD", "--etcd-ttl", "15",
        *write_settings(logs / f"service-{tag}.yaml", {"evict_grace_s": 10})],
        f"http://{host}:{hp}")
    procs = [svc]
    for role in ("PREFILL", "DECODE"):
        name = f"{role.lower()}-{tag}"
        host, port = net.address(name)
        procs.append(net.spawn(name, name, "xllm_py.engine", engine_args(
            role, port, etcd=net.etcd, model=args.model, host=host, extra=[
                "--etcd-namespace", f"{tag}/", *write_settings(
                    logs / f"{name}.yaml",
                    {"etcd_ttl": 15, "latency_profile": "off",
                     "kv_stream_min_tokens": stream_min}),
                "--kv-cache-transfer-mode", "PUSH", "--kv-transfer-backend", args.backend,
                "--max-num-batched-tokens", str(args.chunk), "--max-num-seqs", "8",
                "--max-model-len", str(max(args.lengths) + 64)]),
            f"http://{host}:{port}"))
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


def _row(runs: dict[str, list[dict]]) -> dict:
    """Medians per variant, and the stream / bulk ratios of the medians and of each round's
    pair (their range: the spread)."""
    row: dict = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                 for n, rs in runs.items()}
    for key, name in (("handover_ms", "handover"), ("ttft_ms", "ttft")):
        pairs = [s[key] / max(b[key], 1e-9) for b, s in zip(runs["bulk"], runs["stream"])]
        row[f"{name}_ratio"] = row["stream"][key] / max(row["bulk"][key], 1e-9)
        row[f"{name}_ratio_range"] = [min(pairs), max(pairs)]
        row[f"{name}_ratio_rounds"] = pairs
    return row


def _line(net: str, length: int, row: dict) -> str:
    b, s = row["bulk"], row["stream"]
    (hlo, hhi), (tlo, thi) = row["handover_ratio_range"], row["ttft_ratio_range"]
    return (f"{net:>9} {length:>6} tokens: hand-over after first token bulk "
            f"{b['handover_ms']:.1f} ms, stream {s['handover_ms']:.1f} ms "
            f"({row['handover_ratio']:.2f}x, rounds {hlo:.2f}-{hhi:.2f}; "
            f"{s['streamed']:.0f}/{s['blocks']:.0f} blocks streamed); TTFT bulk "
            f"{b['ttft_ms']:.0f} ms, stream {s['ttft_ms']:.0f} ms ({row['ttft_ratio']:.2f}x, "
            f"rounds {tlo:.2f}-{thi:.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_kv_transfer.py --stream",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="tcp", choices=("tcp", "ucx"))
    ap.add_argument("--chunk", type=int, default=512, help="the prefill's step budget (tokens)")
    ap.add_argument("--model", default=None, help="a model directory (default: see above)")
    ap.add_argument("--rate-mbit", type=float, nargs="+", default=None,
                    help="network namespaces, the path into the decodes at these rates (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.rate_mbit is not None and args.backend != "tcp":
        ap.error("--rate-mbit moves KV over the TCP backend (UCX would find shared memory)")

    logs = pathlib.Path(tempfile.mkdtemp(prefix="bench-kv-stream-"))
    if args.model is None:
        from xllm_py.model.tiny import PRESETS, build_model_dir

        context = max(8192, max(args.lengths) + 64)  # (a prompt and its tokens out)
        args.model = str(build_model_dir(logs / "tiny-long", max_position_embeddings=context,
                                         **PRESETS["tiny"]))
    name = pathlib.Path(args.model).name
    net = _Loopback(logs) if args.rate_mbit is None else _Network(logs)
    rates = [None] if args.rate_mbit is None else args.rate_mbit
    variants = {"bulk": 0, "stream": 1}
    procs: dict[str, list] = {}
    results: dict = {"backend": args.backend, "chunk": args.chunk, "model": args.model,
                     "logs": str(logs), "nets": {}}
    try:
        for variant, stream_min in variants.items():
            procs[variant] = _cluster(net, f"stream-{variant}", args, stream_min)
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
        runs = {(r, n): {v: [] for v in variants} for r in rates for n in args.lengths}
        for rnd in range(args.rounds):
            for rate in rates:
                if rate is not None:
                    net.rate(rate)
                for length in args.lengths:
                    order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
                    for variant in order:
                        seed += 1
                        prompt = random_token_prompts(1, length, 500, seed=seed)[0]
                        runs[rate, length][variant].append(_request(
                            procs[variant][0].http_url, name, prompt,
                            procs[variant][1].log_path))
        for (rate, length), rs in runs.items():
            label = ("loopback" if rate is None else f"{rate:g} Mbit/s" if rate > 0
                     else "netns")
            row = _row(rs)
            results["nets"].setdefault(label, {})[length] = row
            if not args.json:
                print(_line(label, length, row), flush=True)
    finally:
        for ps in procs.values():
            for p in reversed(ps):
                p.terminate()
        net.close()
    report_environment(results, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
