"""The PD parity matrix (service + PREFILL + DECODE processes, real etcd): prefill {TP 1,
TP 2, PP 2, PP 3 uneven, TP 2 x PP 2} x decode {TP 1, TP 2, PP 2} x PULL and PUSH x the
tcp and ucx transfer backends, on a
random Llama (llama-bias-4l: 4 layers, 2 KV heads; transformers' greedy tokens) and on
gemma-3-270m (hybrid: a full group and five sliding ones, one KV head, replicated at TP 2;
a MIX engine's tokens). Every pairing: the greedy tokens equal the reference's, the moving
side's ranks count on /metrics exactly the handed blocks x the model's whole block bytes
x the decode's copies of a KV head (gemma-3-270m's one head at decode TP 2: 2, else 1):
one figure per model and decode copy whatever the layouts (a head the prefill replicates
is sent from one replica), every pool ends empty (``_check_pair``).

The whole matrix is marked ``matrix`` (skipped unless ``-m`` names it, tests/conftest.py);
two pairings no other file covers run in the default suite. The whole run, with the bytes
table printed at the end (and written to pd_matrix_bytes.md under pytest's base temp),
one backend at a time:
  scripts/test.sh -m "integration or matrix" tests/integration/test_pd_matrix.py -s -k tcp
  scripts/test.sh -m "integration or matrix" tests/integration/test_pd_matrix.py -s -k ucx
"""
from __future__ import annotations

import pytest

from tests.integration.cluster_harness import Harness
from tests.integration.test_pd_pp import BLOCK, _check_pair, gemma_270m_reference, random_reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# llama-bias-4l: 4 layers, 2 KV heads of 16, float32: one block of every layer and head, K and V
LLAMA_BLOCK_BYTES = 2 * 4 * BLOCK * 2 * 16 * 4
PREFILLS = {"TP1": ([], {}), "TP2": (["--tp", "2"], {}), "PP2": (["--pp", "2"], {}),
            "PP3": (["--pp", "3"], {"pp_layer_partition": {"llama": "2,1,1",
                                                            "gemma": "7,6,5"}}),
            "TP2PP2": (["--tp", "2", "--pp", "2"], {})}
DECODES = {"TP1": ([], {}), "TP2": (["--tp", "2"], {}), "PP2": (["--pp", "2"], {})}
# (model, prefill, decode, mode, backend) run by default: pairings test_pd_pp and
# test_pd_tp leave out
DEFAULT = {("llama", "PP3", "TP2", "PUSH", "tcp"), ("gemma", "TP2", "PP2", "PULL", "tcp"),
           ("llama", "TP2PP2", "TP1", "PULL", "tcp"), ("gemma", "TP2PP2", "TP2", "PUSH", "tcp"),
           ("gemma", "PP3", "TP2", "PULL", "ucx")}
_ROWS: list[str] = []


def _cases():
    for model in ("llama", "gemma"):
        for p in PREFILLS:
            for d in DECODES:
                for mode in ("PULL", "PUSH"):
                    for backend in ("tcp", "ucx"):
                        case = (model, p, d, mode, backend)
                        marks = [] if case in DEFAULT else [pytest.mark.matrix]
                        yield pytest.param(*case, marks=marks,
                                           id=f"{model}-{p}to{d}-{mode}-{backend}")


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The bytes table: one row per pairing run, printed and written at the module's end."""
    yield _ROWS
    if not _ROWS:
        return
    head = ("| model | prefill | decode | mode | backend | blocks handed | bytes moved (sum of ranks) "
            "| per rank | decode copies of a head | = blocks x block bytes x copies "
            "| tokens equal |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    text = head + "\n".join(_ROWS) + "\n"
    out = tmp_path_factory.getbasetemp() / "pd_matrix_bytes.md"
    out.write_text(text)
    print(f"\nPD matrix bytes ({out}):\n{text}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("pd-matrix-llama")
    return dict(cases=random_reference("llama-bias-4l", path), model_dir=str(path),
                model="random", name="llama-bias-4l", kv_heads=2,
                block_bytes=LLAMA_BLOCK_BYTES, windows=(0,))


@pytest.fixture(scope="module")
def gemma():
    """gemma-3-270m's tokens from a MIX engine in this process, its block bytes and KV
    groups' windows."""
    cases, block_bytes, windows = gemma_270m_reference()
    return dict(cases=cases, model_dir="gemma-3-270m", model="gemma-3-270m",
                name="gemma-3-270m", kv_heads=1, block_bytes=block_bytes, windows=windows)


def _side(spec: tuple[list[str], dict], model: str) -> tuple[list[str], dict]:
    flags, settings = spec
    return flags, {k: v[model] for k, v in settings.items()}


@pytest.mark.parametrize("model,p,d,mode,backend", list(_cases()))
def test_pd_matrix(request, table, etcd_server, tmp_path, model, p, d, mode, backend):
    ref = request.getfixturevalue(model)
    h = Harness(etcd_server.endpoint, f"pd-matrix-{model}-{p}-{d}-{mode}-{backend}/", tmp_path)
    record: list = []
    # a decode of more TP ranks than KV heads holds a copy of a head per replica: each copy
    # gets the prompt's KV (one source replica per head, whatever the prefill's layout)
    copies = max(1, (int(d[2:]) if d.startswith("TP") else 1) // ref["kv_heads"])
    row = f"| {ref['name']} | {p} | {d} | {mode} | {backend} |"
    try:
        _check_pair(h, mode, backend, ref["cases"], copies * ref["block_bytes"],
                    ref["model_dir"], ref["model"], _side(PREFILLS[p], model),
                    _side(DECODES[d], model), windows=ref["windows"], record=record)
    except BaseException as e:
        first = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        table.append(f"{row} | | | | | FAILED: {first.replace('|', '/')} |")
        raise
    (blocks, moved), = record
    per_rank = ", ".join(f"{op} r{r}: {b}" for (op, r), b in sorted(moved.items()))
    table.append(f"{row} {blocks} | {sum(moved.values())} | {per_rank} | {copies} | "
                 f"{blocks} x {ref['block_bytes']} x {copies} | yes |")
