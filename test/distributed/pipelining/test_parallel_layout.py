# Owner(s): ["oncall: distributed"]
"""``ParallelLayout``: a job's mesh and groups, read once, and the
expert-parallel gradient reduction over it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from common_pipelining import PipelineMultiProcTest
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_utils import run_tests

from torch_pipelining_ext import expert_parallel, launcher, overlap
from torch_pipelining_ext.launcher import ParallelLayout


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


class ParallelLayoutTest(PipelineMultiProcTest):
    world_size = 4

    def test_build_pp1_dp2_ep2(self) -> None:
        layout = launcher.parallel_layout(dp=2, ep=2)
        r = self.rank
        self.assertEqual(layout.mesh.mesh_dim_names, ("pp", "dp", "ep"))
        self.assertEqual(_ranks(layout.pipeline), [r])
        self.assertIsNone(layout.pp)  # a pipeline of one rank: nothing to exchange
        self.assertEqual(_ranks(layout.ep), [r // 2 * 2, r // 2 * 2 + 1])
        self.assertEqual(_ranks(layout.dp), [r % 2, r % 2 + 2])
        self.assertEqual(_ranks(layout.data), [0, 1, 2, 3])
        self.assertEqual(layout.data_size, 4)
        self.assertEqual(layout.data_mesh.mesh_dim_names, ("dp_ep",))
        # the EP twin: another communicator over the same ranks, the overlap's
        twin = layout.ep_twin
        self.assertIsNotNone(twin)
        self.assertNotEqual(twin.group_name, layout.ep.group_name)
        self.assertEqual(_ranks(twin), _ranks(layout.ep))
        self.assertIs(overlap.twin_group(layout.ep), twin)
        # read once: the mesh converts to the same object
        self.assertIs(ParallelLayout.of(layout.mesh), layout)
        self.assertIs(ParallelLayout.of(layout), layout)

    def test_former_names_warn_and_agree(self) -> None:
        with self.assertWarnsRegex(DeprecationWarning, "launcher.parallel_layout"):
            mesh = launcher.device_mesh(pp=2, dp=1, ep=2)
        layout = ParallelLayout.of(mesh)
        self.assertEqual(mesh.mesh_dim_names, ("pp", "dp", "ep"))
        self.assertIsNotNone(layout.ep_twin)  # built as parallel_layout builds it
        with self.assertWarnsRegex(DeprecationWarning, r"ParallelLayout.of\(mesh\)"):
            self.assertIs(launcher.data_parallel_mesh(mesh), layout.data_mesh)
        with (
            self.assertWarns(DeprecationWarning),
            self.assertRaisesRegex(ValueError, "no 'dp' or 'ep' dimension"),
        ):
            launcher.data_parallel_mesh(mesh["pp"])

    def test_two_dimensional_mesh_reads_as_the_job_mesh(self) -> None:
        """A ("pp", "ep") mesh and parallel_layout(pp=2, ep=2) have one layout."""
        r = self.rank
        job = launcher.parallel_layout(pp=2, ep=2)
        demo = ParallelLayout.of(
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
        )
        for layout in (job, demo):
            self.assertEqual(_ranks(layout.pp), [r % 2, r % 2 + 2])
            self.assertEqual(_ranks(layout.ep), [r // 2 * 2, r // 2 * 2 + 1])
            self.assertIsNone(layout.dp)
            self.assertEqual(_ranks(layout.data), _ranks(layout.ep))
            self.assertEqual(
                layout.data_mesh.mesh.flatten().tolist(), _ranks(layout.ep)
            )
        self.assertIsNotNone(job.ep_twin)  # parallel_layout makes it, of() does not
        self.assertIsNone(demo.ep_twin)
        demo.make_ep_twin()
        self.assertEqual(_ranks(demo.ep_twin), _ranks(demo.ep))

    def test_groups_alone(self) -> None:
        group = dist.new_group([0, 1, 2, 3])
        as_ep = ParallelLayout.of(group)
        self.assertIs(as_ep.ep, group)
        self.assertIs(as_ep.data, group)
        self.assertIsNone(as_ep.dp)
        self.assertIsNone(as_ep.data_mesh)
        as_pp = ParallelLayout.of(group, alone="pp")
        self.assertIs(as_pp.pp, group)
        self.assertIsNone(as_pp.ep)
        one = ParallelLayout.of(None)
        self.assertEqual(
            (one.pp, one.ep, one.dp, one.data, one.data_size), (None,) * 4 + (1,)
        )

    def test_bad_input_is_refused(self) -> None:
        with self.assertRaisesRegex(TypeError, "got int"):
            ParallelLayout.of(4)  # type: ignore[arg-type]
        misnamed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "pp"))
        with self.assertRaisesRegex(
            ValueError, r"named from \('pp', 'dp', 'ep'\) in that order"
        ):
            ParallelLayout.of(misnamed)
        with self.assertRaisesRegex(ValueError, "needs 8 ranks, but the job has 4"):
            launcher.parallel_layout(pp=2, dp=2, ep=2)

    def test_stage_layout_of_separate_groups(self) -> None:
        """What pipeline_hf_causal_lm builds stages for: the pipeline dimension
        alone and ``ep_group`` beside it, or the job's mesh, not both."""
        try:
            from torch_pipelining_ext.hf._mesh import stage_layout
        except ImportError:
            self.skipTest("needs the hf extra")
        mesh = launcher.parallel_layout(pp=2, ep=2).mesh
        ep = mesh["ep"].get_group()
        for pipeline in (mesh["pp"], mesh["pp"].get_group()):
            layout = stage_layout(pipeline, ep)
            self.assertEqual(_ranks(layout.pp), _ranks(mesh["pp"].get_group()))
            self.assertIs(layout.ep, ep)
            self.assertIs(layout.data, ep)
        self.assertIs(stage_layout(mesh, None), ParallelLayout.of(mesh))
        with self.assertRaisesRegex(ValueError, "ep_group given twice"):
            stage_layout(mesh, ep)
        with self.assertRaisesRegex(ValueError, "ep_group must be a 1-D mesh"):
            stage_layout(mesh["pp"], mesh)
        with self.assertRaisesRegex(ValueError, "no 'pp' dimension"):
            stage_layout(mesh["ep"], None)

    def test_reduction_over_the_layout(self) -> None:
        """pp=1 x dp=2 x ep=2: a replicated weight's gradient is the mean over
        the four data ranks, an expert's the sum over its two dp replicas
        divided by four; the layout, its mesh and the expert-parallel group
        alone (no dp) give what the definition says."""
        layout = launcher.parallel_layout(dp=2, ep=2)
        r = self.rank
        dp_peer = (r + 2) % 4  # the other replica of this rank's experts
        for given, data_ranks, expert_ranks in (
            (layout, [0, 1, 2, 3], [r, dp_peer]),
            (layout.mesh, [0, 1, 2, 3], [r, dp_peer]),
            (layout.ep, _ranks(layout.ep), [r]),
        ):
            with self.subTest(given=type(given).__name__):
                model = nn.ModuleDict(
                    {"dense": nn.Linear(2, 2), "experts": nn.Linear(2, 2)}
                )
                for i, p in enumerate(model.parameters()):
                    p.grad = torch.full_like(p, float((r + 1) * (i + 1)))
                expert_parallel.reduce_expert_parallel_gradients(
                    model, given, sharded=lambda name, p: name.startswith("experts.")
                )
                size = len(data_ranks)
                for i, (name, p) in enumerate(model.named_parameters()):
                    ranks = expert_ranks if name.startswith("experts.") else data_ranks
                    want = sum((q + 1) * (i + 1) for q in ranks) / size
                    torch.testing.assert_close(
                        p.grad, torch.full_like(p, want), msg=f"rank {r}: {name}"
                    )


if __name__ == "__main__":
    run_tests()
