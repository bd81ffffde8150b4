"""Where a step's time goes, by part, on the engine's own model: a decode step of a batch,
one long prompt chunk, and one step that prefills many short arriving prompts.

    python benchmarks/bench_step_breakdown.py [--model gemma-3-270m] [--batch 1 32]
                                              [--context 192] [--steps 12] [--chunk 2048]
                                              [--arrivals 32] [--prompt 128] [--rounds 3]
                                              [--sampled 0.5] [--no-compare] [--threads N]
                                              [--json]

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
moves the milliseconds but much less the shares; quote the ``load`` line. Unless
``--no-compare``, every step runs twice, in alternating order: as the engine runs it (the
head left to the sampler: a greedy row's argmax inside it; the native draw; the native
GeGLU; windowed dense chunks by tiles) and "before" (``as_before``: every sampled row's
logits, torch's draw, torch's GeGLU, one masked call per chunk), so the ratio of the two
is under the same load; the greedy rows' tokens of the two are compared.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from xllm_py.model import attention, cpu_kernels, llama, lm_head  # noqa: E402
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
    # the head the sampler runs (HeadRows): its argmax, its rows' logits
    lm_head.head_argmax = timers.wrap(lambda *a: "lm_head", lm_head.head_argmax)
    return model, cfg


def rows_of(n: int, sampled: float) -> list:
    """n sampling rows, every 1/sampled-th at temperature 1, the others greedy."""
    from xllm_py.engine.sampler import SamplingRow
    from xllm_py.sampling_params import SamplingParams
    every = round(1 / sampled) if sampled > 0 else 0
    return [SamplingRow(SamplingParams(temperature=1.0 if every and i % every == every - 1
                                       else 0.0)) for i in range(n)]


@contextlib.contextmanager
def as_before() -> Iterator[None]:
    """Within the block the model and sampler run as before the LM head was left to the
    sampler: torch's draw (compute_probs), torch's GeGLU (two passes, two tensors) and a
    windowed dense chunk in one masked call (the caller also takes forward_logits)."""
    from xllm_py.engine import sampler as sampler_mod
    import torch.nn.functional as F
    native, act, tile = sampler_mod.sample_rows, cpu_kernels.silu_and_mul, attention.WINDOW_TILE

    def torch_geglu(x, gelu=False, out=None):
        if not gelu:
            return act(x, gelu, out)
        gate, up = x.split(x.shape[1] // 2, dim=-1)
        y = F.gelu(gate, approximate="tanh") * up
        return y if out is None else out.copy_(y)

    sampler_mod.sample_rows = lambda *a: None
    cpu_kernels.silu_and_mul = torch_geglu
    attention.WINDOW_TILE = 1 << 30
    try:
        yield
    finally:
        sampler_mod.sample_rows, cpu_kernels.silu_and_mul = native, act
        attention.WINDOW_TILE = tile


def _run_step(model, kv, timers: Timers, step, sampler, rows,
              before: bool) -> tuple[float, float, float, list]:
    """One step, the model then the sampler: (model ms, sampler ms, of which the timed
    parts (the head) ms, tokens). ``before``: ``as_before``, with every sampled row's
    logits (forward_logits); else the engine's path (forward_head: HeadRows)."""
    ids, pos, md, keep = step
    with as_before() if before else contextlib.nullcontext():
        t0 = time.perf_counter()
        fwd = model.forward_logits if before else model.forward_head
        logits = fwd(ids, pos, md, kv, keep_rows=keep)
        t1 = time.perf_counter()
        timed = sum(timers.ms.values())
        out = sampler(logits, rows)
        t2 = time.perf_counter()
    inside = sum(timers.ms.values()) - timed
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, inside, out.token_ids


def timed_steps(model, kv, timers: Timers, steps: list, rows: list, compare: bool) -> dict:
    """Runs each (ids, positions, metadata, keep_rows) of ``steps`` (the first warms up),
    then the sampler over its rows; the mean parts and wall time of the rest, in ms. With
    ``compare`` each step runs before and after (``_run_step``), in alternating order: the
    two breakdowns under the same load, and their greedy rows' tokens are compared."""
    from xllm_py.engine.sampler import Sampler
    variants = ("before", "after") if compare else ("after",)
    res = {v: {"parts": defaultdict(float), "wall": 0.0} for v in variants}
    samplers = {v: Sampler(seed=0) for v in variants}
    greedy = [i for i, r in enumerate(rows) if r.argmax_only]
    for s, step in enumerate(steps):
        toks = {}
        for v in (variants if s % 2 else variants[::-1]):
            timers.ms.clear()
            timers.on = s > 0
            model_ms, sample_ms, inside, toks[v] = _run_step(
                model, kv, timers, step, samplers[v], rows, v == "before")
            timers.on = False
            if s == 0:
                continue
            parts = res[v]["parts"]
            for k, ms in timers.ms.items():
                parts[k] += ms
            parts["sampler"] += sample_ms - inside
            parts["rest of the model"] += model_ms - (sum(timers.ms.values()) - inside)
            res[v]["wall"] += model_ms + sample_ms
        if compare:
            differ = sum(toks["before"][i] != toks["after"][i] for i in greedy)
            res["after"]["differ"] = res["after"].get("differ", 0) + differ
    n = len(steps) - 1
    out = {}
    for v in variants:
        parts = {k: ms / n for k, ms in res[v]["parts"].items()}
        out[v] = {"step_ms": res[v]["wall"] / n, "parts_ms": parts}
    if compare:  # (a row whose two best logits are within float32 rounding may flip)
        out["after"]["greedy_rows_differing"] = res["after"].get("differ", 0)
    return out


def decode(model, cfg, timers: Timers, batch: int, context: int, steps: int,
           sampled: float, compare: bool) -> dict:
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
        return timed_steps(model, kv, timers, plan, rows_of(batch, sampled), compare)


def prompts(model, cfg, timers: Timers, lengths: list[int], rounds: int,
            sampled: float, compare: bool) -> dict:
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
        return timed_steps(model, kv, timers, [step] * (rounds + 1),
                           rows_of(len(lengths), sampled), compare)


def report(title: str, r: dict, tokens: int) -> None:
    """Each variant's breakdown; with both, after against before (the same load)."""
    print(f"\n{title}:")
    for v, x in r.items():
        print(f"  {v}: step {x['step_ms']:.1f} ms ({tokens / x['step_ms'] * 1e3:.1f} tok/s)")
        for k, ms in sorted(x["parts_ms"].items(), key=lambda kv: -kv[1]):
            print(f"    {k:18s} {ms:8.1f} ms  {ms / x['step_ms']:6.1%}")
    if len(r) == 2:
        b, a = r["before"], r["after"]
        print(f"  greedy rows whose token differs from before: {a['greedy_rows_differing']}")
        print(f"  after / before: step {a['step_ms'] / b['step_ms']:.2f}x; "
              + ", ".join(f"{k} {a['parts_ms'].get(k, 0.0) / ms:.2f}x"
                          for k, ms in b["parts_ms"].items() if ms > 0))


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
    ap.add_argument("--no-compare", action="store_true",
                    help="only the engine's path (default: each step also the full-logits "
                         "head and torch's draw, interleaved)")
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
        r = decode(model, cfg, timers, b, a.context, a.steps, a.sampled, not a.no_compare)
        results.append({"kind": "decode", "batch": b, "context": a.context, **r})
        report(f"{a.model} decode batch {b}, context {a.context} (weights streamed a step: "
               f"block linears {linears_mb:.0f} MB, LM head {head_mb:.0f} MB)", r, b)
    if a.chunk:
        r = prompts(model, cfg, timers, [a.chunk], a.rounds, a.sampled, not a.no_compare)
        results.append({"kind": "chunk", "tokens": a.chunk, **r})
        report(f"{a.model} one prompt chunk of {a.chunk} tokens", r, a.chunk)
    if a.arrivals:
        r = prompts(model, cfg, timers, [a.prompt] * a.arrivals, a.rounds, a.sampled,
                    not a.no_compare)
        results.append({"kind": "arrivals", "prompts": a.arrivals, "tokens": a.prompt, **r})
        report(f"{a.model} one step prefilling {a.arrivals} prompts of {a.prompt} tokens", r,
               a.arrivals * a.prompt)
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")
    if a.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
