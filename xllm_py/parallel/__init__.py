"""Tensor parallelism: one instance as N worker processes.

  sharding.py    TPShard: the query/KV heads and MLP columns of each rank (pure Python)
  group.py       TPGroup: the ranks joined by torch.distributed (gloo; NCCL on CUDA)
  layers.py      RowParallelLinear: o_proj / down_proj with their all-reduce
  loader.py      load_model_shard: a rank's slices of an HF checkpoint
  protocol.py    the commands rank 0 broadcasts (one step's inputs, INIT_KV, ...)
  executor.py    TPExecutor + TPModel: rank 0, behind the engine's model object
  worker.py      ranks > 0: python -m xllm_py.parallel.worker
  kv_workers.py  every rank > 0's KV worker (transfer endpoint + WorkerService)
  tp_peers.py    TPGrpcPeers: PD KV moves fanned out over the ranks of both instances

Import the modules, not this package.
"""
