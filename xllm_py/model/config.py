"""ModelConfig: the architecture facts of a decoder-only HF checkpoint.

Families: Llama, Qwen2, Qwen3 (one pre-norm block with per-family flags) and Gemma 3 text
(``gemma3_text``: sandwich norms, (1 + w) RMSNorm, GELU-tanh MLP, a scaled embedding and
sliding-window attention on the layers ``layer_types`` names, each type with its own RoPE
base).

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
    "Gemma3ForCausalLM",
)

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

SLIDING = "sliding_attention"
FULL = "full_attention"
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    hidden_act: str = "silu"
    # Gemma 3: per layer "sliding_attention" or "full_attention" (None: every layer full);
    # a sliding layer attends to its last `sliding_window` positions, with RoPE base
    # `rope_local_theta`; the attention scale is query_pre_attn_scalar ** -0.5.
    layer_types: list[str] | None = None
    sliding_window: int = 0
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    embed_scale: float = 1.0  # the embedding is multiplied by this (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w) (Gemma: 1)
    sandwich_norm: bool = False  # norms after attention and MLP outputs too (Gemma)

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
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             f"{', '.join(_ACTIVATIONS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model "
                                 f"has {self.num_layers}")
            bad = sorted(set(self.layer_types) - {SLIDING, FULL})
            if bad:
                raise ValueError(f"unsupported layer type(s) {bad}; supported: {SLIDING}, {FULL}")
            if SLIDING in self.layer_types and self.sliding_window <= 0:
                raise ValueError("sliding_attention layers need a positive sliding_window")
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

    def layer_window(self, layer: int) -> int:
        """Positions layer `layer` attends to (its last ones), 0 = the whole context."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return 0
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        gemma = arch == "Gemma3ForCausalLM"
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            **(_gemma3_fields(cfg, hidden, int(cfg["num_hidden_layers"])) if gemma else {}),
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


def _gemma3_fields(cfg: dict[str, Any], hidden: int, num_layers: int) -> dict[str, Any]:
    """The Gemma 3 text facts of config.json (transformers' Gemma3TextConfig defaults)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{key} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported")
    window = int(cfg.get("sliding_window") or 4096)
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    params = cfg.get("rope_parameters")
    local = None
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        if params[SLIDING].get("rope_type", "default") != "default":
            raise ValueError("sliding_attention layers support only the default RoPE")
        local = params[SLIDING].get("rope_theta")
    local = cfg.get("rope_local_base_freq", local)
    return dict(layer_types=list(types), sliding_window=window,
                rope_local_theta=float(local if local is not None else 10000.0),
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                embed_scale=float(hidden) ** 0.5, norm_offset=1.0, sandwich_norm=True)


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
        # per-layer-type dict ({"full_attention": {...}, ...}): the full layers' here (a
        # sliding type's base is read by _gemma3_fields)
        first = params.get(FULL, next(iter(params.values())))
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
