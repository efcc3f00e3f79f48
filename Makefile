# The two commands of the README: `make run` (a real tiny DGPO job on CPU) and `make test`.
# Both create the CPU environment in .venv first if it is absent or out of date.
PYTHON_ENV := .venv
STAMP := $(PYTHON_ENV)/.installed
PY := $(PYTHON_ENV)/bin/python
OUT ?= outputs

.PHONY: env run test clean-env

env: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt tools/setup_env.sh
	bash tools/setup_env.sh $(PYTHON_ENV)
	touch $(STAMP)

# The tiny DGPO job (recipes/tiny_cpu.yaml): metrics, checkpoints, an HF export and a plot of
# the training dynamics, all under $(OUT)/tiny_cpu. Extra recipe overrides: ARGS="train.steps=5".
run: $(STAMP)
	$(PY) -m megatron_dgpo.train recipes/tiny_cpu.yaml run_dir=$(OUT)/tiny_cpu $(ARGS)
	$(PY) tools/plot_run.py $(OUT)/tiny_cpu

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-env:
	rm -rf $(PYTHON_ENV)
