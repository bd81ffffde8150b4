"""ModelConfig: the architecture facts of a decoder-only HF checkpoint.

Parsed from ``config.json`` (and ``generation_config.json`` for the eos ids) without
importing ``transformers``. Both spellings of the RoPE settings are accepted: the
transformers 4.x ``rope_theta`` + ``rope_scaling`` keys and the 5.x ``rope_parameters``
dict.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    attention_bias: bool = False  # bias on q/k/v/o (Llama, Qwen3 option)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "intermediate_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu'")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default")
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope type {rope_type!r}; supported: "
                    f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
                )
            if rope_type == "llama3":
                for key in ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings"):
                    if key not in self.rope_scaling:
                        raise ValueError(f"llama3 rope scaling needs {key!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any],
                  generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from the parsed config.json (and generation_config.json) dicts."""
        archs = cfg.get("architectures") or []
        if archs:
            arch = archs[0]
        elif cfg.get("model_type") in _MODEL_TYPE_TO_ARCH:
            arch = _MODEL_TYPE_TO_ARCH[cfg["model_type"]]
        else:
            raise ValueError(
                "config.json names no architecture (no 'architectures' and model_type "
                f"{cfg.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"config.json is missing {key!r}")
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _parse_rope(cfg)
        eos_ids: list[int] = []
        for src in (generation_config or {}, cfg):
            eos_ids.extend(_as_id_list(src.get("eos_token_id")))
        eos_ids = list(dict.fromkeys(eos_ids))
        bos = cfg.get("bos_token_id")
        if bos is None and generation_config:
            bos = generation_config.get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=str(dtype),
            attention_bias=(arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False))),
            qkv_bias=(arch == "Qwen2ForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=(arch == "Qwen3ForCausalLM"),
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
        """Read ``config.json`` (required) and ``generation_config.json`` (optional)."""
        path = pathlib.Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"missing config.json in model directory {str(path)!r}")
        cfg = _read_json(cfg_path)
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(cfg, gen)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling or None) from either spelling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # per-layer-type dict ({"full_attention": {...}}): one type is all we support
        first = next(iter(params.values()))
        if isinstance(first, dict):
            params = first
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict):
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None:
            scaling = params
    if theta is None:
        theta = 10000.0
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling.setdefault("original_max_position_embeddings",
                               cfg.get("max_position_embeddings", 2048))
    else:
        scaling = None
    return float(theta), scaling
