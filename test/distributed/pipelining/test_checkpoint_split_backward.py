# Owner(s): ["oncall: distributed"]
"""Selective activation checkpointing under a split backward (``torch_pipelining_ext/_checkpoint.py``).

Single process: a stage of two ``relu(x @ w.T + b) @ v.T`` blocks (see
:class:`_Block` for why that shape), checkpointed with a list
policy, a policy function (stateful, torchtitan's kind: it saves every other
matmul by counting them) or nested regions, differentiated by torch's split
backward (``stage_backward_input`` then ``stage_backward_weight``); every
gradient equals autograd's without checkpointing.  The cache of a region is
kept through the input pass and freed with the graph; the weight pass
recomputes a region once, not once per parameter group.  Stock torch
(``TORCH_PIPELINING_EXT_DISABLE=1``, in a subprocess) raises "Trying to
backward an extra time".

Two ranks (gloo): ScheduleDualPipeV, ScheduleZBVZeroBubble and
ScheduleInterleavedZeroBubble over four stages, with and without FSDP2: the
losses and every gradient equal the run without checkpointing (bitwise: the
recompute runs the same ops on the same inputs) and a single-process
reference; DualPipeV's concurrent OVERLAP_F_B is bitwise the sequential one.
The default run takes a covering subset of schedule x policy x FSDP
(``PYTORCH_TEST_WITH_SLOW=1``: all).
"""

from __future__ import annotations

import collections
import copy
import functools
import subprocess
import sys
import textwrap
import unittest
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import _backward, PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)
from torch.utils.checkpoint import (
    checkpoint,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

import torch_pipelining_ext
from torch_pipelining_ext._schedule_runtime import sequential_overlap_f_b

from common_pipelining import (
    check_on_all_ranks,
    local_ranks_env,
    mse_loss,
    parametrize_covering,
    PipelineMultiProcTest,
    random_batch,
    reference_step,
)


DIM = 8
N_STAGES = 4
N_MICROBATCHES = 4
MB_SIZE = 2
POLICIES = ["list", "function", "nested"]
SCHEDULES = {
    "DualPipeV": ScheduleDualPipeV,
    "ZBV": ScheduleZBVZeroBubble,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}
_SAVED_OPS = [torch.ops.aten.addmm.default, torch.ops.aten.mm.default]
_EXACT = {"rtol": 0.0, "atol": 0.0}


def _list_context() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(_SAVED_OPS)


def _counting_context() -> tuple[object, object]:
    """Saves every other matmul, counted apart in forward and recompute (torchtitan's policy)."""
    counts: collections.Counter[bool] = collections.Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _SAVED_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, context_fn):
    return functools.partial(
        checkpoint, forward, use_reentrant=False, context_fn=context_fn
    )


class _Block(nn.Module):
    """``relu(x @ w.T + b) @ v.T``.

    As a region: the cached ``addmm`` runs before the region's last tensor is
    saved, so each recompute takes it from the cache (a region whose cached
    ops all come last is cut short before them, and never reads the cache).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.b = nn.Parameter(torch.randn(dim) / dim)
        self.v = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, self.w, self.b)) @ self.v.T


class _Stage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _apply_policy(stage: _Stage, policy: str, fsdp: bool = False) -> None:
    """Selective checkpointing of every layer of ``stage``.

    ``nested``: and a region around them, the whole stage; with ``fsdp`` a
    region around each layer's instead, since FSDP's hooks of the modules
    inside a region run other ops in its recompute than in its forward
    (``record_function``), which torch's replay of the cache by call index
    refuses.
    """
    context_fn = _counting_context if policy == "function" else _list_context
    for layer in stage.layers:
        layer.forward = _checkpointed(layer.forward, context_fn)
        if policy == "nested" and fsdp:
            layer.forward = _checkpointed(layer.forward, _counting_context)
    if policy == "nested" and not fsdp:
        stage.forward = _checkpointed(stage.forward, _counting_context)


def _split_backward(
    stage: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(input gradient, parameter gradients) of ``stage(x).square().sum()`` by torch's split backward."""
    x = x.detach().requires_grad_()
    loss = stage(x).square().sum()
    (dx,), groups = _backward.stage_backward_input(
        [loss], None, [x], iter(list(stage.parameters()))
    )
    _backward.stage_backward_weight(iter(list(stage.parameters())), groups)
    return dx, [p.grad for p in stage.parameters()]


def _patch_status(name: str = "checkpoint_split_backward") -> str:
    statuses = {r.name: r.status.value for r in torch_pipelining_ext.patch_report()}
    return statuses[name]


# torch releases the patch is not written for (pinned per minor in
# test_patching.py): selective checkpointing under split-backward schedules
# is refused there (test_hf_stages.py), so there is nothing to run
_UNSUPPORTED = unittest.skipIf(
    _patch_status() == "unsupported",
    f"checkpoint_split_backward is unsupported on torch {torch.__version__}",
)


def _stage(seed: int = 0) -> _Stage:
    torch.manual_seed(seed)
    return _Stage(DIM)


@_UNSUPPORTED
class CheckpointSplitBackwardTest(TestCase):
    """One stage, torch's split backward, no process group."""

    def test_patch_applied(self) -> None:
        self.assertEqual(_patch_status(), "applied")

    @parametrize("policy", POLICIES)
    def test_split_backward_equals_autograd(self, policy: str) -> None:
        reference = _stage()
        stage = copy.deepcopy(reference)
        _apply_policy(stage, policy)
        x, _ = random_batch(0, 4, DIM)
        dx, grads = _split_backward(stage, x)
        x = x.detach().requires_grad_()
        expected = torch.autograd.grad(
            reference(x).square().sum(), [x, *reference.parameters()]
        )
        torch.testing.assert_close((dx, *grads), expected, **_EXACT)

    def test_cache_lives_until_the_graph_is_freed(self) -> None:
        modes: list[weakref.ref] = []

        def context_fn() -> tuple[object, object]:
            caching, cached = _list_context()
            modes.append(weakref.ref(cached))
            return caching, cached

        stage = _stage()
        layer = stage.layers[0]
        layer.forward = _checkpointed(layer.forward, context_fn)
        x = random_batch(0, 4, DIM)[0].requires_grad_()
        loss = stage(x).square().sum()
        params = list(stage.parameters())
        _, groups = _backward.stage_backward_input([loss], None, [x], iter(params))
        self.assertIsNotNone(modes[-1](), "the cache is gone before the weight pass")
        _backward.stage_backward_weight(iter(params), groups)
        del loss, groups  # the graph's last references
        self.assertIsNone(modes[-1](), "the cache outlived the graph")
        # an ordinary backward frees it as well
        stage(x).square().sum().backward()
        self.assertEqual(len(modes), 2)
        self.assertIsNone(modes[-1]())

    @unittest.skipIf(
        _patch_status("checkpoint_weight_pass_recompute") == "unsupported",
        f"torch {torch.__version__} has no GraphExecGroup: one recompute per parameter group",
    )
    @parametrize("policy", [None, "list"])
    def test_weight_pass_recomputes_once(self, policy: str | None) -> None:
        # A region of two weights behind two intermediates: two parameter groups,
        # one recompute in the weight pass ([Note: one recompute per weight pass]).
        runs: list[None] = []
        block = _stage().layers[0]
        forward = block.forward

        def counted(x: torch.Tensor) -> torch.Tensor:
            runs.append(None)
            return forward(x)

        kwargs = {} if policy is None else {"context_fn": _list_context}
        block.forward = functools.partial(
            checkpoint, counted, use_reentrant=False, **kwargs
        )
        x = random_batch(0, 4, DIM)[0].requires_grad_()
        params = list(block.parameters())
        _, groups = _backward.stage_backward_input(
            [block(x).square().sum()], None, [x], iter(params)
        )
        self.assertGreater(len(groups), 1)
        self.assertEqual(len(runs), 2)  # the forward, the input pass
        _backward.stage_backward_weight(iter(params), groups)
        self.assertEqual(len(runs), 3)

    def test_stock_torch_raises(self) -> None:
        script = textwrap.dedent(
            """
            import torch
            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
            from torch.distributed.pipelining import _backward
            import torch_pipelining_ext
            statuses = {r.name: r.status.value for r in torch_pipelining_ext.patch_report()}
            assert statuses["checkpoint_split_backward"] == "not applied", statuses
            w1, w2 = (torch.nn.Parameter(torch.randn(3, 3)) for _ in range(2))
            x = torch.randn(2, 3, requires_grad=True)
            y = checkpoint(
                lambda x: torch.tanh(x @ w1) @ w2, x, use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default]),
            )
            _, groups = _backward.stage_backward_input([y.sum()], None, [x], iter([w1, w2]))
            try:
                _backward.stage_backward_weight(iter([w1, w2]), groups)
            except RuntimeError as e:
                print(e)
            """
        )
        env = local_ranks_env()
        env["TORCH_PIPELINING_EXT_DISABLE"] = "1"
        out = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("Trying to backward an extra time", out.stdout)


instantiate_parametrized_tests(CheckpointSplitBackwardTest)


_MESH = None


class _Pipeline:
    """This rank's two stages of the four (with ``fsdp``: each ``fully_shard``-ed) and their schedule."""

    def __init__(
        self,
        schedule: str,
        policy: str | None,
        fsdp: bool,
        device: torch.device,
        *,
        overlap: bool = True,
    ) -> None:
        rank = dist.get_rank()
        v_shape = schedule != "InterleavedZeroBubble"
        self.stage_ids = [rank, N_STAGES - 1 - rank] if v_shape else [rank, rank + 2]
        torch.manual_seed(0)
        full = [_Stage(DIM).to(device) for _ in range(N_STAGES)]
        self.modules = [full[i] for i in self.stage_ids]
        group = None
        for module in self.modules:
            if policy is not None:
                _apply_policy(module, policy, fsdp)
            if fsdp:
                global _MESH
                if _MESH is None:
                    _MESH = init_device_mesh(
                        device.type, (2, 1), mesh_dim_names=("pp", "dp")
                    )
                for layer in module.layers:
                    fully_shard(layer, mesh=_MESH["dp"])
                fully_shard(module, mesh=_MESH["dp"])
                group = _MESH["pp"].get_group()
        stages = [
            PipelineStage(m, i, N_STAGES, device, group=group)
            for m, i in zip(self.modules, self.stage_ids)
        ]
        self.schedule = SCHEDULES[schedule](stages, N_MICROBATCHES, loss_fn=mse_loss)
        if not overlap:
            self.schedule.register_custom_function(
                sched.OVERLAP_F_B, sequential_overlap_f_b
            )

    def step(self, device: torch.device) -> tuple[list[torch.Tensor], dict]:
        """(losses, this rank's full gradients by ``stage.param``)."""
        x, y = (t.to(device) for t in random_batch(0, N_MICROBATCHES * MB_SIZE, DIM))
        losses: list[torch.Tensor] = []
        if 0 in self.stage_ids:
            self.schedule.step(x, target=y, losses=losses)
        else:
            self.schedule.step(target=y, losses=losses)
        grads = {}
        for m, i in zip(self.modules, self.stage_ids):
            for name, p in m.named_parameters():
                g = p.grad
                grads[f"{i}.{name}"] = (
                    g.full_tensor() if hasattr(g, "full_tensor") else g
                )
        return losses, grads


@_UNSUPPORTED
class CheckpointSplitBackwardScheduleTest(PipelineMultiProcTest):
    """Four stages on two ranks: checkpointed runs against the run without checkpointing."""

    world_size = 2

    @parametrize_covering(schedule=list(SCHEDULES), policy=POLICIES, fsdp=[True, False])
    def test_schedule(self, schedule: str, policy: str, fsdp: bool) -> None:
        plain_losses, plain_grads = _Pipeline(schedule, None, fsdp, self.device).step(
            self.device
        )
        losses, grads = _Pipeline(schedule, policy, fsdp, self.device).step(self.device)
        sequential = None
        if schedule == "DualPipeV":
            sequential = _Pipeline(
                schedule, policy, fsdp, self.device, overlap=False
            ).step(self.device)
        torch.manual_seed(0)
        reference = nn.Sequential(*(_Stage(DIM) for _ in range(N_STAGES))).to(
            self.device
        )
        x, y = (
            t.to(self.device) for t in random_batch(0, N_MICROBATCHES * MB_SIZE, DIM)
        )
        _, ref_losses = reference_step(reference, mse_loss, x, y, N_MICROBATCHES)
        ref_grads = {
            f"{i}.{n}": p.grad
            for i, m in enumerate(reference)
            for n, p in m.named_parameters()
        }

        def check() -> None:
            self.assertEqual(sorted(grads), sorted(plain_grads))
            torch.testing.assert_close(losses, plain_losses, **_EXACT)
            torch.testing.assert_close(grads, plain_grads, **_EXACT)
            if losses:  # the rank of the last stage
                torch.testing.assert_close(losses, ref_losses)
            torch.testing.assert_close(grads, {n: ref_grads[n] for n in grads})
            if sequential is not None:
                torch.testing.assert_close((losses, grads), sequential, **_EXACT)

        check_on_all_ranks(check, self.device)


instantiate_parametrized_tests(CheckpointSplitBackwardScheduleTest)


if __name__ == "__main__":
    run_tests()
