"""Model swapping (ATOM): run a stage, or a whole model, bigger than the accelerator by streaming groups of
layers through it. `plan` is the pure swap plan; `swapper` executes it with prefetching."""

from swarmtrain.offload.plan import SwapPlan, SwapPlanError, plan_swap_groups
from swarmtrain.offload.swapper import LayerSwapper

__all__ = ["LayerSwapper", "SwapPlan", "SwapPlanError", "plan_swap_groups"]
