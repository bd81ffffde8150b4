"""The launcher's tensor-parallel flags: refused combinations fail before anything starts."""
from __future__ import annotations

from xllm_py.launch import build_parser, core_shares, main, tp_error


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_tp_combinations(capsys):
    assert tp_error(_args("--mix", "2", "--mix-tp", "2")) is None
    assert tp_error(_args()) is None
    assert tp_error(_args("--prefill-tp", "2", "--decode-tp", "2")) is None  # rank to rank
    # different TP moves KV head slices, over either backend (xLLM's underscore spelling too)
    assert tp_error(_args("--prefill_tp", "2", "--kv-transfer-backend", "tcp")) is None
    assert tp_error(_args("--prefill_tp", "2")) is None
    assert tp_error(_args("--decode-tp", "2", "--kv-transfer-backend", "ucx")) is None
    assert "must be >= 1" in tp_error(_args("--mix", "1", "--mix-tp", "0"))
    assert main(["--prefill-tp", "0", "--decode-tp", "1"]) == 2
    assert "tensor-parallel sizes must be >= 1" in capsys.readouterr().err


def test_engines_get_cores_of_their_own_by_default():
    """auto (the default): no more engines than cores, all TP 1 -> equal disjoint slices
    (their torch threads follow the affinity); more engines, or a TP engine -> unpinned."""
    assert _args().pin_cores == "auto" and _args("--pin-cores").pin_cores == "on"
    assert core_shares("auto", [0, 1], [1, 1]) == [[0], [1]]
    assert core_shares("auto", [0, 1, 2, 3], [1, 1]) == [[0, 1], [2, 3]]
    assert core_shares("auto", [0, 1, 2], [1, 1]) == [[0], [1, 2]]
    assert core_shares("auto", [0, 1], [1]) == [[0, 1]]
    assert core_shares("auto", [0, 1], [1, 1, 1]) == [None] * 3
    assert core_shares("auto", [0, 1, 2, 3], [2, 1]) == [None, None]
    assert core_shares("on", [0, 1], [1, 1, 1]) == [[0], [1], [0]]
    assert core_shares("on", [0, 1], [2, 1]) == [None, [1]]
    assert core_shares("off", [0, 1], [1, 1]) == [None, None]
    assert core_shares("auto", [], [1]) == [None]
