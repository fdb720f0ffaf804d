"""miles_multilora: batch RL training of many LoRA adapters at once on one shared Megatron base model."""

__version__ = "0.1.0"
