"""The planner behind ``dgpo-plan``: which TP x PP x CP x DP (x EP) layout of a recipe fits a
cluster's GPUs, and how long a step takes where generation runs. Pure Python (no torch).

Modules, bottom to top, each importing only those before it: ``inputs``, ``catalogue``,
``parameters``, ``memory_terms``, ``peak``, ``lengths``, ``steptime``, ``published_steps``,
``published_async``, ``search``, ``report`` (what each holds: docs/planner.md); the command line
is ``megatron_dgpo/plan.py``.

Notation of the formulas: h hidden size, L layers, a heads, g KV groups, d head size, f FFN
width, V vocabulary (V_pad: padded to a multiple of 128 t), t TP, p PP, c CP, D DP, s the tokens
of one packed row (``train.micro_batch_tokens``), b bytes per element of the training dtype;
MoE: E experts per layer, k per token, f_e an expert's width, e EP, u expert TP, D_e = world /
(p e u). Memory in bytes (``GIB`` = 2^30, ``nvidia-smi``'s unit)."""
