"""A tensor-parallel rank > 0: ``python -m xllm_py.parallel.worker`` (started by rank 0).

Stages: read (EngineConfig, model dir, parent pid, log level) from stdin -> join the group
-> load the rank's shard (same code as rank 0: ``load_rank``) -> barrier "loaded" ->
command loop: INIT_KV allocates the rank's KV pool (its own heads), START_KV_WORKER
starts the rank's KV worker over it (PD roles), STEP runs the same forward as rank 0 on
the broadcast inputs, NOOP keeps the idle group alive, STOP ends it.
Any error, or rank 0's death (the group's collectives fail; a watchdog also polls the
parent pid), ends the process: a rank that cannot follow the steps must not linger.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import threading
import time

import torch

from xllm_py.config import EngineConfig
from xllm_py.kv_transfer.factory import pool_allocator
from xllm_py.kv_transfer.kv_storage import KVCacheStorage, parse_dtype
from xllm_py.model.config import ModelConfig
from xllm_py.model.kv_groups import KVGroups, kv_groups
from xllm_py.model.packed import pack_linears
from xllm_py.parallel.group import TPGroup
from xllm_py.parallel.kv_workers import RankKVWorkerHost, serve_start_request
from xllm_py.parallel.loader import load_model_shard
from xllm_py.parallel.pipeline import StageModel, rank_layers, stage_of
from xllm_py.parallel.protocol import HEADER_LEN, Command, decode_step, payload_len
from xllm_py.model.loader import load_model
from xllm_py.model.sharding import TPShard, shard_for
from xllm_py.utils.cli import enable_crash_stacks

logger = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> torch.device:
    """cuda -> cuda:rank, cuda:k -> cuda:k+rank; cpu stays cpu."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads, else the cores shared out between the ranks (at least one each)."""
    if config.num_threads:
        return config.num_threads
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    return max(1, (os.cpu_count() or 1) // ranks)


def load_rank(config: EngineConfig, model_dir: str, group: TPGroup
              ) -> tuple[torch.nn.Module, ModelConfig, TPShard]:
    """The rank's shard (a pipeline stage: its layers), packed like the TP 1 engine's
    model."""
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    if pp > 1:  # the stage's layers only: every head, or its TP shard's
        if tp > 1:
            stage_group = group.subgroup(f"stage{stage_of(group.rank, pp, tp)}",
                                         group.rank % tp, tp)
            model, mc, shard = load_model_shard(model_dir, stage_group, dtype=config.dtype,
                                                device=group.device)
        else:
            model, mc = load_model(model_dir, dtype=config.dtype, device=group.device)
            shard = shard_for(mc, 0, 1)
        model = StageModel(model, rank_layers(config, mc, group.rank), group, pp, tp)
    else:
        model, mc, shard = load_model_shard(model_dir, group, dtype=config.dtype,
                                            device=group.device)
    if config.pack_weights:
        pack_linears(model, weight_dtype=config.weight_dtype)
    return model, mc, shard


def make_storage(config: EngineConfig, mc: ModelConfig, shard: TPShard, num_blocks: int,
                 device: torch.device, rank: int) -> KVCacheStorage:
    """The rank's KV pool: every block of the instance, for the rank's KV heads and
    layers only (a cache tensor per KV group slot: model/kv_groups.py)."""
    return KVCacheStorage(_groups(config, mc, rank).num_slots, num_blocks,
                          config.cache.block_size, shard.num_kv_heads, mc.head_dim,
                          parse_dtype(config.dtype), device=device,
                          allocator=pool_allocator(config))


def _groups(config: EngineConfig, mc: ModelConfig, rank: int) -> KVGroups:
    """The model's KV groups as the rank's pool holds them (a stage: its layers' slots)."""
    model = kv_groups([mc.layer_window(i) for i in range(mc.num_layers)])
    return model.stage(*rank_layers(config, mc, rank))


def serve(config: EngineConfig, model: torch.nn.Module, mc: ModelConfig, shard: TPShard,
          group: TPGroup) -> None:
    """The command loop of a rank > 0 (see module doc)."""
    storage: KVCacheStorage | None = None
    caches: list = []
    kv_worker: RankKVWorkerHost | None = None
    hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        group.broadcast(hdr, wait=True)
        cmd = Command(int(hdr[0]))
        if cmd == Command.STOP:
            logger.info("rank %d: stop", group.rank)
            return
        if cmd == Command.NOOP:
            continue
        if cmd == Command.INIT_KV:  # (not an inference tensor: the KV worker writes it too)
            storage = make_storage(config, mc, shard, int(hdr[1]), group.device, group.rank)
            caches = _groups(config, mc, group.rank).layer_caches(storage.layer_caches())
            continue
        if cmd == Command.START_KV_WORKER:
            kv_worker = serve_start_request(group.store, group.rank, storage, kv_worker,
                                            config.security.tls)
            continue
        with torch.inference_mode():
            payload = group.broadcast(torch.empty(payload_len(hdr), dtype=torch.int64))
            step = decode_step(hdr, payload, group.device)
            model(step.input_ids, step.positions, step.meta, caches, keep_rows=step.keep_rows)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) is gone; exiting", parent_pid)
            os._exit(1)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    enable_crash_stacks()  # a native crash prints every thread's Python stack
    p = argparse.ArgumentParser(prog="python -m xllm_py.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    config, model_dir, parent_pid, log_level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [tp{args.rank}] %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="tp-parent-watch").start()
    torch.set_num_threads(threads_per_rank(config))
    torch.manual_seed(config.seed)
    device = rank_device(config.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        store = TPGroup.connect(args.port, args.world_size)
        group = TPGroup(store, args.rank, args.world_size, device, config.tp_timeout_s)
        model, mc, shard = load_rank(config, model_dir, group)
        group.barrier(wait=True)
        serve(config, model, mc, shard, group)
    except Exception:
        logger.exception("tensor-parallel rank %d failed; exiting", args.rank)
        os._exit(1)
    os._exit(0)  # (no interpreter teardown racing the process groups' threads)


if __name__ == "__main__":
    main()
