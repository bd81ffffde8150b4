"""docker/docker-compose*.yml driven for real: a Docker Compose v2 project with a name of its
own (so nothing collides with a user's `xllm-py` project), its service port published on a
free loopback-reachable port, built, brought up, looked at and taken down.

`unavailable_reason()` says why containers cannot run here (no docker CLI, no daemon, no
Compose v2); `prepare_images()` runs docker/build_local_images.sh (it keeps what it made
before, and uses the public images where they can be pulled).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "docker"
BASE = DOCKER_DIR / "docker-compose.yml"


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
                       stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def unavailable_reason() -> str | None:
    """Why the compose test cannot run here (None: it can)."""
    try:
        info = _run(["docker", "info", "--format", "{{.ServerVersion}}"], 20, check=False)
    except FileNotFoundError:
        return "no docker CLI on PATH"
    except subprocess.TimeoutExpired:
        return "the Docker daemon does not answer (docker info timed out)"
    if info.returncode != 0:
        return f"no Docker daemon answers: {info.stderr.strip()[:200]}"
    ver = _run(["docker", "compose", "version", "--short"], 20, check=False)
    if ver.returncode != 0 or not ver.stdout.strip().lstrip("v").startswith("2."):
        return "Docker Compose v2 (`docker compose`) is missing: docker/install_compose.sh installs it"
    return None


def prepare_images() -> str:
    """docker/build_local_images.sh; its output. Raises with the script's message."""
    r = _run(["bash", str(DOCKER_DIR / "build_local_images.sh")], 1200, check=False)
    if r.returncode != 0:
        raise RuntimeError((r.stderr or r.stdout).strip())
    return r.stdout


def dot_env() -> dict[str, str]:
    """docker/.env as compose reads it (KEY=VALUE lines)."""
    path = DOCKER_DIR / ".env"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


class ComposeProject:
    def __init__(self, kind: str, overlays: list[str], http_port: int, env: dict[str, str] | None = None,
                 api_key: str | None = None) -> None:
        self.kind, self.key = kind, api_key
        self.name = f"xllmtest{uuid.uuid4().hex[:8]}"
        self.http_port = http_port
        self.figures: dict[str, float] = {}  # seconds: build, up to healthy, recovery
        self.files = [BASE] + [DOCKER_DIR / f for f in overlays]
        if os.environ.get("XLLM_CA_BUNDLE") or dot_env().get("XLLM_CA_BUNDLE"):
            self.files.append(DOCKER_DIR / "docker-compose.ca.yml")  # last: it adds to the others
        self.env = dict(os.environ, XLLM_HTTP_PORT=str(http_port), **(env or {}))
        self.url = f"http://127.0.0.1:{http_port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.name]
        for f in self.files:
            argv += ["-f", str(f)]
        return _run(argv + list(args), timeout, env=self.env, check=check)

    def timed(self, *args: str, timeout: float = 600) -> float:
        t0 = time.monotonic()
        self.compose(*args, timeout=timeout)
        return time.monotonic() - t0

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def inspect(self, service: str, fmt: str) -> str:
        return _run(["docker", "inspect", "-f", fmt, self.container(service)], 30).stdout.strip()

    def logs(self, tail: int = 60) -> str:
        r = self.compose("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return r.stdout[-12000:]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project still present (empty after down -v)."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind in ("container", "network", "volume"):
            argv = ["docker", kind, "ls", "-q", "--filter", label]
            if kind == "container":
                argv.insert(3, "-a")
            found[kind] = _run(argv, 30).stdout.split()
        return {k: v for k, v in found.items() if v}

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "30", check=False, timeout=300)
