#!/usr/bin/env bash
# Create .venv and install xllm-py with its test extras. Safe to run again.
#
#   scripts/setup.sh            torch's CPU build (PyTorch CPU wheel index) if the venv has none
#   scripts/setup.sh --gpu      torch's CUDA build instead (PyPI's default build on Linux x86_64)
#   scripts/setup.sh --dry-run  print what it would run, run nothing
#
# A torch already in the venv is left alone. The last lines say which torch it has.
# When the CPU index cannot be reached, torch comes from pip's own configuration (pip config
# list) and the script says so. Environment: PYTHON (interpreter, python3), XLLM_VENV (.venv),
# XLLM_TORCH_VERSION (2.13.0), XLLM_TORCH_INDEX_URL (where torch comes from; default the CPU
# index, with --gpu none: PyPI, e.g. https://download.pytorch.org/whl/cu128 for another CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

GPU=0
DRY=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    --dry-run|-n) DRY=1 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $arg (see scripts/setup.sh --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
VENV=${XLLM_VENV:-.venv}
TORCH_VERSION=${XLLM_TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ "$GPU" = 1 ]; then INDEX=${XLLM_TORCH_INDEX_URL-}; else INDEX=${XLLM_TORCH_INDEX_URL:-$CPU_INDEX}; fi
VPY="$VENV/bin/python"
START=$SECONDS
INSTALLED=0

run() {  # print a command, then run it (not with --dry-run)
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

reachable() {  # can pip's index URL $1 be read from here (5 s)?
  "$PY" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5).close()
EOF
}

torch_build() {  # "2.13.0+cpu (CPU build)" of the venv's torch; fails without one
  "$VPY" -c "import torch; c = torch.version.cuda
print(f'{torch.__version__} ' + (f'(CUDA {c} build, a CUDA device: {torch.cuda.is_available()})' if c else '(CPU build)'))" 2>/dev/null
}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "error: xllm-py needs Python >= 3.11; $PY is $("$PY" -V 2>&1 || echo missing)." \
       "Run PYTHON=python3.11 scripts/setup.sh" >&2
  exit 2
fi
if [ ! -x "$VPY" ]; then
  run "$PY" -m venv "$VENV"
fi
run "$VPY" -m pip install -q --upgrade pip

if [ -x "$VPY" ] && have=$(torch_build); then
  echo "torch: keeping the installed torch $have"
  if [ "$GPU" = 1 ] && [[ "$have" == *"CPU build"* ]]; then
    echo "note: --gpu, but that torch is a CPU build: '$VPY -m pip uninstall -y torch'," \
         "then run scripts/setup.sh --gpu again"
  fi
elif [ "$GPU" = 1 ]; then
  echo "torch: installing torch==$TORCH_VERSION, CUDA build (--gpu; several GB)"
  run "$VPY" -m pip install -q "torch==$TORCH_VERSION" ${INDEX:+--extra-index-url "$INDEX"}
  INSTALLED=1
elif [ "$DRY" = 1 ] || reachable "$INDEX"; then
  echo "torch: installing torch==$TORCH_VERSION, CPU build, from $INDEX"
  if [ "$DRY" = 1 ]; then
    echo "(run for real, it first checks that $INDEX can be reached; if not, it says so" \
         "and runs: $VPY -m pip install -q torch==$TORCH_VERSION)"
  fi
  # An extra index, beside pip's own: pip prefers its 2.13.0+cpu to PyPI's 2.13.0 (CUDA)
  run "$VPY" -m pip install -q "torch==$TORCH_VERSION" --extra-index-url "$INDEX"
  INSTALLED=1
else
  echo "note: the torch index $INDEX cannot be reached from here; installing" \
       "torch==$TORCH_VERSION from pip's own configuration (pip config list) instead"
  run "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  INSTALLED=1
fi

# The Mooncake Store's client needs two system libraries (no RDMA device, no GPU): as root,
# install them; otherwise say what to install (the engines then keep their local KV tiers).
if [ "$(uname -s)" = Linux ] && ! { ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && ldconfig -p 2>/dev/null | grep -q libnuma.so.1; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    run apt-get install -y -qq libibverbs1 libnuma1 || { run apt-get update -qq && run apt-get install -y -qq libibverbs1 libnuma1; } \
      || echo "note: apt-get could not install libibverbs1 libnuma1: the KV store stays off"
  else
    echo "note: the Mooncake KV store needs libibverbs1 and libnuma1 (e.g. sudo apt-get install libibverbs1 libnuma1)"
  fi
fi
run "$VPY" -m pip install -q -e ".[test,ucx,kvstore]"

if [ "$DRY" = 1 ]; then
  echo "(dry run: nothing was installed)"
  exit 0
fi
got=$(torch_build) || { echo "error: torch does not import in $VENV" >&2; exit 1; }
echo "torch $got"
if [ "$INSTALLED" = 1 ] && [ "$GPU" = 0 ] && [[ "$got" == *CUDA* ]]; then
  echo "note: that is a CUDA build (not what this script installs by default): to get the" \
       "CPU one, '$VPY -m pip uninstall -y torch' and run scripts/setup.sh again"
fi
echo "xllm-py installed in $VENV in $((SECONDS - START)) s (activate with: . $VENV/bin/activate)"
