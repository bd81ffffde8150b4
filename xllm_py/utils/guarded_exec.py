"""Run by path before exec: `python -S guarded_exec.py PARENT_PID CPU PROGRAM ARGS...`.

Binds PROGRAM to the process that started it, then execs it in place (same pid):
SIGTERM when PARENT_PID dies (PR_SET_PDEATHSIG survives exec), so a killed launcher or
test never leaves engines or etcd behind; pinned to CPU (one core, or a comma-separated
list of them) unless it is "-".

Why not `subprocess.Popen(preexec_fn=...)`: a preexec_fn makes CPython fork() instead of
vfork(), which runs gRPC's fork handlers in the child; grpcio 1.80+ restarts its epoll
poller there, close_fds closes the poller's descriptor, and the child aborts before it
execs ("epoll_wait error: Bad file descriptor", grpc/grpc#43055). Without a preexec_fn no
handler runs. Standard library only, run by path: it needs no import path to the project.
"""
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:  # returns only when it refuses to start
    parent, cpu, program = int(argv[0]), argv[1], argv[2:]
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 1
    if cpu != "-" and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in cpu.split(",")})
        except OSError:
            pass
    os.execv(program[0], program)  # (raises OSError when it cannot exec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
