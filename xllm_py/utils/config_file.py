"""Command lines with a settings file: `--config FILE` (YAML, keys = flag names).

A serving command's `--help` should list what an operator sets (model, ports, roles,
limits, parallel sizes); settings few people change live in the file instead. Both kinds are
argparse actions of one parser, so a file value is converted and checked exactly as the flag
would be; a file-only setting given on the command line gets one line saying where it went.
The command line wins over the file.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import yaml

from xllm_py.utils.cli import add_flag


class SettingsParser(argparse.ArgumentParser):
    """An ArgumentParser with `--config FILE` and settings that only the file sets."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._file_only: dict[str, tuple[argparse.Action, str]] = {}  # dest -> (action, help)
        add_flag(self, "--config", default=None, metavar="FILE",
                 help="a YAML file of settings, keys = flag names without the dashes "
                      "(max_num_seqs: 32); the command line wins over it; settings that "
                      "have no flag are listed at the end of --help")

    def add_file_setting(self, name: str, **kwargs) -> None:
        """A setting only --config sets: `name` is its flag spelling ("--batch-window-ms")."""
        doc = kwargs.pop("help", "")
        add_flag(self, name, help=argparse.SUPPRESS, **kwargs)
        action = self._actions[-1]
        self._file_only[action.dest] = (action, doc)

    def move_to_file(self, *names: str) -> None:
        """Flags already added (by a helper two commands share) that this command takes
        from the file only: `names` are their flag spellings."""
        for name in names:
            action = self._option_string_actions[name]
            self._file_only[action.dest] = (action, action.help or "")
            action.help = argparse.SUPPRESS

    def format_help(self) -> str:
        text = super().format_help()
        if not self._file_only:
            return text
        lines = ["", "settings of --config FILE only (YAML key: meaning):"]
        for dest, (action, doc) in sorted(self._file_only.items()):
            default = "" if action.default is None else f" (default: {action.default})"
            lines.append(f"  {dest}: {doc}{default}")
        return text + "\n".join(lines) + "\n"

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        for arg in argv:
            flag = arg.split("=", 1)[0]
            for dest, (action, _) in self._file_only.items():
                if flag in action.option_strings:
                    self.error(f"{flag} is a setting of the config file: put '{dest}: VALUE' in "
                               "a YAML file and pass --config FILE")
        path = _config_path(argv)
        if path is not None:
            namespace = namespace or argparse.Namespace()
            for dest, value in self._read(path).items():
                if not hasattr(namespace, dest):
                    setattr(namespace, dest, value)
        return super().parse_known_args(argv, namespace)

    def _read(self, path: str) -> dict[str, object]:
        try:
            data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            self.error(f"--config {path}: {exc}")
        if not isinstance(data, dict):
            self.error(f"--config {path}: expected a mapping of setting: value")
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest != "config"}
        values = {}
        for key, value in data.items():
            dest = str(key).lstrip("-").replace("-", "_")
            action = actions.get(dest)
            if action is None or isinstance(action, argparse._HelpAction):
                self.error(f"--config {path}: unknown setting {key!r} (the keys are the flag "
                           "names of --help and the settings listed at its end)")
            values[dest] = self._convert(path, action, dest, value)
        return values

    def _convert(self, path: str, action: argparse.Action, dest: str, value):
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                self.error(f"--config {path}: {dest} takes true or false, got {value!r}")
            return value
        if action.nargs not in (None, "?") and not isinstance(value, list):
            value = [value]
        items = value if isinstance(value, list) else [value]
        converted = []
        for item in items:
            # (a mapping, as JSON: the spelling of a flag that takes a JSON object)
            text = (str(item).lower() if isinstance(item, bool)
                    else json.dumps(item) if isinstance(item, dict) else str(item))
            try:
                item = action.type(text) if action.type else text
            except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
                self.error(f"--config {path}: {dest}: {exc}")
            if action.choices is not None and item not in action.choices:
                self.error(f"--config {path}: {dest} must be one of "
                           f"{', '.join(map(str, action.choices))}, got {item!r}")
            converted.append(item)
        return converted if isinstance(value, list) else converted[0]


def write_settings(path: str | pathlib.Path, settings: dict[str, object]) -> list[str]:
    """`settings` (key: value) as a settings file at `path` (its folder made where missing);
    returns the flags that pass it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(settings), sort_keys=False))
    return ["--config", str(path)]


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None
