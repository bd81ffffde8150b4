"""TPExecutor: rank 0 of a tensor- or pipeline-parallel instance, behind the model object
the engine calls (pipeline stages: parallel/pipeline.py; each rank's part of the step is
its model's call, so the commands and the step are the same).

Stages: open the rendezvous store -> start ranks 1..N-1 (``python -m
xllm_py.parallel.worker``) -> join the group -> load rank 0's shard -> barrier "every rank
loaded" -> ``init_kv`` (every rank allocates its KV pool of the same blocks) -> (PD roles)
``start_kv_workers`` (every rank its own transfer endpoint and WorkerService) -> per step:
broadcast the step's inputs, run rank 0's shard (all-reduces inside), rank 0 alone
computes the logits -> ``shutdown`` (STOP, wait, kill what is left).

The engine keeps its interface: ``TPModel`` answers ``model(...)`` and
``model.forward_logits(...)`` as ``LlamaForCausalLM`` does. A watch thread notices a rank
that exits and sends a keep-alive to an idle group. Once a rank is lost, or a step fails
part-way (the ranks' collectives may no longer line up), the executor is ``broken``:
every later step raises at once and ``on_broken`` callbacks run (once).
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

from xllm_py.config import EngineConfig
from xllm_py.model.attention import AttentionMetadata
from xllm_py.model.config import ModelConfig
from xllm_py.parallel.group import TPGroup
from xllm_py.parallel.pipeline import pp_error, rank_layers
from xllm_py.parallel.kv_workers import SPEC_KEY, KVWorkerSpec, RankKVWorker, collect_answers
from xllm_py.parallel.protocol import Command, StepInputs, encode_step, header
from xllm_py.model.sharding import TPShard, tp_error
from xllm_py.parallel.worker import load_rank, rank_device, threads_per_rank

logger = logging.getLogger(__name__)

# An idle group exchanges a NOOP this often (the ranks' wait for a command has a timeout).
KEEPALIVE_S = 60.0
# How long shutdown waits for the ranks to exit before killing them.
STOP_GRACE_S = 5.0


class TPBrokenError(RuntimeError):
    """The tensor-parallel group lost a rank or its step order: the instance cannot serve."""


class TPExecutor:
    def __init__(self, config: EngineConfig, group: TPGroup, procs: list[subprocess.Popen],
                 model: torch.nn.Module, model_config: ModelConfig, shard: TPShard) -> None:
        self.config = config
        self.group = group
        self.procs = procs
        self.local = model
        self.model_config = model_config
        self.shard = shard
        self.model = TPModel(self)
        self.broken: str | None = None
        self.on_broken: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # one command (a whole step) at a time
        self._last_send = time.monotonic()
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, name="tp-watch", daemon=True)
        self._watch.start()

    @property
    def num_local_kv_heads(self) -> int:
        return self.shard.num_kv_heads

    @property
    def layers(self) -> tuple[int, int]:
        """[start, end) of the model layers rank 0 holds (and its KV pool)."""
        return rank_layers(self.config, self.model_config, 0)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str) -> "TPExecutor":
        tp = config.tensor_parallel_size
        world = tp * config.pipeline_parallel_size
        mc = ModelConfig.from_dir(model_dir)  # refuse an unsplittable model before any process
        error = tp_error(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, tp)
        if error is not None:
            raise ValueError(f"--tensor-parallel-size {tp}: {error}")
        error = pp_error(config, mc)
        if error is not None:
            raise ValueError(f"--pipeline-parallel-size {config.pipeline_parallel_size}: {error}")
        torch.set_num_threads(threads_per_rank(config))
        device = rank_device(config.device, 0)
        store = TPGroup.listen(world)
        blob = pickle.dumps((config, model_dir, os.getpid(), logging.getLogger().getEffectiveLevel()))
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, world):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "xllm_py.parallel.worker", "--rank", str(rank),
                     "--world-size", str(world), "--port", str(store.port)],
                    stdin=subprocess.PIPE)
                proc.stdin.write(blob)
                proc.stdin.close()
                procs.append(proc)
            group = TPGroup(store, 0, world, device, config.tp_timeout_s)
            model, mc, shard = load_rank(config, model_dir, group)
            group.barrier(wait=True)
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        logger.info("%s: %d ranks (pids %s), %d thread(s) each, %s",
                    "pipeline parallel" if world > tp else "tensor parallel", world,
                    [p.pid for p in procs], torch.get_num_threads(),
                    "gloo" if device.type == "cpu" else "gloo + nccl")
        return cls(config, group, procs, model, mc, shard)

    # ------------------------------------------------------------------ commands
    def init_kv(self, num_blocks: int) -> None:
        """Every rank > 0 allocates its KV pool of ``num_blocks`` blocks (rank 0's is the
        engine's ``KVCacheStorage``, made by the engine with ``num_local_kv_heads``)."""
        with self._lock:
            self._check()
            self._send(header(Command.INIT_KV, num_blocks))

    def start_kv_workers(self, spec: KVWorkerSpec) -> list[RankKVWorker]:
        """Ranks > 0 start their KV workers (PD roles); -> their addresses, rank order.
        Blocks (up to kv_workers.START_TIMEOUT_S): call it off the event loop."""
        with self._lock:
            self._check()
            self.group.store.set(SPEC_KEY, pickle.dumps(spec))
            self._send(header(Command.START_KV_WORKER))
        return collect_answers(self.group.store, self.group.world_size)

    def step(self, inputs: StepInputs, kv_caches: list) -> torch.Tensor:
        with self._lock:
            self._check()
            try:
                h, payload = encode_step(inputs)
                self._send(h)
                self.group.broadcast(payload)
                if inputs.logits:
                    return self.local.forward_logits(inputs.input_ids, inputs.positions,
                                                     inputs.meta, kv_caches, inputs.keep_rows)
                return self.local(inputs.input_ids, inputs.positions, inputs.meta, kv_caches,
                                  keep_rows=inputs.keep_rows)
            except Exception as exc:
                self._break(f"a tensor-parallel step failed: {exc}")
                raise

    def _send(self, h: torch.Tensor) -> None:
        self.group.broadcast(h)
        self._last_send = time.monotonic()

    def _check(self) -> None:
        if self.broken is not None:
            raise TPBrokenError(self.broken)

    def _break(self, reason: str) -> None:
        if self.broken is not None or self._stopping.is_set():
            return
        self.broken = reason
        logger.error("tensor-parallel instance broken: %s", reason)
        for fn in list(self.on_broken):
            try:
                fn(reason)
            except Exception:
                logger.exception("on_broken callback failed")

    def _watch_loop(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and self.broken is None and not self._stopping.is_set():
                    self._break(f"tensor-parallel rank {rank} exited with code {code}")
            if (self.broken is None and time.monotonic() - self._last_send > KEEPALIVE_S
                    and self._lock.acquire(blocking=False)):
                try:
                    self._send(header(Command.NOOP))
                except Exception as exc:
                    self._break(f"keep-alive failed: {exc}")
                finally:
                    self._lock.release()

    def shutdown(self) -> None:
        """STOP the ranks, wait up to STOP_GRACE_S, kill what is left. Idempotent."""
        if self._stopping.is_set():
            return
        got = self._lock.acquire(timeout=STOP_GRACE_S)
        self._stopping.set()
        try:
            if got and self.broken is None:
                try:
                    self._send(header(Command.STOP))
                except Exception as exc:
                    logger.warning("could not stop the tensor-parallel ranks cleanly: %s", exc)
        finally:
            if got:
                self._lock.release()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class TPModel:
    """What the engine's ModelRunner calls: the same signatures as LlamaForCausalLM."""

    def __init__(self, executor: TPExecutor) -> None:
        self.executor = executor

    @property
    def config(self) -> ModelConfig:
        return self.executor.model_config

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata, kv_caches: list,
                 keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.executor.step(
            StepInputs(input_ids, positions, attn_metadata, keep_rows, False), kv_caches)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, kv_caches: list,
                       keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.executor.step(
            StepInputs(input_ids, positions, attn_metadata, keep_rows, True), kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.executor.local.compute_logits(hidden)

