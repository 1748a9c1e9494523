# Owner(s): ["oncall: distributed"]
"""torchtitan's thread-local SPMD state on the backward thread of overlapped actions.

Runs without torchtitan: stand-in modules under torchtitan's and spmd_types'
module names hold a ``threading.local`` shaped like theirs (torchtitan
0.3.0's ``_MESH_TLS``, spmd_types 0.2's ``_state._tls``).

* ``_capture`` / ``_apply`` directly: a second thread sees the caller's meshes,
  pushes onto its own copy of the stacks, and gets its own state back after;
  nothing is captured while neither library is loaded; type checking and an
  unrecognised layout under the ``spmd_types`` backend are refused.
* End to end, with the pair the package registered on import:
  ``ScheduleDualPipeV`` on one rank with the package's concurrent
  OVERLAP_F_B, a model whose checkpointed layers read the current mesh in
  forward (so the recomputation on the backward thread needs it): losses and
  every gradient equal to a single-process reference; with the pair removed
  the step fails naming the missing mesh.
* With torchtitan installed (not in CI): the same capture on torchtitan's own
  ``set_spmd_meshes`` / ``set_current_spmd_mesh``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import threading
import types
import os
import subprocess
import unittest
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common_pipelining import OneRankGroupTestCase, reference_step
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as sched
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.utils.checkpoint import checkpoint

import torch_pipelining_ext
from torch_pipelining_ext import _torchtitan_compat
from torch_pipelining_ext._torchtitan_compat import _apply, _capture


HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
DIM = 8
N_MICROBATCHES = 4


class _Mesh:
    """Stands in for a DeviceMesh: what the model reads from it is a scale."""

    def __init__(self, name: str, scale: float) -> None:
        self.name, self.scale = name, scale

    def __repr__(self) -> str:
        return f"_Mesh({self.name!r})"


def _fake_libraries(
    backend: str = "spmd_types",
    with_layout: bool = True,
    releases: tuple[str, str] = ("0.3.0", "0.2.1"),
) -> dict[str, types.ModuleType]:
    """Modules named like torchtitan's and spmd_types', with their thread-local state's shape."""
    top = {name: types.ModuleType(name) for name in ("torchtitan", "spmd_types")}
    top["torchtitan"].__version__, top["spmd_types"].__version__ = releases
    titan = types.ModuleType(_torchtitan_compat._TORCHTITAN_SPMD)
    if with_layout:
        titan._MESH_TLS = threading.local()

    def current_spmd_mesh() -> _Mesh | None:
        stack = getattr(titan._MESH_TLS, "mesh_stack", None)
        return stack[-1] if stack else None

    titan.current_spmd_mesh = current_spmd_mesh
    utils = types.ModuleType(_torchtitan_compat._TORCHTITAN_UTILS)
    utils.get_spmd_backend = lambda: backend
    spmd_state = types.ModuleType(_torchtitan_compat._SPMD_TYPES_STATE)
    spmd_state._tls = threading.local()
    return {
        **top,
        _torchtitan_compat._TORCHTITAN_SPMD: titan,
        _torchtitan_compat._TORCHTITAN_UTILS: utils,
        _torchtitan_compat._SPMD_TYPES_STATE: spmd_state,
    }


@contextlib.contextmanager
def _loaded(
    modules: dict[str, types.ModuleType],
) -> Iterator[dict[str, types.ModuleType]]:
    with mock.patch.dict(sys.modules, modules):
        yield modules


@contextlib.contextmanager
def _not_loaded() -> Iterator[None]:
    names = (_torchtitan_compat._TORCHTITAN_SPMD, _torchtitan_compat._SPMD_TYPES_STATE)
    with mock.patch.dict(sys.modules):
        for name in names:
            sys.modules.pop(name, None)
        yield


def _on_thread(fn) -> Any:
    """``fn()`` on a new thread; its result or its exception here."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30.0)
    if thread.is_alive():
        raise RuntimeError("the helper thread did not finish within 30 s")
    if "error" in result:
        raise result["error"]
    return result["value"]


class CaptureApplyTest(TestCase):
    def test_nothing_loaded_captures_nothing(self) -> None:
        with _not_loaded():
            self.assertIsNone(_capture())
            with _apply(None):
                pass

    def test_worker_sees_callers_state_and_keeps_its_own(self) -> None:
        with _loaded(_fake_libraries()) as libs:
            titan_tls = libs[_torchtitan_compat._TORCHTITAN_SPMD]._MESH_TLS
            spmd_tls = libs[_torchtitan_compat._SPMD_TYPES_STATE]._tls
            dense, sparse = _Mesh("dense", 1.0), _Mesh("sparse", 2.0)
            titan_tls.dense_mesh, titan_tls.sparse_mesh, titan_tls.mesh_stack = (
                dense,
                sparse,
                [dense],
            )
            spmd_tls.mesh_stack = ["dense entry"]
            state = _capture()

            def worker() -> dict[str, Any]:
                titan_tls.dense_mesh = "the worker's own"
                seen: dict[str, Any] = {}
                with _apply(state):
                    seen["titan"] = (
                        titan_tls.dense_mesh,
                        titan_tls.sparse_mesh,
                        list(titan_tls.mesh_stack),
                    )
                    seen["spmd"] = list(spmd_tls.mesh_stack)
                    titan_tls.mesh_stack.append(
                        sparse
                    )  # maybe_set_sparse_mesh() on the worker
                    spmd_tls.mesh_stack.append("sparse entry")
                seen["after"] = (dict(vars(titan_tls)), dict(vars(spmd_tls)))
                return seen

            seen = _on_thread(worker)
            self.assertEqual(seen["titan"], (dense, sparse, [dense]))
            self.assertEqual(seen["spmd"], ["dense entry"])
            self.assertEqual(seen["after"], ({"dense_mesh": "the worker's own"}, {}))
            # the worker pushed onto copies: the caller's stacks are unchanged
            self.assertEqual(titan_tls.mesh_stack, [dense])
            self.assertEqual(spmd_tls.mesh_stack, ["dense entry"])
            self.assertIs(titan_tls.dense_mesh, dense)

    def test_type_checking_is_refused(self) -> None:
        with _loaded(_fake_libraries()) as libs:
            libs[_torchtitan_compat._SPMD_TYPES_STATE]._tls.current_mode = object()
            with self.assertRaisesRegex(
                RuntimeError, "spmd_types type checking is active"
            ):
                _capture()

    def test_unknown_layout(self) -> None:
        with _loaded(_fake_libraries(backend="spmd_types", with_layout=False)):
            with self.assertRaisesRegex(
                RuntimeError, "'_MESH_TLS' .* was not found.*'partial_dtensor'"
            ):
                _capture()
        # other backends keep no meshes per thread: nothing to carry
        with _loaded(_fake_libraries(backend="partial_dtensor", with_layout=False)):
            state = _capture()
            self.assertIsNotNone(state)
            self.assertIsNone(state.torchtitan)

    def test_other_releases_are_named(self) -> None:
        """A release other than the one the layout was written for: one warning per library, or an error in strict mode."""
        for strict in ("0", "1"):
            with (
                self.subTest(strict=strict),
                _loaded(_fake_libraries(releases=("0.4.0", "0.2.1"))),
                mock.patch.object(_torchtitan_compat, "_checked_releases", set()),
                mock.patch.dict(os.environ, {"TORCH_PIPELINING_EXT_STRICT": strict}),
            ):
                if strict == "1":
                    with self.assertRaisesRegex(
                        RuntimeError,
                        r"as torchtitan 0\.3\.x lays it out, and found torchtitan 0\.4\.0.*STRICT=1",
                    ):
                        _capture()
                    continue
                with self.assertWarnsRegex(RuntimeWarning, "found torchtitan 0.4.0"):
                    self.assertIsNotNone(_capture())
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    _capture()  # once per process
        # the release written for: quiet, strict or not
        with (
            _loaded(_fake_libraries()),
            mock.patch.object(_torchtitan_compat, "_checked_releases", set()),
            mock.patch.dict(os.environ, {"TORCH_PIPELINING_EXT_STRICT": "1"}),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("error")
            self.assertIsNotNone(_capture())

    def test_registered_once(self) -> None:
        self.assertIs(_torchtitan_compat.register(), _torchtitan_compat.register())

    def test_registered_with_the_patches_only(self) -> None:
        from torch_pipelining_ext.overlap._settings import SETTINGS

        def registered() -> bool:
            return any(
                hook == (_capture, _apply)
                for hook in SETTINGS.thread_state_hooks.values()
            )

        self.assertTrue(registered())
        try:
            torch_pipelining_ext.unpatch()
            self.assertFalse(registered())
        finally:
            torch_pipelining_ext.patch()
        self.assertTrue(registered())
        # importing with TORCH_PIPELINING_EXT_DISABLE=1 registers nothing
        code = (
            "import torch_pipelining_ext\n"
            "from torch_pipelining_ext.overlap._settings import SETTINGS\n"
            "print(len(SETTINGS.thread_state_hooks))\n"
        )
        env = {**os.environ, "TORCH_PIPELINING_EXT_DISABLE": "1"}
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.strip(), "0")

    def test_turned_off_by_the_environment(self) -> None:
        from torch_pipelining_ext.overlap._settings import SETTINGS

        def registered() -> bool:
            return any(
                hook == (_capture, _apply)
                for hook in SETTINGS.thread_state_hooks.values()
            )

        try:
            torch_pipelining_ext.unpatch()
            with mock.patch.dict(
                os.environ, {_torchtitan_compat.THREAD_STATE_ENV: "0"}
            ):
                torch_pipelining_ext.patch()
                self.assertFalse(registered())
                self.assertIsNone(_torchtitan_compat.register())
        finally:
            torch_pipelining_ext.patch()
        self.assertTrue(registered())


_THREADS: set[str] = set()  # the threads _MeshScaled.forward ran on


class _MeshScaled(nn.Module):
    """A layer whose forward reads torchtitan's current mesh, as the token dispatcher does."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = sys.modules[_torchtitan_compat._TORCHTITAN_SPMD].current_spmd_mesh()
        _THREADS.add(threading.current_thread().name)
        if mesh is None:
            raise RuntimeError(
                f"no current SPMD mesh on thread {threading.current_thread().name}"
            )
        return torch.tanh(self.lin(x)) * mesh.scale


class _Stage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MeshScaled(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            # non-reentrant checkpoint: the recomputation runs in backward, on the backward thread
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


class OverlappedActionTest(OneRankGroupTestCase):
    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        if dist.get_world_size() != 1:  # a group this class does not own
            raise unittest.SkipTest(
                f"a process group of {dist.get_world_size()} ranks exists in this process"
            )

    def _run(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        reference = nn.Sequential(*(_Stage(DIM) for _ in range(2)))
        parts = [copy.deepcopy(stage) for stage in reference]
        stages = [
            PipelineStage(part, i, 2, torch.device("cpu"))
            for i, part in enumerate(parts)
        ]
        schedule = sched.ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=_mse)
        gen = torch.Generator().manual_seed(1)
        x, y = (
            torch.randn(2 * N_MICROBATCHES, DIM, generator=gen),
            torch.randn(2 * N_MICROBATCHES, DIM, generator=gen),
        )
        losses: list[torch.Tensor] = []
        out = schedule.step(x, target=y, losses=losses)
        ref_out, ref_losses = reference_step(reference, _mse, x, y, N_MICROBATCHES)
        torch.testing.assert_close((out, losses), (ref_out, ref_losses))
        ref_params = dict(reference.named_parameters())
        for i, part in enumerate(parts):
            for name, p in part.named_parameters():
                self.assertIsNotNone(p.grad, f"stage {i} {name}: no gradient")
                torch.testing.assert_close(
                    p.grad,
                    ref_params[f"{i}.{name}"].grad,
                    msg=lambda m: f"stage {i} {name}: {m}",
                )

    def test_dualpipev_backward_thread_sees_the_mesh(self) -> None:
        with _loaded(_fake_libraries()) as libs:
            titan = libs[_torchtitan_compat._TORCHTITAN_SPMD]
            mesh = _Mesh("dense", 0.5)
            titan._MESH_TLS.mesh_stack = [mesh]
            _THREADS.clear()
            self._run()
            # some recomputation ran on the worker thread of an overlapped action
            self.assertGreater(
                len(_THREADS - {threading.current_thread().name}), 0, _THREADS
            )
            self.assertEqual(titan._MESH_TLS.mesh_stack, [mesh])

    def test_without_the_pair_the_backward_thread_has_no_mesh(self) -> None:
        with _loaded(_fake_libraries()) as libs:
            titan = libs[_torchtitan_compat._TORCHTITAN_SPMD]
            titan._MESH_TLS.mesh_stack = [_Mesh("dense", 0.5)]
            _torchtitan_compat.unregister()
            try:
                with self.assertRaisesRegex(
                    RuntimeError,
                    "backward sub-action .* failed: .*no current SPMD mesh on thread",
                ):
                    self._run()
            finally:
                _torchtitan_compat.register()


@unittest.skipUnless(
    HAS_TORCHTITAN,
    "needs torchtitan (tools/torchtitan_check.sh runs these with torchtitan 0.3.0)",
)
class RealTorchtitanTest(TestCase):
    def test_captures_torchtitans_meshes(self) -> None:
        from torchtitan.distributed import spmd_types as titan_spmd
        from torchtitan.distributed.utils import get_spmd_backend

        if get_spmd_backend() != "spmd_types":
            self.skipTest(
                f"torchtitan's SPMD backend is {get_spmd_backend()!r} in this process"
            )
        dense, sparse = _Mesh("dense", 1.0), _Mesh("sparse", 1.0)
        titan_spmd.set_spmd_meshes(dense_mesh=dense, sparse_mesh=sparse)
        titan_spmd._spmd_mesh_stack().append(
            dense
        )  # what set_current_spmd_mesh(dense) pushes
        try:
            state = _capture()

            def worker() -> tuple[Any, Any, Any]:
                with _apply(state):
                    return (
                        titan_spmd.spmd_dense_mesh(),
                        titan_spmd.spmd_sparse_mesh(),
                        titan_spmd.current_spmd_mesh(),
                    )

            self.assertEqual(_on_thread(worker), (dense, sparse, dense))
            self.assertIsNone(
                _on_thread(titan_spmd.current_spmd_mesh)
            )  # without the pair: nothing
        finally:
            titan_spmd._spmd_mesh_stack().pop()
            titan_spmd.set_spmd_meshes(dense_mesh=None, sparse_mesh=None)


if __name__ == "__main__":
    run_tests()
