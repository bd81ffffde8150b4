"""The servers ``bench_peers.py`` races: how to find, start, watch and stop each one.

* ``xllm-py``: ``python -m xllm_py.engine --instance-role MIX`` (this checkout's code);
* ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` from its own venv
  (``--vllm-python`` / ``$XLLM_BENCH_VLLM_PYTHON``), float32, on an HF directory;
* ``llama.cpp``: ``llama-server`` (``--llama-server`` / ``$XLLM_BENCH_LLAMA_SERVER`` /
  ``PATH``) on a GGUF file; it drops kept-alive connections, so the client opens one per
  request.

The peers stay out of the project's dependencies (docs/peers.md, scripts/install_peers.sh
install them); one that is not there is skipped with a message. A server runs in a
session of its own (vLLM forks an engine-core process), so it is stopped as a group, and
its memory is the resident set summed over its process tree, sampled from /proc.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping

import httpx

SERVERS = ("xllm-py", "vllm", "llama.cpp")
PEERS_DIR_ENV = "XLLM_PEERS_DIR"  # where scripts/install_peers.sh puts the peers
VLLM_PYTHON_ENV = "XLLM_BENCH_VLLM_PYTHON"
LLAMA_SERVER_ENV = "XLLM_BENCH_LLAMA_SERVER"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def peers_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    return pathlib.Path(environ.get(PEERS_DIR_ENV)
                        or pathlib.Path.home() / ".cache" / "xllm_py" / "peers")


def find_vllm_python(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The flag, else the env variable, else the venv install_peers.sh makes; None when
    that file does not exist."""
    path = flag or environ.get(VLLM_PYTHON_ENV) or str(peers_dir(environ) / "vllm-venv/bin/python")
    return path if os.path.isfile(path) else None


def find_llama_server(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The flag, else the env variable, else install_peers.sh's binary, else PATH."""
    path = flag or environ.get(LLAMA_SERVER_ENV)
    if not path:
        built = peers_dir(environ) / "bin" / "llama-server"
        path = str(built) if built.is_file() else shutil.which("llama-server", path=environ.get("PATH"))
    return path if path and os.path.isfile(path) else None


def skip_reason(server: str, *, hf_dir: bool, gguf: bool, vllm_python: str | None,
                llama_server: str | None) -> str | None:
    """Why ``server`` cannot run on this model here (None: it can)."""
    if server == "vllm":
        if vllm_python is None:
            return (f"no vLLM python (--vllm-python or ${VLLM_PYTHON_ENV}; install: "
                    "scripts/install_peers.sh)")
        if not hf_dir:
            return "the model has no HF directory for vLLM"
    elif server == "llama.cpp":
        if llama_server is None:
            return (f"no llama-server (--llama-server, ${LLAMA_SERVER_ENV} or PATH; install: "
                    "scripts/install_peers.sh)")
        if not gguf:
            return "the model has no GGUF file for llama.cpp"
    elif server != "xllm-py":
        return f"unknown server {server!r} (choose from {', '.join(SERVERS)})"
    return None


# ---------------------------------------------------------------------------- commands
@dataclasses.dataclass
class ServerCommand:
    name: str
    argv: list[str]
    env: dict[str, str]  # added to this process's environment
    model_id: str | None  # the "model" field to send (None: ask /v1/models)
    keepalive: bool = True
    ready_timeout_s: float = 900.0
    drop_env: tuple[str, ...] = ()  # removed from the environment


def xllm_command(model: str, port: int, extra: Iterable[str] = ()) -> ServerCommand:
    from xllm_py.utils.procs import engine_args

    argv = [sys.executable, "-m", "xllm_py.engine",
            *engine_args("MIX", port, model=model, extra=list(extra))]
    return ServerCommand("xllm-py", argv, {"PYTHONUNBUFFERED": "1"}, None)


def vllm_command(python: str, hf_dir: str, port: int, num_cores: int,
                 kv_cache_gib: int = 2, max_model_len: int = 1024) -> ServerCommand:
    """PEERS.md's run line: tcmalloc and the venv's Intel OpenMP preloaded, float32."""
    venv = pathlib.Path(python).parent.parent
    preload = [p for p in (TCMALLOC, str(venv / "lib" / "libiomp5.so")) if os.path.isfile(p)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{num_cores - 1}",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
    return ServerCommand("vllm", argv, env, "m", drop_env=("PYTHONPATH",))


def llama_command(binary: str, gguf: str, port: int, num_cores: int,
                  slots: int = 32, slot_tokens: int = 256) -> ServerCommand:
    """PEERS.md's run line: ``slots`` slots of ``slot_tokens`` tokens, continuous batching."""
    argv = [binary, "-m", gguf, "-t", str(num_cores), "-tb", str(num_cores),
            "-c", str(slots * slot_tokens), "-np", str(slots), "--cont-batching",
            "--host", "127.0.0.1", "--port", str(port)]
    return ServerCommand("llama.cpp", argv, {}, "m", keepalive=False)


def server_command(name: str, plan: Mapping[str, str | None], paths: Mapping[str, str | None],
                   port: int, *, engine_extra: Iterable[str] = (), slots: int = 32,
                   slot_tokens: int = 256) -> ServerCommand:
    """``name``'s command on the model of ``plan`` (``peer_models.peer_plan``), with the
    peers' binaries in ``paths`` (``find_vllm_python``, ``find_llama_server``), every core
    this process may use."""
    ncores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if name == "xllm-py":
        return xllm_command(plan["xllm_model"], port, engine_extra)
    if name == "vllm":
        return vllm_command(paths["vllm"], plan["hf_dir"], port, ncores)
    return llama_command(paths["llama.cpp"], plan["gguf"], port, ncores, slots=slots,
                         slot_tokens=slot_tokens)


# ---------------------------------------------------------------------------- versions
def _run_text(argv: list[str], timeout_s: float = 120.0) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc.__class__.__name__})"
    return (r.stdout + r.stderr).strip()


def xllm_version() -> str:
    """The version and git commit of the xllm_py the engine imports (``python -m`` from
    this directory, with this environment: PYTHONPATH may point at another checkout)."""
    code = ("import importlib.metadata as m, os, torch, xllm_py; "
            "print(os.path.dirname(os.path.abspath(xllm_py.__file__)), torch.__version__)")
    out = _run_text([sys.executable, "-c", code]).splitlines()
    words = out[-1].split() if out else []
    if len(words) != 2 or not os.path.isdir(words[0]):
        return "xllm-py unknown"
    src, torch_ver = words
    commit = _run_text(["git", "-C", src, "rev-parse", "--short", "HEAD"])
    dirty = _run_text(["git", "-C", src, "status", "--porcelain", "--untracked-files=no", "."])
    commit = commit if " " not in commit else "no git"
    if dirty and commit != "no git":
        commit += "+changes"
    try:
        import importlib.metadata

        ver = importlib.metadata.version("xllm-py")
    except importlib.metadata.PackageNotFoundError:
        ver = "?"
    return f"xllm-py {ver} ({commit}, {pathlib.Path(src).parent}), torch {torch_ver}"


def vllm_version(python: str) -> str:
    code = ("import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), "
            "'torch', m.version('torch'), 'transformers', m.version('transformers'))")
    out = _run_text([python, "-c", code]).splitlines()
    words = out[-1].split() if out else []
    if len(words) == 6:
        return f"{words[0]} {words[1]}, {words[2]} {words[3]}, {words[4]} {words[5]}"
    return "vllm " + " ".join(words)


def llama_version(binary: str) -> str:
    for line in _run_text([binary, "--version"]).splitlines():
        if line.startswith("version:"):
            return "llama.cpp " + line.split(":", 1)[1].strip()
    return "llama.cpp unknown"


# ---------------------------------------------------------------------------- memory
def descendants(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and every process below it, given each pid's parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


def _parent_pids() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def _tree_pids(root: int) -> set[int]:
    """``root`` and its descendants: from the kernel's per-thread ``children`` lists (a
    few files), else from every process's parent (a scan of /proc)."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return descendants(root, _parent_pids())
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                pass
    return out


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of ``root`` and its descendants (Linux /proc; 0 elsewhere)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in _tree_pids(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return total


class RssSampler:
    """Samples ``tree_rss_bytes(pid)`` every ``interval_s`` in a thread; ``peak`` bytes."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


# ---------------------------------------------------------------------------- processes
class Server:
    """One started server: ``url``, ``wait_ready``, ``stop`` (group SIGTERM, then KILL)."""

    def __init__(self, cmd: ServerCommand, port: int, log_path: pathlib.Path) -> None:
        from xllm_py.utils.procs import guarded

        self.cmd, self.url, self.log_path = cmd, f"http://127.0.0.1:{port}", log_path
        env = {k: v for k, v in os.environ.items() if k not in cmd.drop_env}
        env.update(cmd.env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.t_start = time.monotonic()
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(guarded(cmd.argv), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
        self.rss = RssSampler(self.popen.pid)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self) -> float:
        """Seconds from start until /health answers 200 and /v1/models lists a model."""
        deadline = self.t_start + self.cmd.ready_timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.cmd.name} exited with {self.popen.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if (httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
                        and httpx.get(self.url + "/v1/models", timeout=5,
                                      trust_env=False).status_code == 200):
                    return time.monotonic() - self.t_start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.cmd.name} not ready after {self.cmd.ready_timeout_s:.0f}s:\n"
                           f"{self.log_tail()}")

    def _group_alive(self) -> bool:
        self.popen.poll()  # reap the leader once it exits
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the server's process group (every process of it, SIGTERM, then SIGKILL
        after ``timeout_s``); returns its peak resident bytes."""
        peak = self.rss.stop()
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self._group_alive():
                break
        return peak
