"""Per-slot optimizer and LR schedules."""

from miles_multilora.optim.lr_schedule import learning_rate
from miles_multilora.optim.slot_adamw import SlotAdamW, SlotStepStats

__all__ = ["SlotAdamW", "SlotStepStats", "learning_rate"]
