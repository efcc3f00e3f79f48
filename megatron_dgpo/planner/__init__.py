"""The planner behind ``dgpo-plan``: which TP x PP x CP x DP (x EP) layout of a recipe fits a
cluster's GPUs, and how long a step takes where generation runs. Pure Python (no torch).

Its modules, bottom to top (each imports only those listed before it):

    inputs.py           what a plan is for: the model, the cluster, the recipe's workload, a layout
    catalogue.py        the published models' config.json fields, and the model a recipe names
    parameters.py       parameter counts per layer, stage and model
    memory_terms.py     per-GPU memory, term by term (weights ... NCCL, vLLM's reserve), and
                        the attention backend a plan's GPUs run (the trainer's own rule)
    peak.py             a layout's most loaded GPU (``estimate``) and a dedicated engine's GPU
    lengths.py          the response-length distribution and the longest of N responses
    steptime.py         a roofline model of one RL step's generation, training and refit, per
                        schedule (synchronous, one-step-off, partial rollouts at staleness k)
    published_steps.py  the published step times the step-time model is checked against
    published_async.py  published asynchronous speed-ups beside the model's
    search.py           every layout a recipe can run, the one to pick, the step times of a plan
                        and the fastest splits
    report.py           the table, the pick's reasons and ``--explain``'s terms as text

``dgpo-plan``'s command line sits above them, in the driver (``megatron_dgpo/plan.py``).

Notation of the formulas: h hidden size, L layers, a attention heads, g KV groups, d head size,
f FFN width, V vocabulary (padded to a multiple of 128 TP as Megatron does), t TP, p PP, c CP,
D DP, s the tokens of one packed micro-batch row (``train.micro_batch_tokens``), b bytes per
element of the training dtype (2 for bf16). Mixture of experts (Qwen3-MoE): E routed experts
per layer, k experts per token, f_e one expert's SwiGLU width, e EP (expert parallel), u ETP
(expert tensor parallel), D_e = world / (p e u) the expert data-parallel size. Memory is in
bytes (GIB = 2^30, the unit ``nvidia-smi`` uses). CP (c, ``parallel.context_parallel``)
divides each row's tokens and shards the optimizer with DP; ``dgpo-plan`` weighs it where no
layout without it leaves headroom.
``docs/planner.md`` collects the formulas with their assumptions and the published figures
they were checked against.
"""
