# Owner(s): ["oncall: distributed"]
"""Helpers shared by the pipelining tests.

* :class:`PipelineMultiProcTest` -- ``MultiProcContinuousTest`` with what every
  multi-process class here needs: the backend and device (gloo on CPU, or
  NCCL with one GPU per rank), one intra-op thread per rank, and fresh ranks
  after a failed test instead of skipping the rest of the class.
* :func:`nccl_variant` -- the NCCL copy of a gloo test class, guarded by
  upstream's ``requires_nccl()`` and ``skip_if_lt_x_gpu(world_size)``;
  :func:`nccl_decorators` -- the same guards for a single-process test that
  starts NCCL ranks itself.
* :func:`check_on_all_ranks` -- assertions that fail on every rank together.
* :func:`reference_step` -- one step of the unsplit model, for comparison;
  :func:`mse_loss` and :func:`token_cross_entropy`, the tests' losses;
  :func:`random_batch` and :func:`random_tokens`, their seeded data.
* :func:`load_csv` -- load a schedule written as a string.
* :func:`local_ranks_env` -- the environment of a command a test runs that
  starts its own ranks (not one of torchrun's);
  :class:`OneRankGroupTestCase` -- a one-rank gloo default process group
  for a class of single-process tests.
* :func:`parametrize_covering` -- ``parametrize`` over the product of several
  arguments' values, of which the default run takes a covering subset (each
  value of each argument at least once) and ``PYTORCH_TEST_WITH_SLOW=1`` the
  rest.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
import unittest
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    requires_nccl,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_utils import (
    parametrize,
    skip_but_pass_in_sandcastle_if,
    subtest,
    TEST_WITH_SLOW,
    TestCase,
)


_T = TypeVar("_T")

__all__ = [
    "check_on_all_ranks",
    "load_csv",
    "local_ranks_env",
    "mse_loss",
    "nccl_decorators",
    "nccl_variant",
    "OneRankGroupTestCase",
    "parametrize_covering",
    "PipelineMultiProcTest",
    "random_batch",
    "random_tokens",
    "reference_step",
    "REPO",
    "slow_only",
    "token_cross_entropy",
]


class PipelineMultiProcTest(MultiProcContinuousTest):
    """``world_size`` ranks, kept alive across the tests of a class.

    ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (``cuda:<rank>``); tests use
    :attr:`device`.  Each rank runs with one intra-op thread, so that four
    ranks fit on two cores.

    ``MultiProcContinuousTest`` skips every test after a failed one
    ("Previous test failed"), because a rank that failed may have left the
    others inside a collective.  Here the ranks are ended instead and the next
    test runs on new ones: each failure is reported by the test that failed,
    and no later test is hidden by it.
    """

    backend: ClassVar[str] = "gloo"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every class spawns its own ranks; a subclass must not use its parent's.
        cls._processes_spawned = False
        cls.poison_pill = False

    @classmethod
    def backend_str(cls) -> str:
        return cls.backend

    @classmethod
    def device_type(cls) -> str:
        return "cuda" if cls.backend == "nccl" else "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type() == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    @classmethod
    def _init_pg(cls, rank: int, world_size: int, rdvz_file: str) -> None:
        # Runs once in each rank's process, before its first test.
        torch.set_num_threads(1)
        if cls.device_type() == "cuda":
            torch.cuda.set_device(rank)
        # Process groups a test creates later (new_group, init_device_mesh)
        # get torch's default timeout of 30 minutes; give them the class's
        # timeout, like the default group, so that a collective that never
        # completes fails the test in minutes.
        from torch.distributed import distributed_c10d

        distributed_c10d.default_pg_timeout = cls.timeout
        if isinstance(distributed_c10d.default_pg_nccl_timeout, type(cls.timeout)):
            distributed_c10d.default_pg_nccl_timeout = cls.timeout
        super()._init_pg(rank, world_size, rdvz_file)

    @classmethod
    def setUpClass(cls) -> None:
        if cls.device_type() == "cuda" and torch.cuda.device_count() < cls.world_size:
            # skip_if_lt_x_gpu (see nccl_variant) skips inside the ranks; checking
            # here as well spares spawning ranks that have no GPU to run on.
            raise unittest.SkipTest(f"Need at least {cls.world_size} CUDA devices")
        super().setUpClass()

    def setUp(self) -> None:
        if type(self).poison_pill:
            type(self)._restart_ranks()
        super().setUp()

    @classmethod
    def _restart_ranks(cls) -> None:
        """End the ranks of a class whose last test failed; the next test spawns new ones."""
        for process in cls.processes:
            process.terminate()
        for process in cls.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join(timeout=60)
        if cls.rdvz_file is not None and os.path.exists(cls.rdvz_file):
            os.remove(cls.rdvz_file)
        cls.poison_pill = False
        if hasattr(cls, "_ensure_processes_spawned"):
            cls._processes_spawned = False  # spawned again by setUp
        else:  # torch whose MultiProcContinuousTest spawns in setUpClass only
            cls._spawn_processes(cls.world_size)


def nccl_variant(
    test_class: type[PipelineMultiProcTest], name: str | None = None
) -> type[PipelineMultiProcTest]:
    """The NCCL variant of a gloo test class: the same tests, one GPU per rank.

    ``requires_nccl()`` skips the class without NCCL (no rank is spawned), and
    every test carries ``skip_if_lt_x_gpu(world_size)``.  Create it after
    ``instantiate_parametrized_tests(test_class)``, and bind it to a module
    name so that the test runner finds it::

        ScheduleRuntimeTestNCCL = nccl_variant(ScheduleRuntimeTest)
    """
    name = name or f"{test_class.__name__}NCCL"
    namespace: dict[str, Any] = {
        "backend": "nccl",
        "__module__": test_class.__module__,
        "__qualname__": name,
        "__doc__": f"{test_class.__name__} on NCCL, one GPU per rank.",
    }
    for attr in dir(test_class):
        if attr.startswith("test"):
            namespace[attr] = skip_if_lt_x_gpu(test_class.world_size)(
                getattr(test_class, attr)
            )
    return requires_nccl()(type(name, (test_class,), namespace))


def nccl_decorators(n_gpus: int) -> list[Callable[[Any], Any]]:
    """``requires_nccl()`` and a skip below ``n_gpus`` GPUs, for a single-process
    test that starts NCCL ranks itself (``skip_if_lt_x_gpu`` skips only inside
    the ranks of a multi-process test), e.g.
    ``@parametrize("backend", ["gloo", subtest("nccl", decorators=nccl_decorators(4))])``."""
    return [
        requires_nccl(),
        skip_but_pass_in_sandcastle_if(
            torch.cuda.device_count() < n_gpus, f"Need at least {n_gpus} CUDA devices"
        ),
    ]


def check_on_all_ranks(
    check: Callable[[], None],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Run ``check`` on this rank; raise on every rank of ``group`` if it failed on any.

    A rank that stops at a failed assertion would leave the others waiting in
    the next collective; here they all learn of the failure and raise
    together (the ranks that passed with every failed rank's error), so no
    assertion sits between collectives.  Run the collectives the checks need
    (gathering gradients, say) before calling this.  ``device`` is the rank's
    device (:attr:`PipelineMultiProcTest.device`).
    """
    error: Exception | None = None
    try:
        check()
    except Exception as e:
        error = e
    failed = torch.tensor([int(error is not None)], device=device)
    dist.all_reduce(failed, group=group)
    if not failed.item():
        return
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        errors,
        None if error is None else f"{type(error).__name__}: {error}",
        group=group,
    )
    if error is not None:
        raise error
    raise AssertionError(
        "the check failed on other ranks:\n"
        + "\n".join(
            f"rank {rank}: {message}"
            for rank, message in enumerate(errors)
            if message is not None
        )
    )


REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
# what torchrun sets for its ranks
_TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def local_ranks_env() -> dict[str, str]:
    """The environment of a command that starts its own local ranks (the
    demo, the trainer, the launcher): this repository first on the import
    path, one intra-op thread unless set, and none of torchrun's variables,
    so that the command does not take itself for one of torchrun's ranks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    for var in _TORCHRUN_VARIABLES:
        env.pop(var, None)
    return env


class OneRankGroupTestCase(TestCase):
    """Owns a one-rank gloo default process group for the class (unless one
    exists already): single-process tests of code that asks for a group."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls._owns_pg = not dist.is_initialized()
        if cls._owns_pg:
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1
            )

    @classmethod
    def tearDownClass(cls) -> None:
        if cls._owns_pg:
            dist.destroy_process_group()
        super().tearDownClass()


def slow_only(reason: str) -> Callable[[_T], _T]:
    """Run a test, or every test of a class, only with ``PYTORCH_TEST_WITH_SLOW=1``
    (upstream's slow-test switch; skipped by ``unittest`` before any rank is
    asked to run it), and mark it slow as upstream's ``slowTest`` does
    (``slow_test``), so that ``PYTORCH_TEST_SKIP_FAST=1`` runs the slow tests
    alone (CI's slow step: the default step ran the others).

    On a class, put it above ``@instantiate_parametrized_tests``: each test,
    inherited ones included, is marked through a wrapper of its own, so that
    the same test in a class that runs by default stays unmarked.
    test_slow_marks.py checks that the two agree in every test file.
    """

    def mark(obj: _T) -> _T:
        if isinstance(obj, type):
            for name in dir(obj):
                test = getattr(obj, name)
                if name.startswith("test") and callable(test):
                    setattr(obj, name, _marked_slow(test))
        else:
            obj.slow_test = True  # type: ignore[attr-defined]
        return unittest.skipUnless(TEST_WITH_SLOW, reason)(obj)

    return mark


def _marked_slow(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def test(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    test.slow_test = True  # type: ignore[attr-defined]
    return test


def parametrize_covering(**values: list[Any]) -> Any:
    """``parametrize`` over every combination of ``values`` (argument name ->
    its values, in the order of the test's name).

    The default run takes ``max(len)`` of the combinations, the k-th made of
    the k-th value of each argument (cyclically), so that each value of each
    argument is tested at least once; the other combinations run with
    ``PYTORCH_TEST_WITH_SLOW=1`` (upstream's slow-test switch), skipped before
    any rank is asked to run them.
    """
    names = list(values)
    axes = [list(v) for v in values.values()]
    n = max(len(a) for a in axes)
    covering = {tuple(a[k % len(a)] for a in axes) for k in range(n)}
    slow = slow_only("another combination covers it: PYTORCH_TEST_WITH_SLOW=1")
    cases = [
        subtest(
            combination,
            name="_".join(f"{a}_{v}" for a, v in zip(names, combination)),
            decorators=[] if combination in covering else [slow],
        )
        for combination in itertools.product(*axes)
    ]
    return parametrize(",".join(names), cases)


def load_csv(schedule: Any, text: str, format: str = "compute_only") -> None:
    """``schedule._load_csv`` of a schedule given as CSV text (through a temporary file, removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        with open(path, "w") as f:
            f.write(text)
        schedule._load_csv(path, format=format)


def reference_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    target: torch.Tensor,
    n_microbatches: int,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step of the unsplit ``model`` on the schedule's microbatches.

    Gradients accumulate into ``model``'s like a schedule's with
    ``scale_grads=True`` (each microbatch's loss divided by
    ``n_microbatches``).  Returns the output (microbatches concatenated) and
    the per-microbatch losses, as ``schedule.step`` does.
    """
    outputs, losses = [], []
    for x, y in zip(inputs.chunk(n_microbatches), target.chunk(n_microbatches)):
        out = model(x)
        loss = loss_fn(out, y)
        (loss / n_microbatches).backward()
        outputs.append(out.detach())
        losses.append(loss.detach())
    return torch.cat(outputs), losses


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of the dense-model tests."""
    return F.mse_loss(output, target)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of ``logits [b, s, vocab]`` against ``labels [b, s]``."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def random_batch(seed: int, rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[rows, dim]`` of a dense model, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    return x, torch.randn(rows, dim, generator=gen)


def random_tokens(
    seed: int, rows: int, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[rows, seq_len]`` of a language model, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    return tokens, torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
