"""The math of one update, independent of engines and models: log-probs and entropy over a
tensor-parallel vocabulary shard, the methods' losses, group advantages, packing into rows, and
the batch of samples the rollout hands the trainer (``batch.Experience``)."""
