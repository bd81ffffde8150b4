"""TPGroup: the ranks of one tensor-parallel instance, joined by torch.distributed.

Stages: rank 0 opens a TCPStore on a free loopback port (``TPGroup.listen``) -> every rank
connects (``TPGroup.join``) and builds its process groups from it -> collectives -> close.

Two process groups, as vLLM keeps a CPU and a device group: a gloo group that carries the
per-step inputs rank 0 broadcasts (small int64 tensors, always on the CPU), and, on CUDA,
an NCCL group for the activations' all-reduce (on CPU the gloo group does both). The
process group objects are made directly from the store (not ``init_process_group``), so
several instances can live in one process (tests) and nothing global is touched.

Timeouts: ``step_timeout_s`` bounds every collective of a step (a rank that dies makes
its peers' next collective fail at once with "connection closed"; one that hangs, after
this long); waiting for the next step (``wait_timeout_s``) may take as long as the
instance stays idle.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# An idle instance's ranks > 0 wait this long for rank 0's next command (a keep-alive
# comes far more often, see executor.KEEPALIVE_S).
DEFAULT_WAIT_TIMEOUT_S = 3600.0


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 step_timeout_s: float, wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.step_timeout = datetime.timedelta(seconds=step_timeout_s)
        self.wait_timeout = datetime.timedelta(seconds=wait_timeout_s)
        # Rendezvous of the groups themselves may take as long as the slowest rank's start.
        join = datetime.timedelta(seconds=max(step_timeout_s, 120.0))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = join
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank,
                                               world_size, opts)
        if device.type == "cuda":
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = join
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("dev", store), rank,
                                                      world_size, nccl_opts)
        else:
            self.device_group = self.cpu_group

    def subgroup(self, name: str, rank: int, world_size: int) -> "TPGroup":
        """A group of some of this group's ranks (a pipeline stage's TP ranks), each
        calling this with the same ``name``, its rank in it and its size: its own
        process groups, rendezvous under ``name`` in this group's store."""
        return TPGroup(dist.PrefixStore(name, self.store), rank, world_size, self.device,
                       self.step_timeout.total_seconds(), self.wait_timeout.total_seconds())

    @staticmethod
    def listen(world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
        """Rank 0: the rendezvous store, on a free loopback port (``store.port``)."""
        return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def connect(port: int, world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
        """Ranks > 0: the store rank 0 listens on."""
        return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous) over the ranks, in place; returns it."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.step_timeout
        self.device_group.allreduce([t], opts).wait()
        return t

    def broadcast(self, t: torch.Tensor, wait: bool = False) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (CPU, contiguous), in place. ``wait``:
        a rank > 0 waiting for rank 0's next command (the long timeout)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.wait_timeout if wait else self.step_timeout
        self.cpu_group.broadcast([t], opts).wait()
        return t

    def barrier(self, wait: bool = False) -> None:
        """Every rank reached this point (``wait``: with the long timeout, e.g. loading)."""
        self.all_reduce_cpu(torch.zeros(1), wait=wait)

    def all_reduce_cpu(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                       wait: bool = False) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.wait_timeout if wait else self.step_timeout
        self.cpu_group.allreduce([t], opts).wait()
        return t
