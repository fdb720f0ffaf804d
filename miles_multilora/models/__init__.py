"""Model providers (megatron-bridge for HF checkpoints, tiny test configs) and the CPU/GPU compat shims."""
