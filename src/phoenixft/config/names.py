"""The names a run flag may take where the thing named lives behind `import torch`: checked here without it,
so that a bad value is refused at once (tests/test_config_sections.py keeps each list equal to its source)."""

from __future__ import annotations

__all__ = ["GPT_PRESETS", "OPTIMIZER_NAMES", "SCHEDULE_NAMES", "DEVICES"]

GPT_PRESETS = ("nano", "tiny", "small", "medium")  # phoenixft.train.gpt.PRESETS (the built-in GPT's --model)
OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "lion")  # phoenixft.optim.OPTIMIZERS
SCHEDULE_NAMES = ("constant", "cosine", "linear", "wsd")  # phoenixft.optim.SCHEDULES
DEVICES = ("cpu", "cuda")  # phoenixft.distributed.device.DEVICES
