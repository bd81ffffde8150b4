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

__all__ = ["TokenMask", "apply_token_mask", "masked_greedy"]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` [N, V] with the disallowed tokens of mask.rows at -inf (in place when
    `logits` may be written: the caller passes a copy if it needs the raw values). The
    model's logits are inference tensors: they are written in inference mode."""
    with torch.inference_mode(logits.is_inference()):
        return _apply(logits, mask)


def _apply(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    vocab = logits.shape[1]
    bits = mask.bitmask[:len(mask.rows)]
    if (logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.is_contiguous() and not logits.requires_grad):
        # numpy's masked copy: a third of torch's masked_fill_ here (no thread-pool hand-off)
        arr = logits.numpy()
        blocked = blocked_cpu(bits).numpy()
        width = min(vocab, blocked.shape[1])
        rows = mask.rows if len(mask.rows) < arr.shape[0] else slice(None)
        sub = arr[rows]  # (a copy unless every row is constrained)
        np.copyto(sub[:, :width], -np.inf, where=blocked[:, :width])
        sub[:, width:] = -np.inf  # past the grammar's vocabulary: never allowed
        if not isinstance(rows, slice):
            arr[rows] = sub
        return logits
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


def masked_greedy(logits: torch.Tensor, token_ids: list[int], mask: TokenMask) -> list[int]:
    """Greedy picks under the mask, from the unconstrained ones (`token_ids`, argmax of
    `logits`): a row whose pick its grammar allows keeps it (the masked argmax is the
    same token), only the others are masked and argmaxed again. A model that already
    writes what the grammar wants costs one bit test per row."""
    bits = mask.bitmask
    words = bits.shape[1]
    redo = [j for j, row in enumerate(mask.rows)
            if token_ids[row] >= 32 * words
            or not (int(bits[j, token_ids[row] >> 5]) >> (token_ids[row] & 31)) & 1]
    if not redo:
        return token_ids
    out = list(token_ids)
    vocab = logits.shape[1]
    dense: list[int] = []  # rows that allow many tokens: masked whole
    with torch.inference_mode(logits.is_inference()):
        for j in redo:
            allowed = _few_allowed(bits[j], vocab)
            if allowed is None:
                dense.append(j)
            elif len(allowed):  # ascending ids: the first maximum, as argmax takes it
                ids = torch.from_numpy(allowed).to(logits.device)
                row = mask.rows[j]
                out[row] = int(ids[logits[row].index_select(0, ids).float().argmax()])
        if dense:
            rows = [mask.rows[j] for j in dense]
            sub = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
            sub = _apply(sub, TokenMask(list(range(len(rows))), np.ascontiguousarray(bits[dense])))
            for row, token in zip(rows, sub.argmax(dim=-1).tolist()):
                out[row] = token
    return out


def _few_allowed(words: np.ndarray, vocab: int) -> np.ndarray | None:
    """The allowed token ids of one row's bitmask when they sit in few words (an enum, a
    keyword, a digit: a gather beats masking the whole row), else None."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) * 32 * 16 > vocab:
        return None
    bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32)
    ids = (nonzero[:, None] * 32 + np.arange(32))[bits.astype(bool)]
    return ids[ids < vocab]
