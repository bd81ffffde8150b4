"""The launcher's tensor-parallel flags: refused combinations fail before anything starts."""
from __future__ import annotations

from xllm_py.launch import build_parser, main, tp_error


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_mix_tp_is_accepted_and_pd_tp_refused_until_head_slices_exist(capsys):
    assert tp_error(_args("--mix", "2", "--mix-tp", "2")) is None
    assert tp_error(_args()) is None
    assert tp_error(_args("--prefill_tp", "2")) is not None  # (xLLM's underscore spelling)
    assert main(["--prefill-tp", "2", "--decode-tp", "1"]) == 2
    assert "not implemented yet" in capsys.readouterr().err
    assert "must be >= 1" in tp_error(_args("--mix", "1", "--mix-tp", "0"))
