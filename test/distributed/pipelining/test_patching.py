# Owner(s): ["oncall: distributed"]
"""Tests for the patch registry (``torch_pipelining_ext/_patching.py``) and the
package-level ``patch()`` / ``unpatch()`` / ``patch_report()``."""

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from unittest import mock
import warnings

import torch
import torch_pipelining_ext
from torch_pipelining_ext._patching._table import _REGISTRY
from torch_pipelining_ext._patching._registry import (
    _PatchRegistry,
    AlreadyUpstream,
    Patch,
    PatchNeeded,
    PatchStatus,
    Target,
)
from torch.testing._internal.common_utils import run_tests, TestCase


_FAKE = "_tpe_fake_torch_module"

# The status every patch gets on each supported torch minor (A: applied,
# U: upstream -- torch has the behaviour, or the patch does not apply to it;
# N: unsupported -- a release the patch is not written for, which its probe
# recognises; ?: not established on that release, not checked).
# A probe that misreads a torch release fails test_status_pinned_per_torch_minor
# instead of warning on import.
_PINNED_STATUS = """
patch                              2.9 2.10 2.11 2.12 2.13 2.14 2.15
stage_init_handshake                 A    A    A    A    A    A    U
p2p_to_own_rank                      A    A    A    A    A    A    A
schedule_backward_counter            A    A    A    A    A    A    A
runtime_custom_functions             A    U    U    U    U    U    U
runtime_public_names                 A    A    A    A    A    A    A
runtime_step_loop                    A    U    U    U    U    U    U
runtime_keep_overlap_f_b             A    U    U    U    U    U    U
runtime_step_context                 A    A    A    A    A    A    A
runtime_action_functions             A    A    A    A    A    A    A
scale_grads_per_step                 A    A    A    A    A    A    A
metadata_inference_keeps_grads       U    ?    U    ?    A    ?    A
compute_comms_reduce_grad            U    A    A    A    A    A    A
fsdp_split_backward_params           A    A    A    A    A    A    A
split_backward_weight                A    A    A    A    U    U    U
split_backward_non_tensor_inputs     A    A    A    A    U    U    U
overlap_f_b                          A    A    A    A    A    A    A
stage_split                          A    A    A    A    A    A    A
checkpoint_split_backward            A    A    A    A    A    A    A
checkpoint_weight_pass_recompute     N    A    A    A    A    A    A
"""


def _pinned_status(minor: str) -> dict[str, str] | None:
    """``{patch: status}`` pinned for torch ``minor`` (``"2.13"``), or None if it is not supported."""
    header, *rows = (line.split() for line in _PINNED_STATUS.strip().splitlines())
    if minor not in header:
        return None
    column = header.index(minor)
    status = {
        "A": PatchStatus.APPLIED.value,
        "U": PatchStatus.UPSTREAM.value,
        "N": PatchStatus.UNSUPPORTED.value,
    }
    return {row[0]: status[row[column]] for row in rows if row[column] != "?"}


def _fake_module() -> types.ModuleType:
    mod = types.ModuleType(_FAKE)

    class Runtime:
        def step(self):
            return "orig"

    mod.Runtime = Runtime
    mod.helper = lambda: "orig"
    sys.modules[_FAKE] = mod
    return mod


def _needed():
    return PatchNeeded, "feature missing"


def _run_python(
    code: str, env_extra: dict[str, str] | None = None, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, without the package's switches set (but ``env_extra``)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("TORCH_PIPELINING_EXT_")
    }
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )


class PatchRegistryTest(TestCase):
    def setUp(self):
        super().setUp()
        self.mod = _fake_module()
        self.addCleanup(sys.modules.pop, _FAKE, None)

    def test_apply_undo_identity_and_reapply(self):
        orig_step = self.mod.Runtime.__dict__["step"]
        orig_helper = self.mod.helper
        reg = _PatchRegistry(
            [
                Patch(
                    "step",
                    (
                        Target(
                            _FAKE,
                            "Runtime.step",
                            lambda orig: lambda self: ("new", orig(self)),
                        ),
                    ),
                    _needed,
                ),
                Patch(
                    "helper",
                    (Target(_FAKE, "helper", lambda orig: lambda: "new"),),
                    _needed,
                ),
                Patch(
                    "added",
                    (Target(_FAKE, "Runtime.extra", lambda orig: orig),),
                    _needed,
                ),
            ]
        )
        reg.apply_all({})
        self.assertEqual(self.mod.Runtime().step(), ("new", "orig"))
        self.assertEqual(self.mod.helper(), "new")
        self.assertIn("extra", vars(self.mod.Runtime))
        self.assertIsNone(
            self.mod.Runtime.extra
        )  # make() got None: attribute did not exist
        self.assertTrue(all(r.status is PatchStatus.APPLIED for r in reg.report()))

        reg.undo_all()
        self.assertIs(self.mod.Runtime.__dict__["step"], orig_step)
        self.assertIs(self.mod.helper, orig_helper)
        self.assertNotIn("extra", vars(self.mod.Runtime))
        self.assertTrue(all(r.status is PatchStatus.NOT_APPLIED for r in reg.report()))

        reg.apply_all({})
        self.assertEqual(self.mod.helper(), "new")
        reg.undo_all()
        self.assertIs(self.mod.helper, orig_helper)

    def test_idempotent(self):
        calls = []

        def make(orig):
            calls.append(orig)
            return lambda: "new"

        reg = _PatchRegistry(
            [Patch("helper", (Target(_FAKE, "helper", make),), _needed)]
        )
        first = reg.apply_all({})
        installed = self.mod.helper
        second = reg.apply_all({})
        self.assertEqual(len(calls), 1)
        self.assertIs(self.mod.helper, installed)
        self.assertEqual(first, second)

    def test_inherited_attribute_restored_by_deletion(self):
        class Child(self.mod.Runtime):
            pass

        self.mod.Child = Child
        reg = _PatchRegistry(
            [
                Patch(
                    "child",
                    (Target(_FAKE, "Child.step", lambda orig: lambda s: "child"),),
                    _needed,
                )
            ]
        )
        reg.apply_all({})
        self.assertEqual(Child().step(), "child")
        reg.undo_all()
        self.assertNotIn("step", vars(Child))
        self.assertEqual(Child().step(), "orig")

    def test_mapping_owner(self):
        self.mod.table = {}
        reg = _PatchRegistry(
            [Patch("entry", (Target(_FAKE, "table.key", lambda orig: 42),), _needed)]
        )
        reg.apply_all({})
        self.assertEqual(self.mod.table, {"key": 42})
        reg.undo_all()
        self.assertEqual(self.mod.table, {})

    def test_statuses_and_reasons(self):
        def upstream():
            return AlreadyUpstream, "torch has it"

        def broken():
            raise AttributeError("no such internal")

        reg = _PatchRegistry(
            [
                Patch("up", (Target(_FAKE, "helper", lambda o: None),), upstream),
                Patch("broken", (Target(_FAKE, "helper", lambda o: None),), broken),
                Patch(
                    "dep",
                    (Target(_FAKE, "helper", lambda o: None),),
                    _needed,
                    requires=("broken",),
                ),
                Patch(
                    "off",
                    (Target(_FAKE, "helper", lambda o: None),),
                    _needed,
                    env_disable="TPE_OFF",
                ),
            ]
        )
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            report = {r.name: r for r in reg.apply_all({"TPE_OFF": "1"})}
        self.assertEqual(report["up"].status, PatchStatus.UPSTREAM)
        self.assertEqual(report["up"].reason, "torch has it")
        self.assertEqual(report["broken"].status, PatchStatus.SKIPPED)
        self.assertIn("no such internal", report["broken"].reason)
        self.assertEqual(report["dep"].status, PatchStatus.SKIPPED)
        self.assertIn("broken", report["dep"].reason)
        self.assertEqual(report["off"].status, PatchStatus.DISABLED)
        self.assertEqual(report["off"].targets, (f"{_FAKE}.helper",))
        # One warning names everything that was skipped or failed, and nothing was touched.
        ours = [x for x in w if "torch_pipelining_ext" in str(x.message)]
        self.assertEqual(len(ours), 1)
        self.assertIn("broken", str(ours[0].message))
        self.assertIn("dep", str(ours[0].message))
        self.assertEqual(self.mod.helper(), "orig")

    def test_failed_apply_rolls_back(self):
        orig_helper = self.mod.helper
        orig_step = self.mod.Runtime.__dict__["step"]

        def boom(orig):
            raise RuntimeError("cannot build replacement")

        reg = _PatchRegistry(
            [
                Patch(
                    "half",
                    (
                        Target(_FAKE, "helper", lambda o: lambda: "new"),
                        Target(_FAKE, "Runtime.step", boom),
                    ),
                    _needed,
                )
            ]
        )
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            (rec,) = reg.apply_all({})
        self.assertEqual(rec.status, PatchStatus.FAILED)
        self.assertIn("cannot build replacement", rec.reason)
        self.assertIs(self.mod.helper, orig_helper)
        self.assertIs(self.mod.Runtime.__dict__["step"], orig_step)
        self.assertEqual(len([x for x in w if "half" in str(x.message)]), 1)

    def test_concurrent_apply_applies_once(self):
        calls = []
        gate = threading.Barrier(8)

        def make(orig):
            calls.append(orig)
            return lambda: "new"

        reg = _PatchRegistry(
            [Patch("helper", (Target(_FAKE, "helper", make),), _needed)]
        )

        def worker():
            gate.wait(timeout=30)
            reg.apply_all({})

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        self.assertEqual(len(calls), 1)
        self.assertEqual(self.mod.helper(), "new")

    def test_duplicate_names_rejected(self):
        p = Patch("same", (Target(_FAKE, "helper", lambda o: o),), _needed)
        with self.assertRaisesRegex(ValueError, "duplicate"):
            _PatchRegistry([p, Patch("same", p.targets, _needed)])


class PackagePatchTest(TestCase):
    """The real patch table, in this process and in fresh interpreters."""

    def test_table_entries_resolve(self):
        from torch_pipelining_ext._patching import _probes, _table

        features = json.loads(_table._TABLE.read_text())["features"]
        seen: list[str] = []
        for entry in (e for f in features for e in f["patches"]):
            name = entry["name"]
            self.assertTrue(callable(getattr(_probes, entry["probe"])), name)
            self.assertTrue(entry["description"] and entry["upstream"], name)
            # a patch requires only patches applied before it
            self.assertLessEqual(set(entry.get("requires", ())), set(seen), name)
            self.assertTrue(
                entry.get("env_disable", "TORCH_PIPELINING_EXT_").startswith(
                    "TORCH_PIPELINING_EXT_"
                ),
                name,
            )
            for t in entry["targets"]:
                (kind,) = (k for k in _table._KINDS if k in t)
                self.assertIsNotNone(_table._obj(t[kind]), f"{name}: {t[kind]}")
            if "cleanup" in entry:
                self.assertTrue(callable(_table._obj(entry["cleanup"])), name)
            seen.append(name)
        self.assertEqual(seen, [p.name for p in _REGISTRY.patches()])

    def test_custom_function_seam_is_in_the_table(self):
        # Every method the runtime's Protocols declare is a target of the
        # patch table, on the class torch has it on.
        from torch_pipelining_ext import runtime
        from torch_pipelining_ext._patching import _table

        features = json.loads(_table._TABLE.read_text())["features"]
        targets = {
            (t["module"], t["attr"])
            for f in features
            for e in f["patches"]
            for t in e["targets"]
        }
        owners = {
            runtime.CustomFunctionRuntime: (
                "torch.distributed.pipelining.schedules",
                "_PipelineScheduleRuntime",
            ),
            runtime.CustomFunctionStage: (
                "torch.distributed.pipelining.stage",
                "_PipelineStageBase",
            ),
        }
        for protocol, (module, cls) in owners.items():
            methods = sorted(
                n
                for n, v in vars(protocol).items()
                if callable(v) and not n.startswith("__")
            )
            self.assertGreater(len(methods), 0)
            for method in methods:
                self.assertIn((module, f"{cls}.{method}"), targets, method)

    def test_table_target_needs_one_replacement(self):
        from torch_pipelining_ext._patching import _table

        target = {"module": "torch", "attr": "x", "install": "a:b", "wrap": "c:d"}
        table = {
            "features": [
                {"patches": [{"name": "p", "probe": "q", "targets": [target]}]}
            ]
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "patches.json")
            with open(path, "w") as f:
                json.dump(table, f)
            with self.assertRaisesRegex(ValueError, r"torch\.x needs exactly one of"):
                _table._patches(_table.Path(path))

    def test_report_contents(self):
        allowed = {s.value for s in PatchStatus}
        report = torch_pipelining_ext.patch_report()
        self.assertEqual(
            [r.name for r in report], [p.name for p in _REGISTRY.patches()]
        )
        for rec in report:
            self.assertIn(rec.status.value, allowed)
            self.assertTrue(rec.reason, f"{rec.name} has no reason")
            self.assertTrue(rec.targets, f"{rec.name} names no target")
            self.assertEqual(
                set(rec.as_dict()), {"name", "status", "reason", "targets"}
            )

    def test_repatch_is_idempotent_and_unpatch_restores(self):
        before = torch_pipelining_ext.patch_report()
        self.addCleanup(torch_pipelining_ext.patch)
        installed = {
            t.qualname: t._get() for p in _REGISTRY.patches() for t in p.targets
        }
        self.assertEqual(torch_pipelining_ext.patch(), before)
        self.assertEqual(
            {t.qualname: t._get() for p in _REGISTRY.patches() for t in p.targets},
            installed,
        )
        torch_pipelining_ext.unpatch()
        self.assertTrue(
            all(
                r.status is PatchStatus.NOT_APPLIED
                for r in torch_pipelining_ext.patch_report()
            )
        )
        after = torch_pipelining_ext.patch()
        self.assertEqual(
            [(r.name, r.status) for r in after], [(r.name, r.status) for r in before]
        )

    def test_unpatch_restores_identity_in_fresh_process(self):
        # (with TORCH_PIPELINING_EXT_DISABLE=1 the import patched nothing)
        out = _run_python(
            """
            import json
            import torch.distributed.pipelining  # noqa: F401
            import torch_pipelining_ext
            from torch_pipelining_ext._patching._table import _REGISTRY
            disabled = [r.as_dict()["status"] for r in torch_pipelining_ext.patch_report()]
            targets = [t for p in _REGISTRY.patches() for t in p.targets]
            pristine = {t.qualname: t._get() for t in targets}
            report = torch_pipelining_ext.patch()
            changed = [t.qualname for t in targets if t._get() is not pristine[t.qualname]]
            applied = [r.name for r in report if r.status.value == "applied"]
            torch_pipelining_ext.unpatch()
            not_restored = [t.qualname for t in targets if t._get() is not pristine[t.qualname]]
            torch_pipelining_ext.patch()
            torch_pipelining_ext.unpatch()
            not_restored_twice = [t.qualname for t in targets if t._get() is not pristine[t.qualname]]
            print(json.dumps(dict(applied=applied, changed=changed, not_restored=not_restored,
                                  not_restored_twice=not_restored_twice, disabled=disabled)))
            """,
            {"TORCH_PIPELINING_EXT_DISABLE": "1"},
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(set(res["disabled"]) - {"not applied"}, set())
        self.assertEqual(res["not_restored"], [])
        self.assertEqual(res["not_restored_twice"], [])
        # every applied patch really changed its targets
        applied_targets = {
            t.qualname
            for p in _REGISTRY.patches()
            if p.name in res["applied"]
            for t in p.targets
        }
        self.assertEqual(applied_targets, set(res["changed"]))

    def test_unrecognised_torch_never_breaks_import(self):
        # Simulate a refactored torch: the runtime class the probes inspect is
        # replaced by one with none of the expected internals.
        out = _run_python(
            """
            import json, warnings
            import torch.distributed.pipelining.schedules as S
            S._PipelineScheduleRuntime = type("_PipelineScheduleRuntime", (S.PipelineScheduleMulti,), {})
            broken = S._PipelineScheduleRuntime
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                import torch_pipelining_ext
            from torch_pipelining_ext._patching._table import _REGISTRY
            report = torch_pipelining_ext.patch_report()
            not_applied = {r.name for r in report if r.status.value in ("skipped", "failed")}
            half = [t.qualname for p in _REGISTRY.patches() if p.name in not_applied
                    for t in p.targets if t.module.endswith("schedules") and
                    t.attr.startswith("_PipelineScheduleRuntime.") and
                    t.attr.split(".")[1] in vars(broken)]
            msgs = [str(x.message) for x in w if "torch_pipelining_ext" in str(x.message)]
            # strict mode (read from the environment, as at import) refuses it
            import os
            os.environ["TORCH_PIPELINING_EXT_STRICT"] = "1"
            try:
                torch_pipelining_ext.patch()
                strict = None
            except torch_pipelining_ext.PatchError as e:
                strict = str(e)
            statuses = sorted({r.status.value for r in torch_pipelining_ext.patch_report()})
            print(json.dumps(dict(not_applied=sorted(not_applied), half=half, msgs=msgs,
                                  strict=strict, after_strict=statuses)))
            """
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertGreater(
            len(res["not_applied"]), 0, "no probe noticed the refactored runtime"
        )
        self.assertEqual(res["half"], [])
        self.assertEqual(len(res["msgs"]), 1, res["msgs"])
        for name in res["not_applied"]:
            self.assertIn(name, res["msgs"][0])
        # strict: PatchError with the whole table, and every patch undone
        self.assertIsNotNone(res["strict"])
        for rec in _REGISTRY.patches():
            self.assertIn(rec.name, res["strict"])
        self.assertIn("skipped", res["strict"])
        self.assertEqual(res["after_strict"], [PatchStatus.NOT_APPLIED.value])

    def test_strict_refuses_an_untested_release(self):
        before = {r.name: r.status for r in torch_pipelining_ext.patch_report()}
        self.addCleanup(torch_pipelining_ext.patch)
        for version in ("2.8.0", "2.16.0.dev20261201+cu130"):
            with (
                self.subTest(version=version),
                mock.patch.object(torch, "__version__", version),
            ):
                with self.assertRaisesRegex(
                    torch_pipelining_ext.PatchError,
                    rf"torch {re.escape(version)} is outside the tested releases \(2\.9 - 2\.15\)",
                ):
                    torch_pipelining_ext.patch(strict=True)
                self.assertEqual(
                    {r.status for r in torch_pipelining_ext.patch_report()},
                    {PatchStatus.NOT_APPLIED},
                )
                # not strict: one warning, the patches applied as before
                with self.assertWarnsRegex(RuntimeWarning, "outside the tested"):
                    report = torch_pipelining_ext.patch()
                self.assertEqual({r.name: r.status for r in report}, before)

    def test_status_pinned_per_torch_minor(self):
        # A fresh interpreter in strict mode, RuntimeWarnings as errors: importing
        # the package is quiet (no patch skipped or failed, a tested release) and
        # every patch has its pinned status.
        minor = ".".join(torch.__version__.split(".")[:2])
        expected = _pinned_status(minor)
        self.assertIsNotNone(
            expected,
            f"torch {torch.__version__} is not in _PINNED_STATUS; add its column",
        )
        out = _run_python(
            """
            import json
            import torch_pipelining_ext
            print(json.dumps({r.name: r.status.value for r in torch_pipelining_ext.patch_report()}))
            """,
            {"TORCH_PIPELINING_EXT_STRICT": "1"},
            flags=("-W", "error::RuntimeWarning"),
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(
            set(report),
            {row.split()[0] for row in _PINNED_STATUS.strip().splitlines()[1:]},
        )
        self.assertEqual({name: report[name] for name in expected}, expected)

    def test_cli_report(self):
        out = subprocess.run(
            [sys.executable, "-m", "torch_pipelining_ext", "--strict"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(
            f"torch_pipelining_ext {torch_pipelining_ext.__version__}", out.stdout
        )
        self.assertIn(torch.__version__, out.stdout)
        self.assertIn("gloo=", out.stdout)
        self.assertIn("this release is one of them", out.stdout)  # --strict passed
        for rec in torch_pipelining_ext.patch_report():
            self.assertIn(rec.name, out.stdout)
        # --json, in this process (as -m runs it)
        buffer = io.StringIO()
        with (
            mock.patch.object(sys, "argv", ["torch_pipelining_ext", "--json"]),
            contextlib.redirect_stdout(buffer),
        ):
            try:
                runpy.run_module("torch_pipelining_ext", run_name="__main__")
            except SystemExit as e:
                self.assertIn(e.code, (None, 0))
        self.assertEqual(
            [p["name"] for p in json.loads(buffer.getvalue())["patches"]],
            [r.name for r in torch_pipelining_ext.patch_report()],
        )


if __name__ == "__main__":
    run_tests()
