"""The launcher's tensor-parallel flags: refused combinations fail before anything starts."""
from __future__ import annotations

from xllm_py.launch import build_parser, main, tp_error


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_tp_combinations(capsys):
    assert tp_error(_args("--mix", "2", "--mix-tp", "2")) is None
    assert tp_error(_args()) is None
    assert tp_error(_args("--prefill-tp", "2", "--decode-tp", "2")) is None  # rank to rank
    assert tp_error(_args("--prefill_tp", "2", "--kv-transfer-backend", "tcp")) is None
    assert "tcp" in tp_error(_args("--prefill_tp", "2"))  # (xLLM's underscore spelling)
    assert main(["--prefill-tp", "2", "--decode-tp", "1"]) == 2
    assert "--kv-transfer-backend tcp" in capsys.readouterr().err
    assert "must be >= 1" in tp_error(_args("--mix", "1", "--mix-tp", "0"))
