"""Where a step's time goes, by part, on the engine's own model: a decode step of a batch,
one long prompt chunk, and one step that prefills many short arriving prompts.

    python benchmarks/bench_step_breakdown.py [--model gemma-3-270m] [--batch 1 32]
                                              [--context 192] [--steps 12] [--chunk 2048]
                                              [--arrivals 32] [--prompt 128] [--rounds 3]
                                              [--sampled 0.5] [--threads N] [--json]

Loads the model once as an engine does (``load_model`` + ``pack_linears``, the default
weight dtype). Decode: prefills ``--batch`` sequences of ``--context`` random tokens, then
times ``--steps`` decode steps of the whole batch (a ``--sampled`` share of the rows at
temperature 1, the rest greedy). Prompt steps (``--rounds`` each, ``--chunk`` 0 or
``--arrivals`` 0 to skip): one chunk of ``--chunk`` tokens, then one step of
``--arrivals`` prompts of ``--prompt`` tokens each (how a burst of arrivals that fits the
step's token budget is prefilled), their last rows sampled. Every part is timed inside the
same steps (a wrapper around each call): the linear layers of the blocks (and how many of
their bytes a decode step streams), attention, the LM head, norms/RoPE/the rest of the model
(the model's time less those), and the sampler (the engine's ``Sampler``), against the
step's wall time. The parts are shares of one measured total, so a shared machine's load
moves the milliseconds but much less the shares; quote the ``load`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from xllm_py.model import attention, llama  # noqa: E402
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions  # noqa: E402
from xllm_py.model.catalog import resolve_model  # noqa: E402
from xllm_py.model.gemma3_decode import Gemma3DecodeRunner  # noqa: E402
from xllm_py.model.loader import load_model  # noqa: E402
from xllm_py.model.packed import PackedLinear, pack_linears  # noqa: E402

BLOCK = 16


class Timers:
    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.ms[name_of(*args)] += (time.perf_counter() - t) * 1e3
            return out
        return timed


def panel_bytes(m: PackedLinear) -> int:
    if m._panels is None:
        return 0
    if getattr(m, "_kq", None) is not None:  # GGUF Q4_K / Q6_K panels
        return m._kq.nbytes
    n = m._panels.numel() * m._panels.element_size()
    return n + (0 if m._scales is None else m._scales.numel() * 4)


def load(model_name: str, timers: Timers):
    """The packed model, its config, with every part's calls timed by ``timers``."""
    model, cfg = load_model(resolve_model(model_name))
    pack_linears(model)
    head = model.lm_head
    PackedLinear.forward = timers.wrap(
        lambda self, *a: "lm_head" if self is head else "linears", PackedLinear.forward)
    llama.attend = timers.wrap(lambda *a: "attention", llama.attend)
    # Gemma 3 decode steps run through Gemma3DecodeRunner: its linears and attention
    attention.attend = timers.wrap(lambda *a: "attention", attention.attend)
    Gemma3DecodeRunner._linear = timers.wrap(lambda *a: "linears", Gemma3DecodeRunner._linear)
    return model, cfg


def rows_of(n: int, sampled: float) -> list:
    """n sampling rows, every 1/sampled-th at temperature 1, the others greedy."""
    from xllm_py.engine.sampler import SamplingRow
    from xllm_py.sampling_params import SamplingParams
    every = round(1 / sampled) if sampled > 0 else 0
    return [SamplingRow(SamplingParams(temperature=1.0 if every and i % every == every - 1
                                       else 0.0)) for i in range(n)]


def timed_steps(model, kv, timers: Timers, steps: list, rows: list) -> dict:
    """Runs each (ids, positions, metadata, keep_rows) of ``steps`` (the first warms up),
    then the sampler over its rows; the mean parts and wall time of the rest, in ms."""
    from xllm_py.engine.sampler import Sampler
    sampler = Sampler(seed=0)
    timers.ms.clear()
    wall = model_ms = sample_ms = 0.0
    for s, (ids, pos, md, keep) in enumerate(steps):
        timers.on = s > 0
        t0 = time.perf_counter()
        logits = model.forward_logits(ids, pos, md, kv, keep_rows=keep)
        t1 = time.perf_counter()
        out = sampler(logits, rows)
        t2 = time.perf_counter()
        if s > 0:
            wall += (t2 - t0) * 1e3
            model_ms += (t1 - t0) * 1e3
            sample_ms += (t2 - t1) * 1e3
        timers.on = False
    n = len(steps) - 1
    parts = {k: v / n for k, v in timers.ms.items()}
    parts["sampler"] = sample_ms / n
    parts["rest of the model"] = model_ms / n - sum(timers.ms.values()) / n
    return {"step_ms": wall / n, "parts_ms": parts, "tokens": out.token_ids}


def decode(model, cfg, timers: Timers, batch: int, context: int, steps: int,
           sampled: float) -> dict:
    nb = (context + steps) // BLOCK + 2
    kv = allocate_kv_caches(cfg.num_layers, batch * nb + 1, BLOCK, cfg.num_kv_heads,
                            cfg.head_dim)
    tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i in range(batch):  # prefill
            ids = torch.randint(0, cfg.vocab_size, (context,), generator=g)
            seqs = [(0, context, tables[i])]
            model.forward_logits(ids, build_positions(seqs), AttentionMetadata.build(seqs, BLOCK), kv)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        plan = []
        for s in range(steps):
            seqs = [(context + s, 1, tables[i]) for i in range(batch)]
            plan.append((tokens, build_positions(seqs), AttentionMetadata.build(seqs, BLOCK), None))
        r = timed_steps(model, kv, timers, plan, rows_of(batch, sampled))
    return r


def prompts(model, cfg, timers: Timers, lengths: list[int], rounds: int,
            sampled: float) -> dict:
    """One step prefilling sequences of ``lengths`` tokens (fresh, no cached prefix), the
    last row of each sampled; ``rounds`` timed after a warm-up."""
    nbs = [(n + BLOCK - 1) // BLOCK for n in lengths]
    kv = allocate_kv_caches(cfg.num_layers, sum(nbs) + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    g = torch.Generator().manual_seed(1)
    seqs, start = [], 1
    for n, nb in zip(lengths, nbs):
        seqs.append((0, n, list(range(start, start + nb))))
        start += nb
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    last = torch.tensor(lengths).cumsum(0) - 1
    with torch.inference_mode():
        step = (ids, build_positions(seqs), AttentionMetadata.build(seqs, BLOCK), last)
        return timed_steps(model, kv, timers, [step] * (rounds + 1), rows_of(len(lengths), sampled))


def report(title: str, r: dict, tokens: int) -> None:
    print(f"\n{title}: step {r['step_ms']:.1f} ms ({tokens / r['step_ms'] * 1e3:.1f} tok/s)")
    for k, v in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {v:8.1f} ms  {v / r['step_ms']:6.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=2048, help="prompt chunk tokens (0: skip)")
    ap.add_argument("--arrivals", type=int, default=32, help="prompts in one step (0: skip)")
    ap.add_argument("--prompt", type=int, default=128, help="tokens of each arriving prompt")
    ap.add_argument("--rounds", type=int, default=3, help="timed prompt steps of each kind")
    ap.add_argument("--sampled", type=float, default=0.5,
                    help="share of rows at temperature 1 (the others greedy)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, one per core)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    timers = Timers()
    model, cfg = load(a.model, timers)
    head = model.lm_head
    linears_mb = sum(panel_bytes(m) for m in model.modules()
                     if isinstance(m, PackedLinear) and m is not head) / 2**20
    head_mb = panel_bytes(head) / 2**20 if isinstance(head, PackedLinear) else 0.0
    results = []
    for b in a.batch:
        r = decode(model, cfg, timers, b, a.context, a.steps, a.sampled)
        results.append({"kind": "decode", "batch": b, "context": a.context, **r})
        report(f"{a.model} decode batch {b}, context {a.context} (weights streamed a step: "
               f"block linears {linears_mb:.0f} MB, LM head {head_mb:.0f} MB)", r, b)
    if a.chunk:
        r = prompts(model, cfg, timers, [a.chunk], a.rounds, a.sampled)
        results.append({"kind": "chunk", "tokens": a.chunk, **r})
        report(f"{a.model} one prompt chunk of {a.chunk} tokens", r, a.chunk)
    if a.arrivals:
        r = prompts(model, cfg, timers, [a.prompt] * a.arrivals, a.rounds, a.sampled)
        results.append({"kind": "arrivals", "prompts": a.arrivals, "tokens": a.prompt, **r})
        report(f"{a.model} one step prefilling {a.arrivals} prompts of {a.prompt} tokens", r,
               a.arrivals * a.prompt)
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")
    if a.json:
        for r in results:
            r.pop("tokens", None)
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
