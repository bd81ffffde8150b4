"""The grammar's token mask on a logits batch (torch; called by the sampler).

A TokenMask names the rows with a constraint and holds their llguidance bitmasks (int32
words, bit t of word t // 32 set: token t allowed). `apply_token_mask` sets the logits
of every disallowed token of those rows to -inf, after bias and penalties and before
greedy / random sampling, so both only ever pick an allowed token; rows without a
constraint are not touched (a batch without one builds no TokenMask at all).

On CPU the bitmask is inverted and unpacked by numpy into bytes (one per token, 1 =
disallowed) that torch views as bool without a copy; on a GPU it is copied over and
unpacked there with shifts. Either way one masked_fill per constrained row block.
"""
from __future__ import annotations

import numpy as np
import torch

from xllm_py.structured.compiler import TokenMask

__all__ = ["TokenMask", "apply_token_mask"]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` [N, V] with the disallowed tokens of mask.rows at -inf (in place when
    `logits` may be written: the caller passes a copy if it needs the raw values). The
    model's logits are inference tensors: they are written in inference mode."""
    with torch.inference_mode(logits.is_inference()):
        return _apply(logits, mask)


def _apply(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = mask.bitmask[:len(mask.rows)]
    blocked_t = blocked_cpu(bits) if logits.device.type == "cpu" else \
        blocked_on_device(bits, logits.device)
    width = min(vocab, blocked_t.shape[1])
    blocked_t = blocked_t[:, :width]
    if len(mask.rows) == logits.shape[0]:
        logits[:, :width].masked_fill_(blocked_t, float("-inf"))
        if width < vocab:  # logits past the grammar's vocabulary: never allowed
            logits[:, width:] = float("-inf")
        return logits
    idx = torch.tensor(mask.rows, device=logits.device)
    sub = logits.index_select(0, idx)
    sub[:, :width].masked_fill_(blocked_t, float("-inf"))
    if width < vocab:
        sub[:, width:] = float("-inf")
    logits.index_copy_(0, idx, sub)
    return logits


def blocked_cpu(bits: np.ndarray) -> torch.Tensor:
    """bool [rows, 32 * words]: True where the token is disallowed (numpy unpack, a view)."""
    blocked = np.unpackbits(np.invert(bits).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(blocked).view(torch.bool)


def blocked_on_device(bits: np.ndarray, device: torch.device) -> torch.Tensor:
    """The same on `device` (a GPU): the words copied over, unpacked there with shifts."""
    words = torch.from_numpy(bits).to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).eq(0).reshape(bits.shape[0], -1)
