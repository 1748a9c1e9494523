"""Train an MoE model of one's own with pipeline and expert parallelism.

    python examples/custom_moe.py --pp 1 --ep 2       # 2 ranks: PP=1 x EP=2
    python examples/custom_moe.py --pp 2 --ep 2       # 4 ranks: PP=2 x EP=2
    python examples/custom_moe.py --pp 1 --ep 2 --nprocs 4   # and DP=2

The model (an embedding, 4 blocks each with a router and 4 experts, a head)
is written the way any model of one's own would be, with three additions:

1. its forward tolerates the modules a pipeline stage does not hold
   (``call_if_present``, iterating over ``self.layers``);
2. the expert-parallel exchanges -- the token counts, then the tokens, and
   back -- run inside the overlap's communication marks, with the package's
   autograd all-to-all (``overlap.all_to_all``), so that the concurrent
   OVERLAP_F_B of ``ScheduleDualPipeV`` hides one microbatch's exchange
   behind another's compute;
3. after each step the gradients of the weights every EP rank holds are
   averaged over the ranks (``expert_parallel.reduce_expert_parallel_gradients``).

Each rank builds the same model, splits it into ``2 * pp`` stages (a V
schedule runs two per pipeline rank) and trains two steps with the
overlapped OVERLAP_F_B, then again with the sequential one
(``TORCH_PIPELINING_EXT_OVERLAP=0``); the two must be bitwise equal.  Rank
0 then checks the losses and every gradient against the unsplit model
trained in one process on the whole batch.  The last line printed is
machine-readable.  The ranks are local gloo processes started by
``torch_pipelining_ext.launcher`` (or the ones ``torchrun`` started).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_pipelining_ext  # noqa: F401  (patches torch.distributed.pipelining)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleDualPipeV
from torch_pipelining_ext import expert_parallel, launcher, overlap
from torch_pipelining_ext.stage_split import (
    call_if_present,
    generate_module_names_per_stage,
    pipeline_module_split,
)


VOCAB, DIM, HIDDEN = 64, 16, 32
LAYERS, EXPERTS, TOP_K = 4, 4, 2
SEQ_LEN, MICROBATCH_SIZE = 8, 2
STEPS, LR = 2, 0.5


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class MoE(nn.Module):
    """Top-k routing over ``EXPERTS`` experts, ``EXPERTS / ep`` of them on this rank.

    Every rank draws every expert's weights from the same random stream and
    keeps its own: the unsplit model built from the same seed (``ep_group``
    ``None``) holds the same values, which is what the final check relies on.
    """

    def __init__(self, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        # a process group kept on the module, the usual way: the stage split
        # shares it with the stage modules instead of copying it
        self.ep_group = ep_group
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.n_local = EXPERTS // ep
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        up = torch.randn(EXPERTS, DIM, HIDDEN) * DIM**-0.5
        down = torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN**-0.5
        mine = slice(ep_rank * self.n_local, (ep_rank + 1) * self.n_local)
        # the names say which parameters are sharded over EP (see train_rank)
        self.experts_up = nn.Parameter(up[mine].clone())
        self.experts_down = nn.Parameter(down[mine].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        if tokens.is_meta:  # shape inference on the meta device: no routing
            return x
        weights, experts = self.router(tokens).softmax(dim=-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # one row per (token, chosen expert), sorted by expert: experts are
        # numbered rank by rank, so the rows are grouped by destination rank
        order = experts.flatten().argsort(stable=True)
        token_of_row = order // TOP_K
        counts = torch.bincount(experts.flatten(), minlength=EXPERTS)
        received, recv_counts, splits = self.dispatch(tokens[token_of_row], counts)
        out = self.combine(self.experts(received, recv_counts), splits)
        out = out * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_of_row, out).view_as(x)

    def dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
        """Send each row to the rank of its expert.

        Everything the dispatch communicates -- the count exchange too --
        runs between ``dispatch_begin`` and ``dispatch_end``: inside an
        overlapped OVERLAP_F_B the other microbatch computes meanwhile.
        ``overlap.all_to_all`` is differentiable (its backward is the reverse
        exchange), brings its own marks (nested regions are fine) and runs on
        the communicator ``overlap.side_group`` gives when it runs.
        """
        if self.ep_group is None:  # the unsplit reference: nothing to send
            return rows, counts.view(1, -1), ([rows.shape[0]], [rows.shape[0]])
        ep = dist.get_world_size(self.ep_group)
        rows = overlap.dispatch_begin(rows)
        # counts[e]: rows for expert e; each rank receives those for its experts
        recv_counts = overlap.all_to_all(counts, group=self.ep_group)
        send = counts.view(ep, self.n_local).sum(dim=1).tolist()
        recv_counts = recv_counts.view(ep, self.n_local)
        recv = recv_counts.sum(dim=1).tolist()
        received = overlap.all_to_all(rows, recv, send, self.ep_group)
        return overlap.dispatch_end(received), recv_counts, (send, recv)

    def combine(
        self, out: torch.Tensor, splits: tuple[list[int], list[int]]
    ) -> torch.Tensor:
        """Send the experts' outputs back (the marks come with ``phase="combine"``)."""
        if self.ep_group is None:
            return out
        send, recv = splits
        return overlap.all_to_all(out, send, recv, self.ep_group, phase="combine")

    def experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``rows``, grouped by source rank, then expert."""
        expert_of_row = torch.arange(self.n_local).repeat(counts.shape[0])
        expert_of_row = expert_of_row.repeat_interleave(counts.flatten())
        order = expert_of_row.argsort(stable=True)
        groups = rows[order].split(counts.sum(dim=0).tolist())
        outs = [
            F.silu(x @ self.experts_up[e]) @ self.experts_down[e]
            for e, x in enumerate(groups)
        ]
        return torch.cat(outs)[order.argsort()]


class Block(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.moe = MoE(ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class CustomMoE(nn.Module):
    """The default names of ``generate_module_names_per_stage``:
    ``tok_embeddings``, ``layers``, ``norm``, ``output``."""

    def __init__(self, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(ep_group) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on a stage, the modules it does not hold are None (call_if_present
        # passes x on) and self.layers holds only its blocks
        h = call_if_present(self.tok_embeddings, x)  # ids -> hidden, first stage
        for layer in self.layers:
            h = layer(h)
        return call_if_present(self.output, call_if_present(self.norm, h))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A microbatch's mean loss (the schedule averages the microbatches)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def is_expert(name: str, param: nn.Parameter) -> bool:
    """The parameters sharded over the EP ranks (the rest is replicated)."""
    return name.rsplit(".", 1)[-1] in ("experts_up", "experts_down")


def global_batch(data_ranks: int, microbatches: int, step: int) -> torch.Tensor:
    """``step``'s token ids of every data rank, ``[ranks * batch, SEQ_LEN + 1]``."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = data_ranks * microbatches * MICROBATCH_SIZE
    return torch.randint(VOCAB, (rows, SEQ_LEN + 1), generator=g)


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------


def build(mesh: Any, ep_group: Any, microbatches: int, sequential: bool) -> tuple:
    """This rank's stages of the model and their schedule."""
    torch.manual_seed(0)  # the same model on every rank, and in the reference
    # [quick-start]
    model = CustomMoE(ep_group)
    # a V schedule runs two stages per pipeline rank: 2 * pp stages in all
    names = generate_module_names_per_stage(
        num_stages=2 * mesh["pp"].size(), num_layers=len(model.layers)
    )
    stages, parts = pipeline_module_split(
        model, mesh["pp"], ScheduleDualPipeV, "cpu", names
    )
    # [/quick-start]
    # the switch is read when a schedule is built: 0 runs OVERLAP_F_B's
    # sub-actions one after the other for this schedule's whole life
    previous = os.environ.get("TORCH_PIPELINING_EXT_OVERLAP")
    os.environ["TORCH_PIPELINING_EXT_OVERLAP"] = "0" if sequential else "1"
    try:
        schedule = ScheduleDualPipeV(stages, microbatches, loss_fn=loss_fn)
    finally:
        if previous is None:
            del os.environ["TORCH_PIPELINING_EXT_OVERLAP"]
        else:
            os.environ["TORCH_PIPELINING_EXT_OVERLAP"] = previous
    return parts, schedule


class CountOverlapped(overlap.ActionObserver):
    """Counts the OVERLAP_F_B actions whose two sides ran concurrently."""

    def __init__(self) -> None:
        self.actions = 0

    def sub_action(self, side: str, start: float, end: float) -> None:
        self.actions += side == "backward"


def train(mesh: Any, ep_group: Any, args: argparse.Namespace, sequential: bool) -> dict:
    """Train ``STEPS`` steps; this rank's losses and gradients of every step."""
    with overlap.observe_actions(CountOverlapped()) as counter:
        record = train_steps(mesh, ep_group, args, sequential)
    return {**record, "overlapped_actions": counter.actions}


def train_steps(
    mesh: Any, ep_group: Any, args: argparse.Namespace, sequential: bool
) -> dict:
    """The steps of :func:`train`."""
    parts, schedule = build(mesh, ep_group, args.microbatches, sequential)
    optimizers = [torch.optim.SGD(p.parameters(), lr=LR) for p in parts]
    data = launcher.ParallelLayout.of(mesh).data_mesh
    mine = slice(
        data.get_local_rank() * args.microbatches * MICROBATCH_SIZE,
        (data.get_local_rank() + 1) * args.microbatches * MICROBATCH_SIZE,
    )
    record: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        ids = global_batch(data.size(), args.microbatches, step)[mine]
        # contiguous: torch 2.9's stages check the strides of their inputs
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        # [quick-start]
        losses: list[torch.Tensor] = []
        schedule.step(inputs, target=targets, losses=losses)
        # experts' gradients summed over their replicas, the rest averaged
        expert_parallel.reduce_expert_parallel_gradients(parts, mesh, sharded=is_expert)
        # [/quick-start]
        if losses:  # the ranks that hold the last stage
            record["losses"].append(torch.stack(losses).detach().mean())
        record["grads"].append(
            {n: p.grad.clone() for part in parts for n, p in part.named_parameters()}
        )
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return record


def bitwise_equal(a: dict, b: dict) -> bool:
    """The two runs' losses and gradients are the same bits on every rank."""
    same = len(a["losses"]) == len(b["losses"]) and all(
        torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])
    )
    for ga, gb in zip(a["grads"], b["grads"]):
        same = same and ga.keys() == gb.keys()
        same = same and all(torch.equal(ga[n], gb[n]) for n in ga)
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def train_rank(rank: int, args: argparse.Namespace) -> dict | None:
    """One rank's work; rank 0 returns every rank's results gathered."""
    # the ranks (launcher.launch, or torchrun) as torch's ("pp", "dp", "ep") mesh
    mesh = init_device_mesh(
        "cpu", (args.pp, args.dp, args.ep), mesh_dim_names=("pp", "dp", "ep")
    )
    ep_group = mesh["ep"].get_group() if args.ep > 1 else None
    if ep_group is not None:
        # the backward side of an overlapped action exchanges on a twin of
        # the EP group (overlap.all_to_all asks overlap.side_group); every
        # rank creates the twins at once, before the first step
        overlap.create_twin_group(ep_group)
    overlapped = train(mesh, ep_group, args, sequential=False)
    sequential = train(mesh, ep_group, args, sequential=True)
    equal = (
        bitwise_equal(overlapped, sequential) and sequential["overlapped_actions"] == 0
    )
    mine = {
        "ep_rank": mesh["ep"].get_local_rank(),
        "data_rank": launcher.ParallelLayout.of(mesh).data_mesh.get_local_rank(),
        **overlapped,
    }
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    return {
        "overlap_bitwise": equal,
        "overlapped_actions": sum(r["overlapped_actions"] for r in gathered),
        **assemble(gathered, args.ep),
    }


def assemble(ranks: list[dict], ep: int) -> dict:
    """Per step: the global loss (mean over the data ranks) and every
    gradient of the whole model (experts: each EP rank's slice)."""
    losses, grads = [], []
    for step in range(STEPS):
        per_data_rank = {
            r["data_rank"]: r["losses"][step] for r in ranks if r["losses"]
        }
        losses.append(torch.stack(list(per_data_rank.values())).mean())
        whole: dict[str, Any] = {}
        for r in sorted(ranks, key=lambda r: r["ep_rank"]):
            for name, grad in r["grads"][step].items():
                if not is_expert(name, grad):
                    whole[name] = grad
                elif r["data_rank"] < ep:  # the first data-parallel replica
                    whole.setdefault(name, []).append(grad)
        grads.append(
            {n: torch.cat(g) if isinstance(g, list) else g for n, g in whole.items()}
        )
    return {"losses": losses, "grads": grads}


# ---------------------------------------------------------------------------
# The unsplit reference, one process, the whole batch
# ---------------------------------------------------------------------------


def reference(data_ranks: int, microbatches: int) -> dict:
    """The unsplit model's global losses and gradients, step by step."""
    torch.manual_seed(0)
    model = CustomMoE()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        ids = global_batch(data_ranks, microbatches, step)
        loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a layout that does not fit exits with status 2 and a message."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline ranks (each runs 2 stages)"
    )
    parser.add_argument(
        "--ep", type=int, default=2, help="expert-parallel ranks (divides 4)"
    )
    parser.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="ranks in all (default pp x ep); the rest of pp x ep is data-parallel",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per step (at least 2 x pp)",
    )
    args = parser.parse_args(argv)
    if args.pp < 1 or args.ep < 1 or EXPERTS % args.ep:
        parser.error(f"--pp must be positive and --ep divide {EXPERTS} (the experts)")
    args.nprocs = args.pp * args.ep if args.nprocs is None else args.nprocs
    if args.nprocs < 1 or args.nprocs % (args.pp * args.ep):
        parser.error(
            f"--pp {args.pp} x --ep {args.ep} = {args.pp * args.ep} ranks does not "
            f"divide --nprocs {args.nprocs}"
        )
    if args.microbatches < 2 * args.pp:
        parser.error(
            f"ScheduleDualPipeV needs --microbatches >= 2 x pp = {2 * args.pp}"
        )
    args.dp = args.nprocs // (args.pp * args.ep)
    return args


def run(args: argparse.Namespace) -> dict | None:
    """Launch the ranks; every rank's results, gathered by rank 0 (``None``
    on the other ranks ``torchrun`` started)."""
    return launcher.launch(train_rank, args.nprocs, args, threads_per_rank=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if result is None:  # not rank 0
        return 0
    expected = reference(args.dp * args.ep, args.microbatches)
    for step in range(STEPS):
        torch.testing.assert_close(result["losses"][step], expected["losses"][step])
        torch.testing.assert_close(result["grads"][step], expected["grads"][step])
        print(
            f"step {step}: loss {result['losses'][step].item():.6f} "
            f"(unsplit model: {expected['losses'][step].item():.6f})"
        )
    print(
        f"custom_moe pp={args.pp} ep={args.ep} dp={args.dp} steps={STEPS} "
        f"loss={result['losses'][-1].item():.6f} matches_unsplit=yes "
        f"overlapped_actions={result['overlapped_actions']} "
        f"overlap_bitwise={'yes' if result['overlap_bitwise'] else 'no'}"
    )
    return 0 if result["overlap_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
