"""Recovery: the planner (a pure function of the survivors' descriptors) and the restore paths."""

from phoenixft.recovery.planner import Descriptor, Plan, PlanInput, plan_recovery

__all__ = ["Descriptor", "Plan", "PlanInput", "plan_recovery"]
