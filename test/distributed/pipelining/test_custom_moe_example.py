# Owner(s): ["oncall: distributed"]
"""``examples/custom_moe.py`` runs, trains correctly, and is what the README shows.

* PP=1 x EP=2, PP=2 x EP=2 and PP=1 x DP=2 x EP=2: the example's ranks train two steps; every step's loss
  and every gradient (after ``expert_parallel.reduce_expert_parallel_gradients``)
  equal those of the unsplit model trained in one process on the whole batch,
  and the overlapped OVERLAP_F_B is bitwise the sequential one.
* A layout that does not fit exits with status 2 and says why.
* The README's Quick start is an excerpt of the example.
* ``expert_parallel.reduce_expert_parallel_gradients`` refuses bad arguments.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import textwrap
from pathlib import Path

import torch
import torch.nn as nn
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_pipelining_ext import expert_parallel


REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "custom_moe.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


class CustomMoEExampleTest(TestCase):
    def _check_layout(self, argv: list[str]) -> None:
        torch.set_num_threads(1)
        args = example.parse_args(argv)
        result = example.run(args)
        expected = example.reference(args.dp * args.ep, args.microbatches)
        self.assertTrue(result["overlap_bitwise"])
        self.assertGreater(result["overlapped_actions"], 0)  # the overlap did run
        self.assertEqual(len(result["losses"]), example.STEPS)
        for step in range(example.STEPS):
            torch.testing.assert_close(result["losses"][step], expected["losses"][step])
            got, want = result["grads"][step], expected["grads"][step]
            self.assertEqual(sorted(got), sorted(want))  # every parameter
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=name)

    @parametrize("layout", ["pp1_ep2", "pp2_ep2", "pp1_dp2_ep2"])
    def test_trains_like_the_unsplit_model(self, layout: str) -> None:
        argv = {
            "pp1_ep2": ["--pp", "1", "--ep", "2"],
            "pp2_ep2": ["--pp", "2", "--ep", "2"],
            "pp1_dp2_ep2": ["--pp", "1", "--ep", "2", "--nprocs", "4"],
        }[layout]
        self._check_layout(argv)

    def test_bad_layouts_exit_2(self) -> None:
        cases = {
            ("--pp", "3", "--ep", "2", "--nprocs", "4"): "does not divide --nprocs 4",
            ("--ep", "3"): "--ep divide 4",
            ("--pp", "2", "--microbatches", "3"): "--microbatches >= 2 x pp = 4",
        }
        for argv, message in cases.items():
            stderr = io.StringIO()
            with (
                self.assertRaises(SystemExit) as cm,
                contextlib.redirect_stderr(stderr),
            ):
                example.parse_args(list(argv))
            self.assertEqual(cm.exception.code, 2)
            self.assertIn(message, stderr.getvalue())

    def test_readme_quick_start_is_an_excerpt(self) -> None:
        readme = (REPO / "README.md").read_text()
        section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
        block = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL).group(1)
        source = EXAMPLE.read_text()
        chunks = re.findall(
            r"# \[quick-start\]\n(.*?)\n\s*# \[/quick-start\]", source, flags=re.DOTALL
        )
        self.assertEqual(len(chunks), 2)
        for chunk in chunks:
            self.assertIn(textwrap.dedent(chunk), block)


class ReduceExpertParallelGradientsTest(TestCase):
    def test_bad_arguments(self) -> None:
        model, other = nn.Linear(2, 2), nn.Linear(2, 2)
        with self.assertRaisesRegex(TypeError, "DeviceMesh"):
            expert_parallel.reduce_expert_parallel_gradients(
                model, "ep", sharded=lambda n, p: False
            )
        with self.assertRaisesRegex(
            ValueError, "1 of the 1 parameters given as sharded"
        ):
            expert_parallel.reduce_expert_parallel_gradients(
                model, None, sharded=[other.weight]
            )

    def test_one_rank_leaves_gradients(self) -> None:
        model = nn.Linear(2, 2)
        model(torch.ones(1, 2)).sum().backward()
        before = [p.grad.clone() for p in model.parameters()]
        expert_parallel.reduce_expert_parallel_gradients(
            [model], None, sharded=[model.weight]
        )
        for p, g in zip(model.parameters(), before):
            self.assertEqual(p.grad, g, atol=0, rtol=0)


instantiate_parametrized_tests(CustomMoEExampleTest)

if __name__ == "__main__":
    run_tests()
