"""Building the native CPU kernels (``csrc/*.c``) for this machine: which instruction set
(``isa``: the widest the CPU has, or KernelConfig.isa when it has that), the compiler's
flags, and the shared library itself, cached per sources/flags hash and written
atomically (concurrent processes race safely). Torch-free: cpu_kernels.py loads it."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

from xllm_py.config import KernelConfig

logger = logging.getLogger(__name__)

SRC = pathlib.Path(__file__).with_name("csrc") / "cpu_kernels.c"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo, read once)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


ISAS = ("", "avx2", "avx512")  # narrowest first


def choose_isa(requested: str | None, cpu: frozenset[str] | set[str]) -> str:
    """The instruction set the kernels are built for: the widest this CPU has, or
    ``requested`` (KernelConfig.isa) when the CPU has that: "avx512" (the panel kernels'
    12 x 16 tiles of __m512, about twice the matmul throughput of AVX2 on cores with
    512-bit FMA pipes), "avx2", or "" (the scalar build: no native matmuls)."""
    best = ("avx512" if {"avx2", "fma", *AVX512} <= cpu
            else "avx2" if {"avx2", "fma"} <= cpu else "")
    if requested is None:
        return best
    if ISAS.index(requested) > ISAS.index(best):  # its instructions would fault here
        logger.warning("XLLM_CPU_ISA=%s: this CPU lacks it, building for %s", requested,
                       best or "no SIMD")
        return best
    return requested


def compile_flags(isa: str) -> list[str]:
    """The compiler's flags for a build for ``isa`` (one choose_isa gave)."""
    # -fno-trapping-math lets the exp loops vectorise (torch builds with the same)
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu99", "-fno-trapping-math",
             "-fno-math-errno"]
    if isa in ("avx2", "avx512"):
        flags += ["-mavx2", "-mfma"]
    if isa == "avx512":
        flags += ["-m" + f for f in AVX512]
    return flags


def cache_dir(config: KernelConfig) -> pathlib.Path:
    d = config.cache_dir
    return pathlib.Path(d) if d else pathlib.Path.home() / ".cache" / "xllm_py" / "kernels"


def build(config: KernelConfig, isa: str) -> pathlib.Path:
    """The shared library for ``isa`` (choose_isa's), built unless one is cached."""
    cc = config.cc or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = compile_flags(isa)
    # the main source and the files it includes (every file in csrc/)
    src = b"".join(f.read_bytes() for f in sorted(SRC.parent.glob("*.c")))
    key = hashlib.sha256(src + " ".join([cc] + flags).encode()).hexdigest()[:16]
    out = cache_dir(config) / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, str(SRC)], capture_output=True,
                             text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a racing process sees the old name or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
