"""The LM head's argmax without logits and the native draw (model/lm_head.py,
csrc/head_argmax.c, csrc/sample.c) against torch, and the sampler on HeadRows against the
sampler on the same rows' logits."""
import pytest
import torch

from tests.unit.sampling_rows import srow
from xllm_py.engine.sampler import Sampler, compute_probs
from xllm_py.model import cpu_kernels, kernel_build, lm_head
from xllm_py.model.lm_head import HeadRows
from xllm_py.model.packed import PackedLinear

needs_panels = pytest.mark.skipif(not cpu_kernels.linear_available(),
                                  reason="needs the native panel kernels (AVX2/FMA)")


def _head(n: int, k: int, dtype: str, bias: bool, seed: int = 0) -> PackedLinear:
    rng = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng))
        if dtype == "bfloat16":
            lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    int8 = None
    if dtype == "int8":
        q = torch.randint(-127, 128, (n, k), generator=rng, dtype=torch.int8)
        s = torch.rand(n, k // 32, generator=rng) / 64
        with torch.no_grad():
            lin.weight.copy_((q.float().view(n, -1, 32) * s.unsqueeze(2)).view(n, k))
        int8 = (q, s)
    head = PackedLinear(lin, weight_dtype=getattr(torch, dtype if dtype != "int8" else "float32"),
                        int8=int8)
    if int8 is not None:
        assert head._scales is not None
    return head


def _isas() -> list[str]:
    best = kernel_build.choose_isa(None, kernel_build.cpu_flags())
    return ["avx2", "avx512"] if best == "avx512" else [best]


@needs_panels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_head_argmax_is_the_argmax_of_the_logits(dtype: str, bias: bool) -> None:
    """Every row count the panel kernel takes, partial panels, each build."""
    for isa in _isas():
        with cpu_kernels.built_for(isa):
            for n in (1000, 16 * 97 + 5):
                head = _head(n, 320, dtype, bias)
                for m in (1, 2, 7, 12, 13, 32, 96):
                    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m))
                    got = lm_head.head_argmax(head, x)
                    assert got is not None and got.tolist() == head(x).argmax(-1).tolist(), (
                        isa, n, m)


@needs_panels
def test_head_argmax_ties_go_to_the_first_index() -> None:
    """Equal logits in different panels, at both ends of the vocabulary (different threads'
    runs of panels, column lanes): the first wins, as torch.argmax; with a NaN, torch's."""
    head = _head(4096, 64, "float32", False)
    w = torch.zeros(4096, 64)
    for i in (5, 2000, 4090):
        w[i] = 1.0
    head._panels = cpu_kernels.pack_panels(w)
    x = torch.ones(3, 64)
    assert lm_head.head_argmax(head, x).tolist() == [5, 5, 5]
    b = torch.zeros(4096)
    b[5] = -1.0  # now 2000 and 4090 tie
    head.bias = torch.nn.Parameter(b, requires_grad=False)
    assert lm_head.head_argmax(head, x).tolist() == [2000] * 3
    b[3000] = float("nan")  # the kernel declines; the logits' argmax is torch's (the NaN)
    assert lm_head.head_argmax(head, x) is None
    rows = HeadRows(x, head, lambda h: head(h).float(), 4096)
    assert rows.argmax() == head(x).argmax(-1).tolist() == [3000] * 3


def test_head_argmax_declines_what_it_does_not_handle() -> None:
    head = _head(100, 64, "float32", False)
    assert lm_head.head_argmax(head, torch.randn(cpu_kernels.PANEL_MAX_ROWS + 1, 64)) is None
    assert lm_head.head_argmax(torch.nn.Linear(64, 100), torch.randn(2, 64)) is None
    rows = HeadRows(torch.randn(cpu_kernels.PANEL_MAX_ROWS + 3, 64), head,
                    lambda h: head(h).float(), 100)
    assert rows.argmax() == rows.logits().argmax(-1).tolist()  # (the logits' argmax)


needs_vnni = pytest.mark.skipif(not cpu_kernels.vnni_available(),
                                reason="needs AVX512-VNNI (csrc/head_vnni.c)")


def _vnni(head: PackedLinear, x: torch.Tensor) -> list[int] | None:
    """csrc/head_vnni.c's answer for x on int8 ``head`` (None: it declined)."""
    tables, sa = head.vnni_tables()
    x = x.contiguous()
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    rc = cpu_kernels._load().xllm_head_argmax_vnni(
        x.data_ptr(), tables.data_ptr(), head._scales.data_ptr(), sa.data_ptr(),
        head._panels.data_ptr(), ids.data_ptr(), x.shape[0], head.out_features,
        head.in_features)
    return ids.tolist() if rc == 0 else None


def _int8_head(q: torch.Tensor, s: torch.Tensor) -> PackedLinear:
    n, k = q.shape
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_((q.float().view(n, -1, 32) * s.unsqueeze(2)).view(n, k))
    return PackedLinear(lin, int8=(q, s))


@needs_vnni
def test_integer_pass_gives_the_logits_argmax() -> None:
    """Random heads and rows (some with a large outlier, as real hidden states have),
    every row count, a partial last panel: the index of the logits' argmax."""
    for n in (1000, 16 * 97 + 5, 20000):
        head = _head(n, 640, "int8", False, seed=n)
        for m in (1, 3, 4, 5, 32, 96):
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, 640, generator=g)
            x[:, 7] *= 40.0
            assert _vnni(head, x) == head(x).argmax(-1).tolist(), (n, m)


@needs_vnni
def test_integer_pass_keeps_exact_ties_and_near_ties() -> None:
    """Columns equal but for one weight step (logits a few ulps apart, far inside the
    integer pass's error): the exact sums decide; equal columns: the first index."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-100, 100, (4096, 64), generator=g, dtype=torch.int8)
    s = torch.full((4096, 2), 1 / 64)
    for i in (10, 1500, 3000, 4090):
        q[i] = 100
    q[3000, 63] = 101  # 3000 > 10 = 1500 = 4090 where x[63] > 0
    head = _int8_head(q, s)
    x = torch.ones(2, 64)
    x[1, 63] = -1.0  # row 1: 3000 is below the other three
    assert _vnni(head, x) == head(x).argmax(-1).tolist() == [3000, 10]


@needs_vnni
def test_integer_pass_on_rows_too_flat_to_bound() -> None:
    """Every column equal or nearly (more candidates than a thread keeps): the exact sums
    over every panel, the first index on a tie; the others keep their integer pass."""
    g = torch.Generator().manual_seed(2)
    q = torch.full((40000, 64), 3, dtype=torch.int8)
    q[31000, 0] = 4  # above the rest where x[0] > 0
    rand = torch.randint(-3, 4, (40000, 64), generator=g, dtype=torch.int8)
    head = _int8_head(torch.cat([q, rand]), torch.full((80000, 2), 0.5))
    x = torch.rand(3, 64, generator=g) + 0.1
    x[1, 0] = -1.0  # row 1: every column of the first half ties but 31000, below them
    x[2] = -x[2]  # row 2: the first half lowest, a column of the random half wins
    want = head(x).argmax(-1).tolist()
    assert want[:2] == [31000, 0] and want[2] >= 40000
    assert _vnni(head, x) == want


@needs_vnni
def test_integer_pass_declines_a_row_that_is_not_finite() -> None:
    head = _head(1000, 64, "int8", False)
    x = torch.randn(2, 64)
    x[1, 5] = float("inf")
    assert _vnni(head, x) is None


def _reference_draw(logits: torch.Tensor, row, u: float) -> int:
    """compute_probs, then the inverse CDF in float64 (the draw's definition)."""
    p = compute_probs(logits.unsqueeze(0), [row])[0].double()
    cdf = p.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([[u * float(cdf[-1])]], dtype=torch.float64),
                                  right=True)[0, 0])


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native kernels")
@pytest.mark.parametrize("params", [
    dict(temperature=0.8), dict(temperature=1.0, top_k=7), dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, min_p=0.2), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05),
    dict(temperature=1.0, top_p=0.999), dict(temperature=2.0, top_k=1000)])
def test_native_draw_matches_compute_probs(params: dict) -> None:
    """Same distribution, same inverse-CDF draw: every uniform picks the token the torch
    probabilities pick (a few hundred vocabularies: top_p alone past its first 64)."""
    vocab, n = 700, 400
    rng = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=rng) * 2
    us = torch.rand(n, dtype=torch.float64, generator=rng).tolist()
    row = srow(**params)
    k = row.params.top_k if 0 < row.params.top_k < vocab else 0
    got = lm_head.sample_rows(logits, [row.params.temperature] * n, [k] * n,
                              [row.params.top_p] * n, [row.params.min_p] * n, us)
    want = [_reference_draw(logits[i], row, us[i]) for i in range(n)]
    assert got == want


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native kernels")
def test_native_draw_declines_rows_without_a_finite_logit() -> None:
    logits = torch.randn(2, 50)
    logits[1] = float("-inf")
    assert lm_head.sample_rows(logits, [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [0.5] * 2) is None
    logits[1, 3] = float("nan")
    assert lm_head.sample_rows(logits, [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [0.5] * 2) is None


@needs_panels
def test_sampler_on_head_rows_equals_the_sampler_on_logits() -> None:
    """Greedy rows only (argmax in the head), and mixed batches: greedy with logprobs,
    with a logit bias, penalties, seeded and unseeded random rows; tokens and logprobs
    equal."""
    head = _head(3000, 64, "int8", False)
    hidden = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    rows = [srow(temperature=0.0), srow(temperature=0.0, logprobs=3), srow(temperature=0.0),
            srow(temperature=0.0, logit_bias={17: 100.0}), srow(temperature=0.7, seed=9),
            srow(temperature=1.0, top_p=0.9), srow(temperature=0.0, presence_penalty=1.0,
                                                   output_token_ids=[1, 2]),
            srow(temperature=1.0, top_k=5, logprobs=2)]
    passes = []

    def to_logits(h: torch.Tensor) -> torch.Tensor:
        passes.append(h.shape[0])
        return head(h).float()

    for batch, want in ((rows, [8]), ([rows[0], rows[2]], []), ([rows[4], rows[5]], [2])):
        idx = [rows.index(r) for r in batch]
        h = hidden[idx]
        passes.clear()
        a = Sampler(seed=1)(HeadRows(h, head, to_logits, 3000), batch)
        assert passes == want  # greedy only: no logits; else one pass over every row
        b = Sampler(seed=1)(to_logits(h), batch)
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
