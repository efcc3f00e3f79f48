"""The policy's side of a step: its weights and how a rank holds them, one mini-batch update
through Megatron's schedules, the optimizer, checkpoints, offloading training state, the
mini-batch plan, MoE telemetry and routing replay. Never imports the rollout."""
