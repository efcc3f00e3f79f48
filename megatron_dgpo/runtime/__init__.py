"""The runtime every other folder stands on: configuration files, process groups and Megatron's
parallel state, every cross-rank operation (``comm``), the CPU patches and GPU flags of
Megatron-Core, stop signals and the time budget, the hang watchdog. Imports nothing above it."""
