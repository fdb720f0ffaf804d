"""Tinker-compatible training on the resident LoRA slots (see :mod:`miles_multilora.tinker.backend`)."""
