"""What changes per optimizer and learning-rate recipe: elementwise shard optimizers and schedules."""

from phoenixft.optim.optimizers import (
    OPTIMIZERS,
    SGD,
    Adam,
    AdamW,
    ElementwiseOptimizer,
    Lion,
    check_elementwise,
    make_optimizer,
)
from phoenixft.optim.schedule import SCHEDULES, lr_at

__all__ = ["ElementwiseOptimizer", "AdamW", "Adam", "SGD", "Lion", "OPTIMIZERS", "make_optimizer",
           "check_elementwise", "SCHEDULES", "lr_at"]
