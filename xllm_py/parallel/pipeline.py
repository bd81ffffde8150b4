"""Pipeline parallelism: one instance as N stage processes, each with a contiguous range of
the model's layers (model/kv_layout.pp_layer_ranges) and the KV pool of those layers only.

Rank 0, the engine, runs the last stage: it alone has the final norm and the LM head, so
it samples as a TP 1 engine does. Rank r >= 1 runs stage r - 1; stage 0 embeds the
tokens. With tensor parallelism too (TP x PP), a stage is TP ranks: rank
``(stage + 1) % pp * tp + tp_rank`` (model/kv_layout.rank_of), each loading its TP
shard of the stage's layers and all-reducing in a group of its stage's ranks alone; after
the all-reduce every TP rank holds the whole stream, so each sends it to the rank of its
own TP index in the next stage. A step (the executor's, parallel/executor.py, unchanged): rank 0 broadcasts the
step's inputs to every rank, each stage waits for the residual stream of the stage before
it (gloo recv of ``[2, T, hidden]``: the last layer's output and the residual, so the next
layer adds them as it would in one process), runs its layers on it and sends it on; the
last stage normalises, keeps the rows that need logits and computes them. Stages run one
after the other (no micro-batches): correct first. Plain attention path (no fused decode
kernels).

A hybrid model (Gemma 3, model/kv_groups.py): the scheduler's block tables are the whole
model's KV groups; each stage attends per layer with the plan of its (window, group) and
the RoPE table of its attention type, and its pool holds only the group slots its layers
use (KVGroups.stage: a stage of sliding layers alone, full ones alone, or both). The
sandwich norms are the layers' own; the embedding scale is stage 0's, the final norm the
last stage's, as in one process.
"""
from __future__ import annotations

import torch
from torch import nn

from xllm_py.config import EngineConfig
from xllm_py.model.attention import AttentionMetadata, plan_attention
from xllm_py.model.config import ModelConfig
from xllm_py.model.kv_layout import pp_layer_ranges, rank_of, stage_of
from xllm_py.parallel.group import TPGroup

# The tag of the stage-to-stage sends (the group's broadcasts carry no tag).
STREAM_TAG = 7


def rank_layers(config: EngineConfig, mc: ModelConfig, rank: int) -> tuple[int, int]:
    """[start, end) of the model layers rank ``rank`` holds (every layer without PP)."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return 0, mc.num_layers
    stage = stage_of(rank, pp, config.tensor_parallel_size)
    return pp_layer_ranges(mc.num_layers, pp, config.pp_layer_partition)[stage]


def pp_error(config: EngineConfig, mc: ModelConfig) -> str | None:
    """Why ``mc`` cannot be split into the configured stages, or None."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return None
    try:
        pp_layer_ranges(mc.num_layers, pp, config.pp_layer_partition)
    except ValueError as e:
        return str(e)
    return None


class StageModel(nn.Module):
    """One stage of a ``LlamaForCausalLM``: the engine's model interface (``forward``,
    ``forward_logits``, ``compute_logits``) on the last stage; on the others a call runs
    the stage and sends the stream on (and returns it)."""

    def __init__(self, model: nn.Module, layers: tuple[int, int], group: TPGroup,
                 pp: int, tp: int = 1) -> None:
        super().__init__()
        self.full = model
        self.layers = layers
        self.stage = stage_of(group.rank, pp, tp)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.group = group  # every rank of the instance: the stream goes between stages
        self.pp, self.tp, self.tp_rank = pp, tp, group.rank % tp
        # only this stage's layers stay: the others' weights are freed
        model.model.layers = nn.ModuleList(list(model.model.layers)[layers[0]:layers[1]])
        # per stage layer its (window, KV group) in the whole model: the block tables of
        # the model's groups are the scheduler's (kv_groups.KVGroups.stage)
        self.keys = model.layer_keys[layers[0]:layers[1]]
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata, kv_caches: list,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(input_ids, positions, attn_metadata, kv_caches, keep_rows, False)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, kv_caches: list,
                       keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(input_ids, positions, attn_metadata, kv_caches, keep_rows, True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.full.compute_logits(hidden)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata, kv_caches: list, keep_rows: torch.Tensor | None,
             logits: bool) -> torch.Tensor:
        layers = self.full.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"stage {self.stage}: expected {len(layers)} (K, V) caches, "
                             f"got {len(kv_caches)}")
        block_size = int(kv_caches[0][0].shape[1])
        plans = self.full.layer_plans(meta, plan_attention(meta, block_size), block_size,
                                      self.keys)
        dtype = self.full.model.embed_tokens.weight.dtype
        if self.first:
            hidden = self.full.model.embed_tokens(input_ids)
            if self.config.embed_scale != 1.0:
                hidden.mul_(torch.tensor(self.config.embed_scale, dtype=hidden.dtype))
            residual = None
        else:
            stream = torch.empty(2, int(input_ids.shape[0]), self.config.hidden_size,
                                 dtype=dtype, device=input_ids.device)
            self._exchange(stream, send=False)
            hidden, residual = stream[0], stream[1]
        cos_sin = self.full.rotary_emb.cos_sin(positions, meta.max_seq_len, dtype)
        local = self.full.local_cos_sin(positions, meta.max_seq_len, dtype)
        for layer, cache, key in zip(layers, kv_caches, self.keys):
            cs = local if key[0] and local is not None else cos_sin
            hidden, residual = layer(hidden, residual, cs, cache, plans[key], None, None)
        if not self.last:
            stream = torch.stack([hidden, residual])
            self._exchange(stream, send=True)
            return stream
        out = self.full.model.norm(hidden, residual)
        if keep_rows is not None:
            out = out[keep_rows]
        return self.full.compute_logits(out) if logits else out

    def _exchange(self, stream: torch.Tensor, send: bool) -> None:
        """Send the stream to the next stage's rank, or receive it from the previous."""
        pg = self.group.cpu_group
        buf = stream if stream.device.type == "cpu" else stream.cpu()
        if send:
            peer = rank_of(self.stage + 1, self.pp, self.tp, self.tp_rank)
            pg.send([buf.contiguous()], peer, STREAM_TAG).wait()
            return
        pg.recv([buf], rank_of(self.stage - 1, self.pp, self.tp, self.tp_rank), STREAM_TAG).wait()
        if buf is not stream:
            stream.copy_(buf)
