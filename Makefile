# The two commands of the README: `make run` (a real tiny DGPO job on CPU) and `make test`.
# Both create the CPU environment in .venv first if it is absent or out of date.
PYTHON_ENV := .venv
STAMP := $(PYTHON_ENV)/.installed
PY := $(PYTHON_ENV)/bin/python
# Job submission (NeMo-Run, shellcheck) lives in its own venv: nemo-run's pins fight vLLM's.
LAUNCH_ENV := .venv-launch
LAUNCH_STAMP := $(LAUNCH_ENV)/.installed
OUT ?= outputs

# `make test` also builds .venv-launch (NeMo-Run's launcher tests).
.PHONY: env run test test-slow test-cluster clean-env

env: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt tools/setup_env.sh
	bash tools/setup_env.sh $(PYTHON_ENV)
	touch $(STAMP)

$(LAUNCH_STAMP): tools/setup_launch_env.sh
	bash tools/setup_launch_env.sh $(LAUNCH_ENV)
	touch $(LAUNCH_STAMP)

# The tiny DGPO job (recipes/tiny_cpu.yaml): metrics, checkpoints, an HF export and a plot of
# the training dynamics, all under $(OUT)/tiny_cpu. Extra recipe overrides: ARGS="train.steps=5".
run: $(STAMP)
	$(PY) -m megatron_dgpo.train recipes/tiny_cpu.yaml run_dir=$(OUT)/tiny_cpu $(ARGS)
	$(PY) tools/plot_run.py $(OUT)/tiny_cpu

# Marker `bridge` (Megatron-Bridge's own loader, in a venv of its own) is in neither target.
test: $(STAMP) $(LAUNCH_STAMP)
	$(PY) -m pytest -q --durations=15 -m "not slow and not bridge" tests --ignore=tests/cluster

# Minutes-long end-to-end checks (marked slow), kept out of `make test` so that it stays short:
# the reproduction study at smoke size, the stop-signal runs of the trainer, a checkpoint resumed
# at other layouts, pip's resolver on the GPU pins, the tiny MoE job (EP=2 against EP=1, 50 steps
# learning, routing replay). CI runs it after `make test` (.ci/run prints each target's minutes).
test-slow: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m slow tests --ignore=tests/cluster

# A cluster's life, heavier than `make test` (CI runs both): a real 2-node SLURM in network
# namespaces (sbatch, time limit + requeue, scontrol requeue, NeMo-Run), torchrun restarts after
# a killed rank, the hung-rank watchdog, a 4-rank layout. Installs slurm-wlm and munge as root;
# without them the SLURM tests skip and say why (-rs).
test-cluster: $(STAMP) $(LAUNCH_STAMP)
	bash slurm/testing/install.sh
	$(PY) -m pytest -q --durations=10 -rs tests/cluster

clean-env:
	rm -rf $(PYTHON_ENV) $(LAUNCH_ENV)
