"""The simulated engine (xllm_py/sim): its time model, runner, KV payload and transfer,
and that it runs requests through the real engine loop without importing torch."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from xllm_py.engine.scheduler_types import ScheduledSeq
from xllm_py.kv_transfer.base import TransferError
from xllm_py.kv_transfer.factory import create_backend
from xllm_py.sim.runner import SimulatedRunner, next_token
from xllm_py.sim.storage import SimKVStorage
from xllm_py.sim.time_model import StepShape, TimeModel, attn_pairs, fit
from xllm_py.utils.config_file import write_settings

MODEL = TimeModel(prefill_base_ms=2.0, prefill_ms_per_token=0.1, decode_base_ms=1.0,
                  decode_ms_per_seq=0.5, decode_ms_per_ctx_token=0.001)


@dataclasses.dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    from xllm_py.model.tiny import ensure_tiny_model

    return str(ensure_tiny_model("tiny"))


@pytest.fixture
def profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    MODEL.save(path)
    return str(path)


# --------------------------------------------------------------------------- time model

def test_step_shape_counts_prompt_tokens_and_decodes() -> None:
    seqs = [Seq("a", [1] * 30, 0, [0, 1]), Seq("b", [5], 40, [2, 3, 4]),
            Seq("c", [5], 9, [5]), Seq("d", [1] * 4, 16, [6, 7])]  # d: a chunk
    assert StepShape.of(seqs) == StepShape(num_prefill_tokens=34, num_decode_seqs=2,
                                           num_decode_ctx_tokens=41 + 10,
                                           num_prefill_pairs=30 * 31 // 2 + 4 * 16 + 10)


def test_step_shape_counts_speculative_guesses_as_prompt_rows() -> None:
    verify = ScheduledSeq("v", [5, 6, 7, 8], 20, [0, 1], sample=True, spec_token_ids=[6, 7, 8])
    assert StepShape.of([verify]) == StepShape(num_prefill_tokens=3, num_decode_seqs=1,
                                               num_decode_ctx_tokens=21,
                                               num_prefill_pairs=22 + 23 + 24)


def test_step_ms() -> None:
    assert MODEL.step_ms(StepShape()) == 0
    assert MODEL.step_ms(StepShape(100, 0, 0)) == pytest.approx(2.0 + 10.0)
    assert MODEL.step_ms(StepShape(0, 4, 1000)) == pytest.approx(1.0 + 2.0 + 1.0)
    assert MODEL.step_ms(StepShape(10, 4, 1000)) == pytest.approx(1.0 + 1.0 + 2.0 + 1.0)


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    shapes = ([StepShape(n, 0, 0) for n in (8, 64, 512, 2048)]
              + [StepShape(0, b, b * c) for b in (1, 8, 32) for c in (32, 512)]
              + [StepShape(300, 4, 900), StepShape(40, 16, 3000)])  # mixed steps
    got = fit([(s, MODEL.step_ms(s)) for s in shapes], {"model": "x"})
    for field in ("prefill_base_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq", "decode_ms_per_ctx_token"):
        assert getattr(got, field) == pytest.approx(getattr(MODEL, field), rel=1e-6), field
    assert got.source == {"model": "x"}


def test_fit_recovers_the_prompt_attention_term() -> None:
    """Prompts alone and chunks after computed tokens: the pairs term is told apart from
    the per-token one, and it makes long prompts superlinear."""
    model = dataclasses.replace(MODEL, prefill_ms_per_kpair=0.3)
    shapes = ([StepShape(n, 0, 0, attn_pairs(0, n)) for n in (8, 64, 512, 1536)]
              + [StepShape(256, 0, 0, attn_pairs(s, 256)) for s in (256, 1024)]
              + [StepShape(0, b, b * c) for b in (1, 8, 32) for c in (32, 512)]
              + [StepShape(64, 4, 900, attn_pairs(512, 64))])
    got = fit([(s, model.step_ms(s)) for s in shapes])
    assert got.prefill_ms_per_kpair == pytest.approx(0.3, rel=1e-6)
    assert got.prefill_ms_per_token == pytest.approx(MODEL.prefill_ms_per_token, rel=1e-6)
    assert TimeModel.from_dict(json.loads(got.to_json())) == got
    old = {k: v for k, v in json.loads(MODEL.to_json()).items() if k != "prefill_ms_per_kpair"}
    assert TimeModel.from_dict(old).prefill_ms_per_kpair == 0  # profiles made before it


def test_fit_never_gives_a_negative_coefficient() -> None:
    # decode time falling with context (noise): that coefficient is dropped, not negative
    samples = [(StepShape(n, 0, 0), 1 + 0.1 * n) for n in (8, 64, 256)]
    samples += [(StepShape(0, b, c), 1 + b - c * 1e-4) for b, c in ((1, 10), (2, 900), (4, 50))]
    got = fit(samples)
    assert got.decode_ms_per_ctx_token == 0 and got.decode_ms_per_seq > 0
    assert min(dataclasses.astuple(got)[:-1]) >= 0
    with pytest.raises(ValueError, match="need"):
        fit(samples[:3])
    with pytest.raises(ValueError, match="need"):
        fit(samples[3:] * 3)  # no prefill-only step


def test_profile_round_trip_and_bad_files(tmp_path, profile) -> None:
    assert TimeModel.load(profile) == MODEL
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill_base_ms": 1}))
    with pytest.raises(ValueError, match="lacks"):
        TimeModel.load(bad)
    d = dataclasses.asdict(MODEL) | {"decode_ms_per_seq": -1}
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="decode_ms_per_seq"):
        TimeModel.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        TimeModel.load(tmp_path / "missing.json")


# --------------------------------------------------------------------------- runner

def test_runner_tokens_are_a_function_of_last_token_and_position() -> None:
    vocab = list(range(3, 100))
    storage = SimKVStorage(num_blocks=8, block_size=4)
    runner = SimulatedRunner(dataclasses.replace(MODEL, prefill_base_ms=0,
                                                 prefill_ms_per_token=0), storage, vocab)
    out = runner.execute([Seq("a", [10, 11, 12, 13, 14], 0, [1, 2]),
                          Seq("b", [7, 8], 0, [3], sample=False)])
    assert out == [next_token(14, 4, vocab)]
    assert all(t in vocab for t in (next_token(i, p, vocab) for i in range(50) for p in range(50)))
    # payload: (token, position + 1) per computed slot
    assert storage.kv[1].tolist() == [[10, 1], [11, 2], [12, 3], [13, 4]]
    assert storage.kv[2, 0].tolist() == [14, 5]
    assert runner.num_kv_misses == 0
    # a decode at position 5 finds position 4; one whose previous slot was never written
    runner.execute([Seq("a", [out[0]], 5, [1, 2])])
    assert runner.num_kv_misses == 0
    runner.execute([Seq("c", [3], 6, [4, 5])])
    assert runner.num_kv_misses == 1


def test_runner_sleeps_the_modelled_time() -> None:
    import time

    storage = SimKVStorage(num_blocks=64, block_size=16)
    runner = SimulatedRunner(MODEL, storage, [5])
    t0 = time.monotonic()
    runner.execute([Seq("a", [1] * 300, 0, list(range(1, 20)))])
    assert time.monotonic() - t0 >= MODEL.step_ms(StepShape(300, 0, 0)) / 1000
    assert runner.busy_s == pytest.approx(MODEL.step_ms(StepShape(300, 0, 0)) / 1000)
    runner.burn_cpu = True  # the same time, spent on the CPU
    c0 = time.thread_time()
    runner.execute([Seq("b", [1] * 300, 0, list(range(20, 39)))])
    assert time.thread_time() - c0 >= MODEL.step_ms(StepShape(300, 0, 0)) / 1000


# --------------------------------------------------------------------------- transfer

def _filled(num_blocks: int, seed: int) -> SimKVStorage:
    s = SimKVStorage(num_blocks, block_size=4)
    s.kv[:] = np.random.default_rng(seed).integers(0, 1 << 30, s.kv.shape, dtype=np.int32)
    return s


def test_sim_backend_pulls_and_pushes_every_byte() -> None:
    a, b = _filled(16, 1), _filled(16, 2)
    ba, bb = create_backend("sim", a), create_backend("sim", b)

    async def go() -> None:
        addr_a, _ = ba.start(), bb.start()
        await bb.link(addr_a)
        res = await bb.pull(addr_a, [1, 2, 3, 9], [4, 5, 6, 0])
        assert res.num_blocks == 4 and res.num_bytes == 4 * b.block_bytes
        assert np.array_equal(b.kv[[4, 5, 6, 0]], a.kv[[1, 2, 3, 9]])
        await bb.push(addr_a, [7, 8], [14, 15])
        assert np.array_equal(a.kv[[14, 15]], b.kv[[7, 8]])
        with pytest.raises(TransferError) as exc:  # the peer checks its own ids
            await bb.pull(addr_a, [16], [1])
        assert exc.value.invalid_argument and "out of range" in str(exc.value)
        with pytest.raises(ValueError):  # and we check ours
            await bb.pull(addr_a, [1], [99])
        await ba.close()
        with pytest.raises(TransferError):
            await bb.pull(addr_a, [1], [2], timeout=2)
        await bb.close()

    asyncio.run(go())


# --------------------------------------------------------------------------- host

def test_host_gives_each_instance_its_name_and_port(profile) -> None:
    from xllm_py.sim.host import parse

    _, configs = parse(["--count", "3", "--name-prefix", "d", "--first-index", "4",
                        "--simulate", profile, "--instance-role", "DECODE",
                        "--etcd", "127.0.0.1:2379"])
    assert [c.instance_name for c in configs] == ["d-4", "d-5", "d-6"]
    assert len({c.port for c in configs}) == 3
    _, configs = parse(["--count", "2", "--name-prefix", "p", "--ports", "9001,9002",
                        "--simulate", profile])
    assert [(c.instance_name, c.port) for c in configs] == [("p-0", 9001), ("p-1", 9002)]
    with pytest.raises(SystemExit):
        parse(["--count", "2", "--name-prefix", "p", "--ports", "9001", "--simulate", profile])
    assert {c.transfer.backend for c in configs} == {"sim"}
    with pytest.raises(SystemExit):
        parse(["--count", "2", "--name-prefix", "d"])  # no --simulate


# --------------------------------------------------------------------------- engine

def test_simulated_engine_runs_requests_without_torch(tiny_dir, profile, tmp_path) -> None:
    """A fresh interpreter: the engine process's modules (server, cluster node, API, sim
    host) and a SimulatedEngine serving requests, and torch never imported."""
    settings = write_settings(tmp_path / "settings.yaml", {"simulate": profile})
    code = textwrap.dedent(f"""
        import json, queue, sys
        import xllm_py.engine.server, xllm_py.engine.cluster_node, xllm_py.api.app
        import xllm_py.parallel.kv_workers, xllm_py.sim.host, xllm_py.sim.transfer
        from xllm_py.engine.cli import build_parser, config_from_args
        from xllm_py.engine.llm_engine import EngineRequest
        from xllm_py.sim.engine import SimulatedEngine
        from xllm_py.sampling_params import SamplingParams
        cfg = config_from_args(build_parser().parse_args(
            [*{settings!r}, "--model", {tiny_dir!r}, "--num-blocks", "64"]))
        engine = SimulatedEngine(cfg)
        engine.start()
        q = queue.Queue()
        class Sink:
            def emit(self, out):
                q.put(out)
        prompts = [[11, 12, 13, 14, 15] * 8, [11, 12, 13, 14, 15] * 8, [20, 21, 22]]
        tokens, finished = {{}}, {{}}
        for i, p in enumerate(prompts):  # one after the other: r1 hits r0's cached prefix
            engine.submit(EngineRequest(f"r{{i}}", p, SamplingParams(max_tokens=9), Sink()))
            while f"r{{i}}" not in finished:
                out = q.get(timeout=30)
                for c in out.outputs:
                    tokens.setdefault(out.request_id, []).extend(c.token_ids)
                if out.finished:
                    finished[out.request_id] = out.outputs[0].finish_reason
        stats = engine.stats()
        engine.stop()
        print(json.dumps([tokens, finished, stats, "torch" in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, finished, stats, has_torch = json.loads(out.stdout.strip().splitlines()[-1])
    assert has_torch is False
    assert finished == {"r0": "length", "r1": "length", "r2": "length"}
    assert [len(tokens[r]) for r in ("r0", "r1", "r2")] == [9, 9, 9]
    assert tokens["r0"] == tokens["r1"] != tokens["r2"]  # deterministic, prompt-dependent
    assert stats["sim_kv_misses"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["prefix_hit_tokens"] >= 32  # r1 reused r0's two full blocks


def test_step_timer_times_forward_and_sampling_once_on() -> None:
    """sim.profile's StepTimer: the runner and sampler an engine is built from, timed
    (forward + sampling of each step, its shape) only once turned on."""
    import types

    from xllm_py.engine.model_setup import LoadedModel
    from xllm_py.engine.scheduler_types import ScheduledSeq
    from xllm_py.sim.profile import StepTimer

    runner = types.SimpleNamespace(execute_step=lambda seqs: "logits")
    loaded = LoadedModel("m", None, None, None, runner, lambda *a: ("sampled", a), 2)
    timer = StepTimer()
    timed = timer.timed(loaded)
    seqs = [ScheduledSeq("a", [1, 2, 3], 0, [1], True)]
    assert timed.runner.execute_step(seqs) == "logits" and timer.steps == []  # off
    timer.on = True
    assert timed.runner.execute_step(seqs) == "logits"
    assert timed.sampler("x", "rows", "masks") == ("sampled", ("x", "rows", "masks"))
    assert [s.shape for s in timer.steps] == [StepShape.of(seqs)]
    assert timer.steps[0].cpu_ms >= 0 and timer.steps[0].wall_ms > 0
    assert loaded.runner is runner  # (the loaded model itself is left as it was)
