"""Load an HF-format checkpoint directory into our model.

Stages: check the directory (config.json, tokenizer.json, safetensors weights) -> parse
``ModelConfig`` -> read every tensor header and check names and shapes against the model
(fail before loading anything) -> build the model on the ``meta`` device, allocate it
empty on the target device -> stream tensors one at a time with ``safe_open`` into the
parameters (q/k/v and gate/up go into row slices of the fused weights) -> from a
converted GGUF, the raw blocks of its K-quant weights onto their linears
(kquant_panels.attach_blocks; packing keeps those weights quantized).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import sys
import time
from dataclasses import dataclass

import torch
from safetensors import safe_open

from xllm_py.model import kquant_panels
from xllm_py.model.config import ModelConfig
from xllm_py.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# Checkpoint tensors that carry nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class _Target:
    param: str  # our parameter name
    row_start: int  # first row of the slice (fused weights), 0 otherwise
    shape: tuple[int, ...]  # expected checkpoint shape


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' | 'auto' (config's dtype) | torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        name = config.torch_dtype if config is not None else "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    return _DTYPES[name]


def find_weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """``model.safetensors``, the shards named by ``model.safetensors.index.json``, or
    every ``*.safetensors`` file; ``FileNotFoundError`` when there are none."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index.name} has no valid 'weight_map': {exc}") from exc
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"weight shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    hint = " (only PyTorch .bin weights found; convert to safetensors)" if any(
        model_dir.glob("*.bin")) else ""
    raise FileNotFoundError(
        f"no weights in {str(model_dir)!r}: expected model.safetensors or "
        f"model.safetensors.index.json{hint}")


def check_model_dir(model_dir: str | pathlib.Path, require_tokenizer: bool = True) -> ModelConfig:
    """Fail fast on a bad directory; return its ``ModelConfig``."""
    path = pathlib.Path(model_dir)
    config = ModelConfig.from_dir(path)  # missing dir / config.json / bad architecture
    find_weight_files(path)
    if require_tokenizer and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"missing tokenizer file tokenizer.json in {str(path)!r}")
    return config


def _targets(model: LlamaForCausalLM, config: ModelConfig) -> dict[str, _Target]:
    """HF checkpoint name -> where it goes in our model."""
    targets: dict[str, _Target] = {}
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for name, param in model.named_parameters(remove_duplicate=True):
        shape = tuple(param.shape)
        if ".qkv_proj." in name:
            for part, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                hf = name.replace("qkv_proj", part)
                targets[hf] = _Target(name, start, (rows,) + shape[1:])
        elif ".gate_up_proj." in name:
            for part, start in (("gate_proj", 0), ("up_proj", inter)):
                hf = name.replace("gate_up_proj", part)
                targets[hf] = _Target(name, start, (inter,) + shape[1:])
        else:
            targets[name] = _Target(name, 0, shape)
    return targets


def norm_weight_names(params: dict[str, torch.nn.Parameter], config: ModelConfig) -> set[str]:
    """The RMSNorm weights whose stored value is off by ``config.norm_offset`` (Gemma
    stores w and scales by 1 + w): they are loaded as offset + w, so every norm kernel
    scales by its weight alone. Empty for the other families."""
    if not config.norm_offset:
        return set()
    return {name for name in params if name.endswith("norm.weight")}


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage (``to_empty`` without its slow
    first-call path); a parameter shared by two modules stays shared."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = made.get(id(param))
            if new is None:
                new = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                         requires_grad=False)
                made[id(param)] = new
            module._parameters[name] = new


def load_model(model_dir: str | pathlib.Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu",
               require_tokenizer: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load ``model_dir`` (HF format, safetensors) -> (model in eval mode, ModelConfig)."""
    started = time.perf_counter()
    path = pathlib.Path(model_dir)
    config = check_model_dir(path, require_tokenizer=require_tokenizer)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    files = find_weight_files(path)

    with torch.device("meta"):
        model = _MODEL_CLASSES[config.architecture](config)
    targets = _targets(model, config)

    # Check every name and shape from the headers before reading any data.
    plan: list[tuple[pathlib.Path, str, _Target]] = []
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                found = tuple(f.get_slice(name).get_shape())
                if found != target.shape:
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has shape {list(found)}, "
                        f"expected {list(target.shape)}")
                seen.add(name)
                plan.append((file, name, target))
    if unexpected:
        raise ValueError(
            f"unexpected tensor(s) in checkpoint for {config.architecture}: "
            f"{', '.join(sorted(unexpected)[:10])}"
            + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
    missing = sorted(set(targets) - seen)
    if missing:
        raise ValueError(
            f"missing tensor(s) in checkpoint: {', '.join(missing[:10])}"
            + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))

    _materialize(model, torch_dtype, device)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=True))
    norms = norm_weight_names(params, config)
    show_progress = sys.stderr.isatty()
    total = len(plan)
    done = 0
    by_file: dict[pathlib.Path, list[tuple[str, _Target]]] = {}
    for file, name, target in plan:
        by_file.setdefault(file, []).append((name, target))
    with torch.no_grad():
        for file, entries in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name, target in entries:
                    tensor = f.get_tensor(name)
                    dst = params[target.param]
                    if target.row_start or dst.shape[0] != target.shape[0]:
                        dst = dst.narrow(0, target.row_start, target.shape[0])
                    dst.copy_(tensor)
                    if name in norms:
                        dst.add_(config.norm_offset)  # Gemma: the norm scales by (1 + w)
                    del tensor
                    done += 1
                    if show_progress:
                        print(f"\rloading weights: {done}/{total}", end="", file=sys.stderr,
                              flush=True)
    if show_progress:
        print(file=sys.stderr)
    # a converted GGUF's K-quant blocks, for the packing to keep them quantized
    kquant_panels.attach_blocks(model, path, {name: (t.param, t.row_start)
                                              for name, t in targets.items()})
    model.requires_grad_(False)
    model.eval()
    elapsed = time.perf_counter() - started
    num_params = sum(p.numel() for p in params.values())
    logger.info("loaded %s (%s, %.1fM params, %s on %s) in %.2f s", path.name,
                config.architecture, num_params / 1e6, str(torch_dtype).removeprefix("torch."),
                device, elapsed)
    return model, config
