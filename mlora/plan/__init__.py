"""Planning from shapes alone: memory per rank of a PPO step, and the layouts that fit.

The adapter export planner is :mod:`mlora.export.plan`; this package answers "will it fit":
:func:`plan_memory` for one layout, :func:`fit_layouts` for every layout of N GPUs.
"""

from mlora.plan.fit import Fit, fit_layouts, require_fit
from mlora.plan.memory import MemoryPlan, RankMemory, plan_memory
from mlora.plan.workload import Engine, Layout, Workload

__all__ = ["Engine", "Fit", "Layout", "MemoryPlan", "RankMemory", "Workload", "fit_layouts", "plan_memory",
           "require_fit"]
