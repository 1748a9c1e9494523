# Owner(s): ["oncall: distributed"]
"""Bad input to the schedule simulator and the planner never returns a number.

Every invalid input of the public API (``simulate``, ``simulate_schedule``,
``LinkCost``, ``StageCost``, ``OverlapModel``, the CSV readers, ``plan`` and
its command line) raises ``ValueError`` naming the field and the value, or the
missing action and its rank, before anything is simulated.  The cases the
issue lists are tests of their own; a property test generates more."""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile

from hypothesis import given, settings, strategies as st
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_pipelining_ext  # noqa: F401  (patches torch: OVERLAP_F_B kept through lowering on 2.9)
from torch_pipelining_ext.sim import (
    HARDWARE_PRESETS,
    Hardware,
    LayerCost,
    LinkCost,
    ModelShape,
    OverlapModel,
    StageCost,
    build_schedule,
    kind,
    layer_costs,
    schedule_order,
    simulate,
    simulate_schedule,
)
from torch_pipelining_ext.sim import plan


_COST = StageCost(forward=1.0, backward_input=1.0, backward_weight=1.0)


def _write_csv(path: str, order) -> None:
    with open(path, "w") as f:
        for rank in sorted(order):
            f.write(",".join(str(a) for a in order[rank] if a is not None) + "\n")


def _comms_csv_without(d: str, schedule: str, dropped: str) -> str:
    """A compute_comms CSV of ``schedule`` (2 ranks, 2 microbatches) with the action ``dropped`` left out."""
    v = 1 if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") else None
    order, _ = schedule_order(build_schedule(schedule, 2, 4, stages_per_rank=v))
    kept = {r: [a for a in acts if str(a) != dropped] for r, acts in order.items()}
    assert sum(map(len, kept.values())) < sum(map(len, order.values())), dropped
    path = os.path.join(d, "order.csv")
    _write_csv(path, kept)
    return path


class IssueCasesTest(TestCase):
    """The inputs the issue found returning a number or failing with the wrong error."""

    @parametrize(
        "field,value",
        [
            ("latency", -1.0),
            ("bandwidth", -1e9),
            ("bandwidth", 0.0),
            ("post_overhead", -0.5),
            ("latency", math.nan),
        ],
    )
    def test_link_cost(self, field, value):
        with self.assertRaisesRegex(ValueError, f"LinkCost.{field} .*{value!r}"):
            LinkCost(**{field: value})

    @parametrize(
        "field,value",
        [
            ("send_bytes", -1e9),
            ("activation_bytes", -1.0),
            ("backward_weight", math.inf),
            ("forward", (1.0, -0.5, 1.0)),
        ],
    )
    def test_stage_cost(self, field, value):
        with self.assertRaisesRegex(ValueError, f"StageCost.{field}"):
            StageCost(**{field: value})

    def test_full_backward_stays_finite(self):
        # W spread over a subnormal I used to overflow to an infinite B
        cost = StageCost(backward_input=5e-324, backward_weight=1.0)
        self.assertAlmostEqual(cost.total("B"), 1.0)

    def test_overlap_model(self):
        with self.assertRaisesRegex(ValueError, r"OverlapModel.handover .*-0\.5"):
            OverlapModel(handover=-0.5)
        with self.assertRaisesRegex(ValueError, "OverlapModel.enabled"):
            OverlapModel(enabled="yes")

    @parametrize(
        "schedule",
        ["GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"],
    )
    def test_zero_microbatches(self, schedule):
        with self.assertRaisesRegex(ValueError, "n_microbatches .* got 0"):
            simulate_schedule(schedule, 2, 0, _COST)

    def test_zero_ranks(self):
        with self.assertRaisesRegex(ValueError, "pp .* got 0"):
            simulate_schedule("DualPipeV", 0, 4, _COST)
        with self.assertRaisesRegex(ValueError, "stages_per_rank .* got 0"):
            simulate_schedule("Interleaved1F1B", 2, 4, _COST, stages_per_rank=0)

    def test_empty_csv(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "empty.csv")
            open(path, "w").close()
            for fmt in ("compute_only", "compute_comms"):
                with self.assertRaisesRegex(ValueError, "holds no actions"):
                    simulate(path, _COST, csv_format=fmt)

    @parametrize(
        "schedule,dropped,rank",
        [
            ("Interleaved1F1B", "0B1", 0),
            ("InterleavedZeroBubble", "0W1", 0),
            ("InterleavedZeroBubble", "1W0", 1),
        ],
    )
    def test_comms_csv_missing_action(self, schedule, dropped, rank):
        with tempfile.TemporaryDirectory() as d:
            path = _comms_csv_without(d, schedule, dropped)
            with self.assertRaisesRegex(
                ValueError, f"missing 1 action.*{dropped} on rank {rank}"
            ):
                simulate(path, _COST, csv_format="compute_comms")

    def test_compute_only_cycle_names_each_stuck_rank(self):
        # rank 1 runs microbatch 1 first, rank 0 microbatch 0: each waits for the other
        sched = build_schedule("Interleaved1F1B", 2, 2, stages_per_rank=1)
        order = {
            r: [a for a in acts if a is not None]
            for r, acts in sched.pipeline_order.items()
        }
        by_name = {str(a): a for acts in order.values() for a in acts}
        order[0] = [by_name[n] for n in ("0F0", "0B0", "0F1", "0B1")]
        order[1] = [by_name[n] for n in ("1F1", "1B1", "1F0", "1B0")]
        with self.assertRaisesRegex(
            ValueError,
            "deadlocks: rank 0 at action 0B0 waits for 1I0 or 1B0; rank 1 at action 1F1 waits for 0F1",
        ):
            simulate(order, _COST)

    def test_costs_of_the_wrong_type(self):
        sched = build_schedule("DualPipeV", 2, 4)
        with self.assertRaisesRegex(ValueError, r"costs\[1\] must be a StageCost"):
            simulate(sched, [_COST, 1.0, _COST, _COST])
        with self.assertRaisesRegex(ValueError, "link must be a LinkCost"):
            simulate(sched, _COST, link=1.0)


class PlannerInputTest(TestCase):
    _ARGS = ["--model", "deepseek-v3", "--gpus", "64", "--pp", "4", "--quiet"]

    def _exit_code(self, extra):
        err = io.StringIO()
        with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
            plan.main(self._ARGS + extra)
        return cm.exception.code, err.getvalue()

    @parametrize(
        "extra,message",
        [
            (["--global-batch", "0"], "global_batch .* got 0"),
            (["--microbatches", "0"], "microbatches item .* got 0"),
            (["--ep", "-8"], "eps item .* got -8"),
            (["--memory-limit-gib", "-1"], "memory_limit .* got -"),
            (["--a2a-bytes", "0"], "a2a_bytes .* got 0"),
            (["--override", "achieved_fraction=0"], "achieved_fraction .* got 0.0"),
            (["--override", "p2p_latency=-1"], "p2p_latency .* got -1.0"),
            (["--override", "gpus_per_node=x"], "not a gpus_per_node value"),
            (["--pp", "0"], "must be positive"),
            (["--pp", "a"], "--pp: expected comma-separated integers"),
        ],
    )
    def test_cli_exits_2_with_the_message(self, extra, message):
        code, err = self._exit_code(extra)
        self.assertEqual(code, 2)
        self.assertRegex(err, message)

    def test_plan_raises(self):
        shape = ModelShape.from_hf_config(plan.MODEL_PRESETS["deepseek-v3"])
        kwargs = dict(
            gpus=64,
            seq_len=4096,
            global_batch=64,
            pps=[4],
            eps=[8],
            microbatches=[8],
            schedules=["DualPipeV"],
            memory_limit=1e11,
        )
        for field, value in (
            ("gpus", 0),
            ("seq_len", -1),
            ("pps", []),
            ("schedules", ["X"]),
        ):
            with self.assertRaisesRegex(ValueError, field):
                plan.plan(shape, HARDWARE_PRESETS["H800"], **{**kwargs, field: value})


# --------------------------------------------------------------------------- #
# Generated invalid inputs                                                     #
# --------------------------------------------------------------------------- #

_bad_number = st.sampled_from([-1.0, -1e-9, -1e9, math.nan, -math.inf])
_bad_count = st.sampled_from([0, -1, -7])


_SCHEDULES = (
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_LAYER = dict(forward=1.0, backward_input=1.0, backward_weight=1.0)


def _dsv3_layers(**kwargs):
    shape = ModelShape.from_hf_config(plan.MODEL_PRESETS["deepseek-v3"])
    return layer_costs(shape, HARDWARE_PRESETS["H800"], **kwargs)


# what is made invalid -> (its fields, a call that uses one invalid field)
_NUMBER_TARGETS = {
    "LinkCost": (
        ("latency", "bandwidth", "post_overhead"),
        lambda f, v: simulate_schedule(
            "DualPipeV", 2, 4, _COST, link=LinkCost(**{f: v})
        ),
    ),
    "StageCost": (
        (
            "forward",
            "backward_input",
            "backward_weight",
            "full_backward",
            "activation_bytes",
            "send_bytes",
        ),
        lambda f, v: simulate_schedule("ZBVZeroBubble", 2, 4, StageCost(**{f: v})),
    ),
    "OverlapModel": (
        ("handover", "min_region"),
        lambda f, v: simulate_schedule(
            "DualPipeV", 2, 4, _COST, overlap=OverlapModel(**{f: v})
        ),
    ),
    "LayerCost": (
        ("forward", "backward_input", "dispatch", "expert_fraction"),
        lambda f, v: LayerCost(**{**_LAYER, f: v}),
    ),
    "Hardware": (
        (
            "bf16_tflops",
            "achieved_fraction",
            "hbm_bytes",
            "inter_node_a2a_gbps",
            "a2a_latency",
            "fp8_tflops",
        ),
        lambda f, v: HARDWARE_PRESETS["H800"].with_overrides(**{f: v}),
    ),
}
_COUNT_TARGETS = {
    "schedule": (
        ("pp", "n_microbatches"),
        lambda name, f, v: simulate_schedule(
            name, **{"pp": 2, "n_microbatches": 4, f: v}, costs=_COST
        ),
    ),
    "layer_costs": (
        ("tokens", "seq_len", "ep", "tp"),
        lambda _, f, v: _dsv3_layers(**{"tokens": 4096, "seq_len": 4096, f: v}),
    ),
}


@st.composite
def _invalid_call(draw):
    """A callable that builds or simulates from exactly one invalid input, and that input's name."""
    if draw(st.booleans()):
        owner = draw(st.sampled_from(sorted(_NUMBER_TARGETS)))
        fields, call = _NUMBER_TARGETS[owner]
        field, bad = draw(st.sampled_from(fields)), draw(_bad_number)
        if field in ("forward", "backward_input") and draw(st.booleans()):
            bad = (1.0, bad, 1.0)  # one bad segment of several
        return f"{owner}.{field}", lambda: call(field, bad)
    fields, call = _COUNT_TARGETS[draw(st.sampled_from(sorted(_COUNT_TARGETS)))]
    name, field = draw(st.sampled_from(_SCHEDULES)), draw(st.sampled_from(fields))
    bad = draw(_bad_count)
    return field, lambda: call(name, field, bad)


class InvalidInputPropertyTest(TestCase):
    @settings(max_examples=60, deadline=None)
    @given(_invalid_call())
    def test_no_invalid_input_returns_a_result(self, call):
        field, run = call
        with self.assertRaisesRegex(ValueError, field.replace(".", r"\.")):
            run()

    @settings(max_examples=20, deadline=None)
    @given(
        st.sampled_from(
            ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
        ),
        st.data(),
    )
    def test_no_order_missing_an_action_returns_a_result(self, schedule, data):
        v = 1 if schedule.startswith("Interleaved") else None
        order, s2r = schedule_order(build_schedule(schedule, 2, 4, stages_per_rank=v))
        computes = [
            (r, i)
            for r, acts in order.items()
            for i, a in enumerate(acts)
            if a is not None and kind(a) in ("F", "I", "W", "B")
        ]
        r, i = data.draw(st.sampled_from(computes))
        dropped = order[r][i]
        kept = {
            rank: [a for j, a in enumerate(acts) if (rank, j) != (r, i)]
            for rank, acts in order.items()
        }
        # a dropped F or backward that a peer receives deadlocks (RuntimeError naming the
        # stuck ranks); any other is reported missing, with its rank
        with self.assertRaisesRegex(
            (ValueError, RuntimeError), f"({dropped} on rank {r}|deadlocks: rank )"
        ):
            simulate(kept, _COST)

    def test_bad_hardware_field_types(self):
        with self.assertRaisesRegex(ValueError, "Hardware.gpus_per_node .* 0"):
            Hardware("x", 1.0, 0.5, 1e9, 1.0, 1.0, gpus_per_node=0)


instantiate_parametrized_tests(IssueCasesTest)
instantiate_parametrized_tests(PlannerInputTest)

if __name__ == "__main__":
    run_tests()
