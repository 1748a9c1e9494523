"""The schedule runtime's per-action functions, for custom functions and tools.

A function registered with
``schedule.register_custom_function(computation_type, fn)`` receives
``(action, ctx)``: a ``schedules.PipelineAction`` and the step's one
``schedules.PipelineContext`` (the same object for every custom function of
a step, a new one for the next; the package installs both names where torch
lacks them).  These functions do the runtime's own work for an action, so a
custom function can add to it instead of copying it:

* :func:`perform_action` -- one action as the schedule runs it:
  ``ctx.schedule_ref.perform_action(action, ctx)``, the method the step loop
  calls for every action without a custom function (OVERLAP_F_B's
  sub-actions and the communication actions included), which a subclass
  may override;
* :func:`prepare_compute_action` -- a compute action's in-order bookkeeping
  (receives, FSDP checks, the backward count, the loss); returns the compute,
  a :class:`PreparedComputeAction`;
* :func:`run_action` -- one action the built-in way, sends included (the
  body of the schedule's ``perform_action``);
* :func:`sequential_overlap_f_b` -- OVERLAP_F_B's sub-actions one after the
  other, through :func:`perform_action`: register it for ``OVERLAP_F_B`` to
  opt a schedule out of the concurrent handler.

:class:`CustomFunctionRuntime` declares the methods a custom function may
call on ``ctx.schedule_ref`` (the package installs them on every supported
torch), :class:`CustomFunctionStage` the one it may call on a stage.
"""

from torch_pipelining_ext._schedule_runtime import (
    CustomFunctionRuntime,
    CustomFunctionStage,
    perform_action,
    prepare_compute_action,
    PreparedComputeAction,
    run_action,
    sequential_overlap_f_b,
)


__all__ = [
    "CustomFunctionRuntime",
    "CustomFunctionStage",
    "perform_action",
    "prepare_compute_action",
    "PreparedComputeAction",
    "run_action",
    "sequential_overlap_f_b",
]
