"""Fit a generation into a memory budget: ``sdpatch generate --vram-budget`` and :func:`plan`.

- :mod:`~sdpatch.planner.estimator`: the memory model, pure arithmetic on a :class:`ModelSpec`
  (:func:`estimate`: the peak of each phase of a generation).
- :mod:`~sdpatch.planner.spec`: a loaded pipeline and its device read into a :class:`ModelSpec`
  and a :class:`DeviceState`.
- :mod:`~sdpatch.planner.levers`: the levers' settings, :func:`apply_plan` and :func:`remove_plan`.
- :mod:`~sdpatch.planner.streamed_decode`: the exact low-memory VAE decode (the ``vae_streaming``
  lever): the decoder's up blocks in strips of rows, their whole tensors on the device or in
  pinned host memory.
- :mod:`~sdpatch.planner.search`: the levers a budget needs (:func:`plan_for`, :func:`plan`,
  :func:`fit`, :func:`plan_from_configs`) and a plan's report lines.
"""

from sdpatch.planner.estimator import (
    CONV_WORKSPACE,
    GIB,
    GPU_ASSUMPTIONS,
    HOST_RESERVE_OVER_ACTIVATIONS,
    PHASES,
    RESERVE_OVER_ACTIVATIONS,
    FP8_STEP_FACTOR,
    OFFLOAD_BYTES_PER_S,
    AttentionCost,
    DeviceState,
    Estimate,
    ModelSpec,
    PhaseEstimate,
    PlanCost,
    PlannerError,
    RunShape,
    decode_host,
    decode_peak,
    estimate,
    host_weights,
    plan_cost,
    unet_peak,
)
from sdpatch.planner.levers import (
    EXACT_LEVERS,
    LEVER_ORDER,
    Levers,
    apply_plan,
    expandable_segments_on,
    lever_unavailable,
    remove_plan,
    request_expandable_segments,
    single_lever,
    weight_levers,
)
from sdpatch.planner.search import (
    STREAM_STRIPS,
    Plan,
    PlanStep,
    estimate_lines,
    fit,
    parse_budget,
    plan,
    plan_for,
    plan_from_configs,
    plan_lines,
    resolve_budget,
)
from sdpatch.planner.spec import device_state, model_spec, offload_footprints

__all__ = [
    "CONV_WORKSPACE",
    "EXACT_LEVERS",
    "GIB",
    "GPU_ASSUMPTIONS",
    "HOST_RESERVE_OVER_ACTIVATIONS",
    "LEVER_ORDER",
    "PHASES",
    "RESERVE_OVER_ACTIVATIONS",
    "FP8_STEP_FACTOR",
    "OFFLOAD_BYTES_PER_S",
    "STREAM_STRIPS",
    "AttentionCost",
    "DeviceState",
    "Estimate",
    "Levers",
    "ModelSpec",
    "PhaseEstimate",
    "Plan",
    "PlanCost",
    "PlanStep",
    "PlannerError",
    "RunShape",
    "apply_plan",
    "decode_host",
    "decode_peak",
    "device_state",
    "estimate",
    "estimate_lines",
    "expandable_segments_on",
    "fit",
    "host_weights",
    "lever_unavailable",
    "model_spec",
    "offload_footprints",
    "parse_budget",
    "plan",
    "plan_for",
    "plan_from_configs",
    "plan_lines",
    "remove_plan",
    "request_expandable_segments",
    "resolve_budget",
    "plan_cost",
    "single_lever",
    "unet_peak",
    "weight_levers",
]
