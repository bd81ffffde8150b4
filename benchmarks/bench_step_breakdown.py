"""Where a decode step's time goes, by part, on the engine's own model (issue 28).

    python benchmarks/bench_step_breakdown.py [--model gemma-3-270m] [--batch 1 32]
                                              [--context 192] [--steps 12] [--threads N]
                                              [--json]

Loads the model as an engine does (``load_model`` + ``pack_linears``, the default weight
dtype), prefills ``--batch`` sequences of ``--context`` random tokens, then times
``--steps`` decode steps of the whole batch. Every part is timed inside the same steps (a
wrapper around each call): the linear layers of the blocks (and how many of their bytes
the step streams), attention, the LM head, norms/RoPE/the rest of the model (the model's
time less those), and the sampler (the engine's ``Sampler``, greedy and temperature 1
rows), against the step's wall time. The parts are shares of one measured total, so a
shared machine's load moves the milliseconds but much less the shares; quote the
``load`` line.
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


def run(model_name: str, batch: int, context: int, steps: int) -> dict:
    from xllm_py.engine.sampler import Sampler, SamplingRow
    from xllm_py.sampling_params import SamplingParams

    model, cfg = load_model(resolve_model(model_name))
    pack_linears(model)
    vocab = cfg.vocab_size
    timers = Timers()
    head = model.lm_head
    PackedLinear.forward = timers.wrap(
        lambda self, *a: "lm_head" if self is head else "linears", PackedLinear.forward)
    llama.attend = timers.wrap(lambda *a: "attention", llama.attend)
    # Gemma 3 decode steps run through Gemma3DecodeRunner: its linears and attention
    attention.attend = timers.wrap(lambda *a: "attention", attention.attend)
    Gemma3DecodeRunner._linear = timers.wrap(lambda *a: "linears", Gemma3DecodeRunner._linear)
    bs = 16
    nb = (context + steps) // bs + 2
    kv = allocate_kv_caches(cfg.num_layers, batch * nb + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i in range(batch):  # prefill
            ids = torch.randint(0, vocab, (context,), generator=g)
            seqs = [(0, context, tables[i])]
            model.forward_logits(ids, build_positions(seqs), AttentionMetadata.build(seqs, bs), kv)
        sampler = Sampler(seed=0)
        rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0))
                for i in range(batch)]
        tokens = torch.randint(0, vocab, (batch,), generator=g)
        wall = model_ms = sample_ms = 0.0
        for s in range(steps):
            seqs = [(context + s, 1, tables[i]) for i in range(batch)]
            timers.on = s > 0  # the first step warms up
            t0 = time.perf_counter()
            md = AttentionMetadata.build(seqs, bs)
            logits = model.forward_logits(tokens, build_positions(seqs), md, kv)
            t1 = time.perf_counter()
            tokens = torch.tensor(sampler(logits, rows).token_ids)
            t2 = time.perf_counter()
            if s > 0:
                wall += (t2 - t0) * 1e3
                model_ms += (t1 - t0) * 1e3
                sample_ms += (t2 - t1) * 1e3
    n = steps - 1
    parts = {k: v / n for k, v in timers.ms.items()}
    parts["sampler"] = sample_ms / n
    parts["rest of the model"] = model_ms / n - sum(timers.ms.values()) / n
    step = wall / n
    layer_bytes = sum(panel_bytes(m) for m in model.modules()
                      if isinstance(m, PackedLinear) and m is not head)
    return {"model": model_name, "batch": batch, "context": context, "step_ms": step,
            "parts_ms": parts, "linears_mb": layer_bytes / 2**20,
            "lm_head_mb": panel_bytes(head) / 2**20 if isinstance(head, PackedLinear) else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, one per core)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    results = []
    for b in a.batch:
        r = run(a.model, b, a.context, a.steps)
        results.append(r)
        print(f"\n{a.model} batch {b}, context {a.context}: step {r['step_ms']:.1f} ms "
              f"({b / r['step_ms'] * 1e3:.1f} tok/s); weights streamed a step: block linears "
              f"{r['linears_mb']:.0f} MB, LM head {r['lm_head_mb']:.0f} MB")
        for k, v in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:18s} {v:8.1f} ms  {v / r['step_ms']:6.1%}")
    if a.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
