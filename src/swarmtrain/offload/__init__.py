"""Model swapping (ATOM): run a stage, or a whole model, bigger than the accelerator by streaming groups of
layers through it. `plan` is the pure swap plan and its memory accounting; `swapper` executes it with
prefetching; `whole_model` trains a whole model through it."""

from swarmtrain.offload.plan import PeakBytes, SwapPlan, SwapPlanError, plan_swap_groups
from swarmtrain.offload.swapper import LayerSwapper

__all__ = ["LayerSwapper", "PeakBytes", "SwapPlan", "SwapPlanError", "plan_swap_groups"]
