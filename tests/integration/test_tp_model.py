"""Sharded models joined by real gloo groups, the ranks as threads of this process:
logits of TP 2 and TP 4 (KV heads replicated) equal the whole model's; the shards put
together are the checkpoint."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.integration.tp_models import FAMILIES, build_hf_model
from xllm_py.model.attention import AttentionMetadata, allocate_kv_caches, build_positions
from xllm_py.model.loader import load_model
from xllm_py.model.packed import pack_linears
from xllm_py.parallel.group import TPGroup
from xllm_py.parallel.loader import load_model_shard

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

BLOCK = 4
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_hf_model(transformers, request.param, path)
    return path


def _steps():
    """Two steps of a ragged batch: prefills crossing blocks, then a mixed chunk + decode."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 1024, (13,), generator=g), torch.randint(0, 1024, (6,), generator=g)
    tables = {0: [5, 9, 2, 7, 11], 1: [3, 8]}
    return [[(0, 0, a[:9]), (1, 0, b[:5])], [(0, 9, a[9:]), (1, 5, b[5:])]], tables


def _run(model, caches) -> list[torch.Tensor]:
    steps, tables = _steps()
    outs = []
    with torch.inference_mode():
        for chunks in steps:
            seqs = [(start, len(ids), tables[sid]) for sid, start, ids in chunks]
            md = AttentionMetadata.build(seqs, BLOCK)
            ids = torch.cat([c[2] for c in chunks])
            outs.append(model.forward_logits(ids, build_positions(seqs), md, caches))
    return outs


def _tp_logits(model_dir, tp: int, pack: bool) -> tuple[list[torch.Tensor], list]:
    store = TPGroup.listen(tp)

    def rank(r: int):
        s = store if r == 0 else TPGroup.connect(store.port, tp)
        group = TPGroup(s, r, tp, torch.device("cpu"), step_timeout_s=60)
        model, cfg, shard = load_model_shard(model_dir, group)
        if pack:
            pack_linears(model)
        caches = allocate_kv_caches(cfg.num_layers, 16, BLOCK, shard.num_kv_heads, cfg.head_dim)
        steps, tables = _steps()
        outs = []
        with torch.inference_mode():
            for chunks in steps:
                seqs = [(start, len(ids), tables[sid]) for sid, start, ids in chunks]
                md = AttentionMetadata.build(seqs, BLOCK)
                ids = torch.cat([c[2] for c in chunks])
                if r == 0:
                    outs.append(model.forward_logits(ids, build_positions(seqs), md, caches))
                else:
                    model(ids, build_positions(seqs), md, caches)
        return outs, (model, shard)

    with concurrent.futures.ThreadPoolExecutor(tp) as pool:
        results = list(pool.map(rank, range(tp)))
    return results[0][0], [r[1] for r in results]


@pytest.mark.parametrize("tp,pack", [(2, False), (2, True), (4, False)])
def test_tp_logits_equal_the_whole_model(model_dir, tp, pack):
    full, cfg = load_model(model_dir)
    caches = allocate_kv_caches(cfg.num_layers, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    ref = _run(full, caches)
    got, ranks = _tp_logits(model_dir, tp, pack)
    for r, g in zip(ref, got):
        assert g.shape == r.shape
        assert (g - r).abs().max().item() < TOL
    kv = [shard.kv_heads for _, shard in ranks]
    if cfg.num_kv_heads < tp:  # replicated: neighbouring ranks hold the same head
        assert kv == [(r * cfg.num_kv_heads // tp, r * cfg.num_kv_heads // tp + 1)
                      for r in range(tp)]
    if not pack:  # the shards put together are the checkpoint's tensors
        layer = full.model.layers[0]
        o = torch.cat([m.model.layers[0].self_attn.o_proj.linear.weight for m, _ in ranks], 1)
        assert torch.equal(o, layer.self_attn.o_proj.weight)
        down = torch.cat([m.model.layers[0].mlp.down_proj.linear.weight for m, _ in ranks], 1)
        assert torch.equal(down, layer.mlp.down_proj.weight)
        biases = [m.model.layers[0].mlp.down_proj.linear.bias for m, _ in ranks]
        assert all(b is None for b in biases[1:])
        assert (biases[0] is None) == (layer.mlp.down_proj.bias is None)
        assert all(m.lm_head is None for m, _ in ranks[1:]) != cfg.tie_word_embeddings
