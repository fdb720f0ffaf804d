"""Helpers for the tests and the benchmarks, never imported by the runtime package.

- :mod:`.lora` — tiny Megatron models with MultiLoRA, random slots, single-LoRA (PEFT) references
- :mod:`.sampling` — the host-side reference sampler (seeded top-k / top-p draws)
"""
