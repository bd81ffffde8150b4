"""docker/docker-compose.yml for real: the images built (docker/build_local_images.sh first,
where the public base images cannot be pulled), the cluster brought up and waited healthy,
the README's completion, a chat completion and a streamed chat through the published service
port with the same greedy tokens the launcher (python -m xllm_py.launch, same model and KV
backend) gives for the same requests; then the decode's process killed from outside (a crash,
not `docker stop`): the restart policy brings it back and the cluster answers exactly again;
`down -v` leaves no container, network or volume. The same on the TLS overlay (API key on
the service, mutual TLS and etcd client certificates between the containers) and on the TP
overlay (a TP 2 prefill).

Skipped with the reason where no Docker daemon answers or Compose v2 is missing. Each
project prints its figures (build, up to healthy, recovery) for the notes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.compose_project import ComposeProject, prepare_images, unavailable_reason
from xllm_py.utils.procs import free_port

REASON = unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.docker,
              pytest.mark.skipif(REASON is not None, reason=f"docker compose: {REASON}"),
              pytest.mark.timeout(1500)]

MODEL = "gemma-3-270m"
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24,
              "temperature": 0}  # the README's request
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}
API_KEY = "sk-compose-test"
READY_S = 300.0
RECOVER_S = 240.0


def ask(url: str, path: str, body: dict, key: str | None = None) -> tuple[str, list[int]]:
    """(text, token ids) of a non-streamed request; raises on an error answer."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + path, json={**body, "return_token_ids": True}, headers=headers,
                   timeout=120, trust_env=False)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["token_ids"]


def ask_stream(url: str, body: dict, key: str | None = None) -> tuple[str, list[int]]:
    """(text, token ids) of a streamed chat completion, chunks joined."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text, ids, done = [], [], False
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=120,
                      json={**body, "stream": True, "return_token_ids": True}, trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for choice in json.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
                ids += choice.get("token_ids") or []
    assert done, "the stream ended without [DONE]"
    return "".join(text), ids


def answers(url: str, key: str | None = None) -> dict[str, tuple[str, list[int]]]:
    return {"completion": ask(url, "/v1/completions", COMPLETION, key),
            "chat": ask(url, "/v1/chat/completions", CHAT, key),
            "stream": ask_stream(url, CHAT, key)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, tuple[str, list[int]]]:
    """The launcher's answers to the same requests (the compose file's KV backend, tcp)."""
    logs = tmp_path_factory.mktemp("compose-ref")
    port = free_port()
    with open(logs / "launcher.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "xllm_py.launch", "--model", MODEL, "--http-port", str(port),
             "--kv-transfer-backend", "tcp", "--log-dir", str(logs)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while not _ready(url):
            assert proc.poll() is None, (logs / "launcher.out").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the launcher was not ready in time"
            time.sleep(0.5)
        return answers(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readiness", timeout=3, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def images() -> str:
    try:
        out = prepare_images()
        print("\n" + out)  # what it made or found, with its times
        return out
    except RuntimeError as exc:  # no debootstrap, not root, no pip: an environment's limit
        pytest.skip(f"docker compose: the base images cannot be made here: {exc}")


OVERLAYS = {"base": [], "tls": ["docker-compose.tls.yml"], "tp": ["docker-compose.tp.yml"]}


@pytest.fixture(scope="module", params=list(OVERLAYS))
def project(request, images):
    kind = request.param
    key = API_KEY if kind == "tls" else None
    p = ComposeProject(kind, OVERLAYS[kind], free_port(), {"XLLM_API_KEY": key} if key else {}, key)
    try:
        p.figures["build_s"] = p.timed("build", timeout=1800)
        p.figures["up_s"] = p.timed("up", "-d", "--wait", "--wait-timeout", str(int(READY_S)),
                                    timeout=READY_S + 60)
        yield p
    except BaseException:
        print(p.logs())
        raise
    finally:
        p.down()
        left = p.leftovers()
        print(f"\ncompose[{kind}]: " + ", ".join(f"{k} {v:.1f} s" for k, v in p.figures.items()))
        assert left == {}, f"down -v left {left}"


def test_answers_equal_the_launchers(reference, project):
    got = answers(project.url, project.key)
    for name, (text, ids) in reference.items():
        assert got[name][1] == ids, (name, got[name][0], text)
        assert got[name][0] == text, name
    assert got["stream"] == got["chat"]  # greedy: the same tokens streamed or not


def test_api_key_required_on_the_tls_overlay(project):
    if project.kind != "tls":
        pytest.skip("the TLS overlay's check")
    r = httpx.post(project.url + "/v1/completions", json=COMPLETION, timeout=30, trust_env=False)
    assert r.status_code == 401, r.text
    assert "error" in r.json()
    # gRPC between containers is TLS: a plaintext channel to the prefill never gets ready
    probe = project.compose(
        "exec", "-T", "service", "python", "-c",
        "import grpc; grpc.channel_ready_future(grpc.insecure_channel('prefill:9100')).result(timeout=5)",
        check=False, timeout=60)
    assert probe.returncode != 0 and "FutureTimeoutError" in probe.stderr, probe.stderr[-2000:]
    # etcd asks for a client certificate: the CA alone is not enough
    etcd = ["exec", "-T", "etcd", "etcdctl", "--endpoints=https://127.0.0.1:2379", "--cacert=/certs/ca.pem",
            "--dial-timeout=3s", "--command-timeout=5s"]
    assert project.compose(*etcd, "endpoint", "health", check=False, timeout=60).returncode != 0
    assert project.compose(*etcd, "--cert=/certs/etcd.pem", "--key=/certs/etcd-key.pem", "endpoint", "health",
                           check=False, timeout=60).returncode == 0


def test_decode_killed_recovers_by_restart_policy(reference, project):
    pid = int(project.inspect("decode", "{{.State.Pid}}"))
    restarts = int(project.inspect("decode", "{{.RestartCount}}"))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # a crash as docker sees one (docker kill would disable restart)
    deadline = t0 + RECOVER_S
    while int(project.inspect("decode", "{{.RestartCount}}")) == restarts:
        assert time.monotonic() < deadline, "the decode was not restarted"
        time.sleep(0.5)
    while project.inspect("decode", "{{.State.Health.Status}}") != "healthy":
        assert time.monotonic() < deadline, "the restarted decode did not turn healthy"
        time.sleep(1)
    want = reference["completion"]
    last = None
    while True:
        try:
            last = ask(project.url, "/v1/completions", COMPLETION, project.key)
            if last == want:
                break
        except httpx.HTTPError as exc:  # until the service routes to the new decode
            last = repr(exc)
        assert time.monotonic() < deadline, f"no exact answer after the restart: {last}"
        time.sleep(1)
    project.figures["recover_s"] = time.monotonic() - t0
    assert answers(project.url, project.key) == reference
