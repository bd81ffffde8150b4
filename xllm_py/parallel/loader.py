"""Load one tensor-parallel rank's shard of an HF checkpoint.

Stages (as ``model.loader.load_model``, per rank): check the directory -> the rank's
``TPShard`` -> build the local model (its head and column counts) on ``meta``, wrap
o_proj and down_proj in ``RowParallelLinear`` -> check every checkpoint name and full
shape from the headers -> allocate -> read only the rank's slice of each tensor
(``safe_open(...).get_slice``): rows of q/k/v and gate/up, columns of o_proj and
down_proj, whole replicated tensors; the LM head on rank 0 only.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import time

import torch
from safetensors import safe_open

from xllm_py.model.config import ModelConfig
from xllm_py.model.llama import LlamaForCausalLM
from xllm_py.model.loader import (_IGNORED, _MODEL_CLASSES, _materialize, check_model_dir,
                                  find_weight_files, norm_weight_names, resolve_dtype)
from xllm_py.parallel.group import TPGroup
from xllm_py.parallel.layers import RowParallelLinear
from xllm_py.model.sharding import TPShard, shard_config, shard_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Slice:
    param: str  # our parameter name
    dst_row: int  # first row of our parameter it fills (fused q/k/v, gate/up)
    dim: int  # dimension of the checkpoint tensor the rank takes a range of (-1: whole)
    start: int
    length: int
    shape: tuple[int, ...]  # full checkpoint shape


def _rows(param: str, dst_row: int, start: int, length: int, full: tuple[int, ...]) -> _Slice:
    return _Slice(param, dst_row, 0, start, length, full)


def _targets(config: ModelConfig, shard: TPShard, params: dict[str, tuple[int, ...]]
             ) -> dict[str, _Slice | None]:
    """HF checkpoint name -> the slice this rank reads (None: present, not needed here)."""
    hd, hidden = config.head_dim, config.hidden_size
    q0, kv0, i0 = shard.q_heads[0] * hd, shard.kv_heads[0] * hd, shard.intermediate[0]
    nq, nkv, ni = shard.num_heads * hd, shard.num_kv_heads * hd, shard.intermediate_size
    out: dict[str, _Slice | None] = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = f"{p}self_attn.qkv_proj.{kind}"
            if qkv in params:
                tail = (hidden,) if kind == "weight" else ()
                for part, dst, start, n, full in (
                        ("q_proj", 0, q0, nq, config.q_size), ("k_proj", nq, kv0, nkv, config.kv_size),
                        ("v_proj", nq + nkv, kv0, nkv, config.kv_size)):
                    out[f"{p}self_attn.{part}.{kind}"] = _rows(qkv, dst, start, n, (full,) + tail)
            gate_up = f"{p}mlp.gate_up_proj.{kind}"
            if gate_up in params:
                tail = (hidden,) if kind == "weight" else ()
                full = (config.intermediate_size,) + tail
                out[f"{p}mlp.gate_proj.{kind}"] = _rows(gate_up, 0, i0, ni, full)
                out[f"{p}mlp.up_proj.{kind}"] = _rows(gate_up, ni, i0, ni, full)
        for hf, ours, start, n, full in (
                (f"{p}self_attn.o_proj", f"{p}self_attn.o_proj.linear", q0, nq, config.q_size),
                (f"{p}mlp.down_proj", f"{p}mlp.down_proj.linear", i0, ni,
                 config.intermediate_size)):
            out[f"{hf}.weight"] = _Slice(f"{ours}.weight", 0, 1, start, n, (hidden, full))
            if f"{ours}.bias" in params:
                out[f"{hf}.bias"] = _Slice(f"{ours}.bias", 0, -1, 0, hidden, (hidden,))
            elif shard.rank and _has_bias(config, hf):
                out[f"{hf}.bias"] = None  # added once, by rank 0
    for name, shape in params.items():  # everything else is replicated, read whole
        if ".qkv_proj." in name or ".gate_up_proj." in name or ".linear." in name:
            continue
        out[name] = _Slice(name, 0, -1, 0, shape[0], shape)
    if shard.rank and not config.tie_word_embeddings:
        out["lm_head.weight"] = None
    return out


def _has_bias(config: ModelConfig, hf: str) -> bool:
    return config.attention_bias if "self_attn" in hf else config.mlp_bias


def build_shard_model(config: ModelConfig, shard: TPShard, group: TPGroup) -> LlamaForCausalLM:
    """The rank's local model on the current default device, row-parallel layers wrapped;
    rank > 0 without the LM head (and without the row-parallel biases)."""
    model = _MODEL_CLASSES[config.architecture](shard_config(config, shard))
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            if shard.rank:
                linear.bias = None
            setattr(parent, name, RowParallelLinear(linear, group))
    if shard.rank and not config.tie_word_embeddings:
        model.lm_head = None  # only rank 0 computes logits
    model.fused_decode = False  # the fused native decode runs whole layers: no all-reduce
    return model


def load_model_shard(model_dir: str | pathlib.Path, group: TPGroup,
                     dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                     require_tokenizer: bool = True
                     ) -> tuple[LlamaForCausalLM, ModelConfig, TPShard]:
    """Load rank ``group.rank``'s shard -> (local model in eval mode, full ModelConfig, shard)."""
    started = time.perf_counter()
    path = pathlib.Path(model_dir)
    config = check_model_dir(path, require_tokenizer=require_tokenizer)
    shard = shard_for(config, group.rank, group.world_size)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    with torch.device("meta"):
        model = build_shard_model(config, shard, group)
    params = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=True)}
    targets = _targets(config, shard, params)

    plan: list[tuple[pathlib.Path, str, _Slice]] = []
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in find_weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name not in targets:
                    unexpected.append(name)
                    continue
                seen.add(name)
                target = targets[name]
                if target is None:
                    continue
                found = tuple(f.get_slice(name).get_shape())
                if found != target.shape:
                    raise ValueError(f"tensor {name!r} in {file.name} has shape {list(found)}, "
                                     f"expected {list(target.shape)}")
                plan.append((file, name, target))
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint for {config.architecture}: "
                         f"{', '.join(sorted(unexpected)[:10])}")
    missing = sorted(n for n, t in targets.items() if t is not None and n not in seen)
    if missing:
        raise ValueError(f"missing tensor(s) in checkpoint: {', '.join(missing[:10])}")

    _materialize(model, torch_dtype, device)
    model.tie_weights()
    ours = dict(model.named_parameters(remove_duplicate=True))
    norms = norm_weight_names(ours, config)
    with torch.no_grad():
        for file in dict.fromkeys(f for f, _, _ in plan):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for _, name, t in (e for e in plan if e[0] == file):
                    sl = f.get_slice(name)
                    if t.dim < 0:
                        src = sl[:]
                    elif t.dim == 0:
                        src = sl[t.start:t.start + t.length]
                    else:
                        src = sl[:, t.start:t.start + t.length]
                    dst = ours[t.param]
                    if dst.shape[0] != src.shape[0]:
                        dst = dst.narrow(0, t.dst_row, src.shape[0])
                    dst.copy_(src)
                    if t.param in norms:
                        dst.add_(config.norm_offset)  # Gemma: the norm scales by (1 + w)
    model.requires_grad_(False)
    model.eval()
    logger.info("rank %d/%d: loaded %s shard (q heads %s, KV heads %s, MLP columns %s, %.1fM "
                "params) in %.2f s", shard.rank, shard.tp_size, path.name, shard.q_heads,
                shard.kv_heads, shard.intermediate,
                sum(p.numel() for p in ours.values()) / 1e6, time.perf_counter() - started)
    return model, config, shard
