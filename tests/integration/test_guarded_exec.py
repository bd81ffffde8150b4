"""Child processes start through `procs.guarded` (xllm_py/utils/guarded_exec.py): they are
not forked with a preexec_fn, so gRPC's fork handlers never run in them. With a
preexec_fn, a parent holding live gRPC channels lost about one child in three at start-up
on grpcio 1.85 (grpc/grpc#43055: "epoll_wait error: Bad file descriptor" before exec)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest

from tests.waiting import wait_until_sync
from xllm_py.utils.procs import GUARD_SCRIPT, spawn

pytestmark = pytest.mark.integration

SPAWNS = 40


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return True


def test_children_start_while_grpc_is_busy(tmp_path):
    async def run() -> list[int]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stop = asyncio.Event()

        async def churn() -> None:  # RPCs in flight the whole time (unknown method)
            while not stop.is_set():
                try:
                    await channel.unary_unary("/x.Y/Z")(b"", timeout=0.5)
                except grpc.aio.AioRpcError:
                    pass

        task = asyncio.create_task(churn())
        codes = []
        try:
            for i in range(SPAWNS):
                child = spawn(f"child{i}", "platform", [], tmp_path)
                codes.append(await asyncio.to_thread(child.popen.wait, 60))
        finally:
            stop.set()
            await task
            await channel.close()
            await server.stop(None)
        return codes

    codes = asyncio.run(run())
    logs = [(tmp_path / f"child{i}.log").read_text() for i in range(SPAWNS)]
    failed = [(i, log[-200:]) for i, (c, log) in enumerate(zip(codes, logs)) if c != 0]
    assert not failed, failed
    assert all(log.strip() for log in logs)  # each printed its platform


@pytest.mark.parametrize("cores", ["last", "all"])
def test_a_guarded_child_dies_with_its_parent_and_keeps_its_cpu(tmp_path, cores):
    mine = sorted(os.sched_getaffinity(0))
    cpu = mine[-1] if cores == "last" else mine
    # an intermediate parent starts a guarded child, reports its pid, then is killed
    code = ("import subprocess, sys\n"
            "from xllm_py.utils.procs import guarded\n"
            f"argv = [sys.executable, '-c', 'import os, time; print(sorted(os.sched_getaffinity(0)), flush=True); time.sleep(120)']\n"
            f"p = subprocess.Popen(guarded(argv, cpu={cpu}))\n"
            "print(p.pid, flush=True)\n"
            "import time; time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == str(mine[-1:] if cores == "last" else mine)
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait(10)
    wait_until_sync(lambda: not _alive(child), 10)


def test_guarded_refuses_to_start_when_the_parent_is_already_gone():
    # pid 1 is not its parent: it stands for a launcher that died before the signal was armed
    done = subprocess.run([sys.executable, "-S", str(GUARD_SCRIPT), "1", "-", "/bin/echo", "ran"],
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (1, "")
