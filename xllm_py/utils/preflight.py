"""Checks a process makes before it starts anything (the launcher, an engine, the service):
each returns None when all is well, else one line saying what is wrong and what to do.

Nothing here loads a model or imports torch: they only look (a name, a path, a port).
"""
from __future__ import annotations

import errno
import pathlib
import socket

MODEL_HINT = ("give a Hugging Face model directory (config.json, model.safetensors, "
              "tokenizer.json) or a built-in name")


def builtin_models() -> list[str]:
    from xllm_py.model.catalog import known_model_names

    return known_model_names()


def model_error(model: str, flag: str = "--model") -> str | None:
    """Why `model` names neither a built-in model nor an existing path."""
    from xllm_py.model.catalog import packaged_model_error

    if model in builtin_models():
        return packaged_model_error(model)
    if pathlib.Path(model).expanduser().exists():
        return None
    from xllm_py.model.tiny import model_files_dir

    try:  # a name the model registry resolves to files on this machine
        where = model_files_dir(model)
    except (ValueError, OSError) as exc:
        return f"{flag} {model}: {exc}"
    if pathlib.Path(where).exists():
        return None
    return (f"{flag} {model}: no such directory, and not a built-in model; "
            f"{MODEL_HINT} ({', '.join(builtin_models())})")


def port_error(host: str, port: int, flag: str) -> str | None:
    """Why nothing can listen on host:port now (port 0: any free port, always fine)."""
    if not port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return bind_error(host, port, flag, exc)
    return None


def bind_error(host: str, port: int, flag: str, exc: OSError) -> str:
    """One line for a failed bind on host:port (the port of `flag`)."""
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use ({flag}): stop what listens "
                f"there (e.g. `ss -ltnp 'sport = :{port}'`) or pass another {flag}")
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port} ({flag}): use a port above 1023"
    if exc.errno in (errno.EADDRNOTAVAIL, socket.EAI_NONAME):
        return f"cannot listen on {host}: not an address of this machine (--host)"
    return f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}"


def reachable_error(endpoint: str, flag: str, what: str, hint: str = "",
                    timeout_s: float = 2.0) -> str | None:
    """Why a TCP connection to HOST:PORT fails (the server is down, a typo); `hint`: what
    to do about it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return f"{flag} {endpoint}: expected HOST:PORT"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        why = f"cannot reach {what} at {endpoint} ({flag}): {exc.strerror or exc}"
        return f"{why}; {hint}" if hint else why
