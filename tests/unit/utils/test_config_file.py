"""SettingsParser: --config FILE sets flags and file-only settings; the command line wins."""
import pytest

from xllm_py.utils.cli import parse_bool
from xllm_py.utils.config_file import SettingsParser, write_settings


def _parser() -> SettingsParser:
    p = SettingsParser(prog="t")
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=64)
    p.add_argument("--role", default="MIX", choices=["MIX", "PREFILL"])
    p.add_argument("--verbose", action="store_true")
    p.add_file_setting("--batch-window-ms", type=float, default=2.0, help="wait for arrivals")
    p.add_file_setting("--pack", type=parse_bool, default=True, help="pack weights")
    p.add_file_setting("--ranks", type=int, nargs="+", default=None, help="ranks")
    return p


def _write(tmp_path, text):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    return str(f)


def test_the_file_sets_flags_and_file_settings_and_the_command_line_wins(tmp_path):
    path = _write(tmp_path, "max_num_seqs: 8\nbatch-window-ms: 5\npack: false\n"
                            "ranks: [1, 2]\nverbose: true\nrole: PREFILL\n")
    a = _parser().parse_args(["--config", path, "--max-num-seqs", "16"])
    assert (a.max_num_seqs, a.batch_window_ms, a.pack, a.ranks, a.verbose, a.role) == (
        16, 5.0, False, [1, 2], True, "PREFILL")
    b = _parser().parse_args([])
    assert (b.max_num_seqs, b.batch_window_ms, b.pack, b.ranks) == (64, 2.0, True, None)


@pytest.mark.parametrize("text,needle", [
    ("nope: 1\n", "unknown setting 'nope'"),
    ("max_num_seqs: many\n", "max_num_seqs"),
    ("role: BOTH\n", "must be one of MIX, PREFILL"),
    ("verbose: 3\n", "takes true or false"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "--config"),
])
def test_a_bad_file_is_one_clear_error(tmp_path, capsys, text, needle):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--config", _write(tmp_path, text)])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_a_file_setting_on_the_command_line_says_where_it_went(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--batch-window-ms=3"])
    err = capsys.readouterr().err
    assert "--batch-window-ms is a setting of the config file" in err and "batch_window_ms: VALUE" in err


def test_help_lists_flags_and_then_the_file_settings():
    text = _parser().format_help()
    assert "--max-num-seqs" in text and "--batch-window-ms" not in text
    assert "batch_window_ms: wait for arrivals (default: 2.0)" in text


def test_a_flag_moved_to_the_file_reads_from_it_only(tmp_path, capsys):
    p = _parser()
    p.move_to_file("--max-num-seqs")
    text = p.format_help()
    flags, file_only = text.split("settings of --config FILE only")
    assert "--max-num-seqs" not in flags and "max_num_seqs:  (default: 64)" in file_only
    args = write_settings(tmp_path / "s.yaml", {"max_num_seqs": 8, "pack": False})
    a = p.parse_args(args)
    assert (a.max_num_seqs, a.pack) == (8, False)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-seqs", "3"])
    assert "max_num_seqs: VALUE" in capsys.readouterr().err
