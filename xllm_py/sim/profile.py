"""`python -m xllm_py.sim.profile --out PROFILE.json [engine flags]`: measure a real
engine's step times and fit the simulator's TimeModel to them.

Stages: build the real engine (the same flags as `python -m xllm_py.engine`: --model,
--device, --dtype, --num-threads ...) -> for each step shape (prompts of 8..512 tokens;
decode batches of 1..32 at 32..512 tokens of context), run the model runner and the
sampler on synthetic sequences, warm-up then the median of --repeats -> least-squares
fit (time_model.fit) -> write the JSON with the model, device and CPU it came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import statistics
import sys
import time

from xllm_py.engine.cli import build_parser as engine_parser, config_from_args
from xllm_py.sim.time_model import StepShape, fit

logger = logging.getLogger(__name__)

PREFILL_LENS = (8, 32, 64, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (32, 128, 512)


@dataclasses.dataclass
class _Seq:  # the ScheduledSeq fields the runner reads
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True


def _tables(num_seqs: int, num_tokens: int, block_size: int, num_blocks: int) -> list[list[int]]:
    """Distinct block tables while the pool lasts (then they wrap and share blocks)."""
    per = -(-num_tokens // block_size)
    return [[(i * per + j) % (num_blocks - 1) + 1 for j in range(per)] for i in range(num_seqs)]


def step_cases(block_size: int, num_blocks: int, vocab: int) -> list[tuple[StepShape, list]]:
    cases = []
    for n in PREFILL_LENS:
        (table,) = _tables(1, n, block_size, num_blocks)
        seqs = [_Seq("p", [(7 * i) % vocab for i in range(n)], 0, table)]
        cases.append((StepShape.of(seqs), seqs))
    for b in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            tables = _tables(b, ctx + 1, block_size, num_blocks)
            seqs = [_Seq(f"d{i}", [(i + 1) % vocab], ctx, tables[i]) for i in range(b)]
            cases.append((StepShape.of(seqs), seqs))
    return cases


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(engine, repeats: int) -> list[tuple[StepShape, float]]:
    """(shape, median ms of runner + sampler) per case, on the engine's real runner."""
    from xllm_py.engine.sampler import SamplingRow

    mc, bs = engine.model_config, engine.config.cache.block_size
    out = []
    for shape, seqs in step_cases(bs, engine.storage.num_blocks, mc.vocab_size):
        rows = [SamplingRow(temperature=0.0) for _ in seqs]
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            engine.sampler(engine.runner.execute(seqs), rows)
            if i >= 2:  # (two warm-ups)
                times.append((time.perf_counter() - t0) * 1000)
        out.append((shape, statistics.median(times)))
        logger.info("%s: %.2f ms", shape, out[-1][1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xllm_py.sim.profile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per step shape")
    args, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = config_from_args(engine_parser().parse_args(rest))
    from xllm_py.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    samples = measure(engine, args.repeats)
    import torch

    source = {"model": config.model, "device": config.device, "dtype": config.dtype,
              "num_threads": torch.get_num_threads(), "torch": torch.__version__,
              "python": platform.python_version(), "cpu": cpu_model(),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "samples": [[dataclasses.astuple(s), round(ms, 4)] for s, ms in samples]}
    model = fit(samples, source)
    model.save(args.out)
    worst = max(abs(model.step_ms(s) - ms) / ms for s, ms in samples)
    print(json.dumps({k: v for k, v in dataclasses.asdict(model).items() if k != "source"}))
    print(f"wrote {args.out}: worst fit error over {len(samples)} step shapes {worst:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
