"""Tensor and pipeline parallelism: one instance as N worker processes.

  group.py       TPGroup: the ranks joined by torch.distributed (gloo; NCCL on CUDA)
  layers.py      RowParallelLinear: o_proj / down_proj with their all-reduce
  loader.py      load_model_shard: a rank's slices of an HF checkpoint
  protocol.py    the commands rank 0 broadcasts (one step's inputs, INIT_KV, ...)
  executor.py    TPExecutor + TPModel: rank 0, behind the engine's model object
  pipeline.py    StageModel: a pipeline stage's layers; the stream passed stage to stage
  worker.py      ranks > 0: python -m xllm_py.parallel.worker
  kv_workers.py  every rank's KV worker (transfer endpoint + WorkerService)
  instance_peers.py  InstancePeers: the PD code's calls to other engines, and its KV moves
                 fanned out over the ranks of both instances (one worker client per rank)

Import the modules, not this package.
"""
