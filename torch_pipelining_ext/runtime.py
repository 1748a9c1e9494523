"""The schedule runtime's per-action functions, for custom functions and tools.

A function registered with
``schedule.register_custom_function(computation_type, fn)`` receives
``(action, ctx)``; these functions do the runtime's own work for an action,
so a custom function can add to it instead of copying it:

* :func:`perform_action` -- everything the runtime does for one action of a
  customizable type (plain, or a sub-action of OVERLAP_F_B);
* :func:`prepare_compute_action` -- a compute action's in-order bookkeeping
  (receives, FSDP checks, the backward count, the loss); returns the compute;
* :func:`run_action` -- one action as the step loop runs it, sends included;
* :func:`sequential_overlap_f_b` -- OVERLAP_F_B's sub-actions one after the
  other: register it for ``OVERLAP_F_B`` to opt a schedule out of the
  concurrent handler.

:class:`CustomFunctionRuntime` declares the methods a custom function may
call on ``ctx.schedule_ref`` (the package installs them on every supported
torch), :class:`CustomFunctionStage` the one it may call on a stage.
"""

from torch_pipelining_ext._schedule_runtime import (
    CustomFunctionRuntime,
    CustomFunctionStage,
    perform_action,
    prepare_compute_action,
    run_action,
    sequential_overlap_f_b,
)


__all__ = [
    "CustomFunctionRuntime",
    "CustomFunctionStage",
    "perform_action",
    "prepare_compute_action",
    "run_action",
    "sequential_overlap_f_b",
]
