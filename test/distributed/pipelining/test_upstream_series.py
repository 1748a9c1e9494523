# Owner(s): ["oncall: distributed"]
"""The upstream patch series (``tools/upstream/``) is current, keeps its rules, applies.

``make_series.py`` regenerates every ``patch.diff`` from the package's
sources; these tests regenerate the series into memory and compare it with the
committed patches byte for byte, check the rules every patch keeps (a
``Depends on:`` line; every ``[Note: ...]`` it refers to defined by torch, the
patch or one it depends on; the width of the lines it adds), then apply the
committed patches in order to a copy of torch 2.15.0's files without fuzz.
Edits of torch's own files need torch 2.15's sources, so with another torch
installed only the test hunks are checked. The fixes' test hunks must apply to upstream's own test
files (``tools/upstream/pytorch_tests``) without fuzz, on their dependencies
and in series order. On 2.15, ``check.sh --quick`` runs one fix's tests with
``$CI`` set, as CI services run it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from torch.testing._internal.common_utils import run_tests, TestCase


_TOOLS = Path(__file__).resolve().parents[3] / "tools" / "upstream"
_IS_2_15 = torch.__version__.startswith("2.15.")
_NOT_2_15 = f"needs torch 2.15.x, the series' base (this is {torch.__version__})"


def _load_make_series():
    spec = importlib.util.spec_from_file_location(
        "make_series", _TOOLS / "make_series.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_series", module)
    spec.loader.exec_module(module)
    return module


make_series = _load_make_series()


class UpstreamSeriesTest(TestCase):
    def _committed(self, name: str) -> str:
        return (_TOOLS / name / "patch.diff").read_text()

    @unittest.skipUnless(_IS_2_15, _NOT_2_15)
    def test_patches_are_current(self) -> None:
        self._assert_current()

    @unittest.skipUnless(_IS_2_15, _NOT_2_15)
    def test_generation_ignores_a_repository_around_the_scratch_directory(self) -> None:
        # git apply inside a work tree takes paths as relative to its top and
        # skips, without an error, those outside its directory
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "init", "-q", tmp], check=True)
            scratch = Path(tmp) / "scratch"
            scratch.mkdir()
            saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
            try:
                self._assert_current()
            finally:
                tempfile.tempdir = saved

    @unittest.skipUnless(_IS_2_15, _NOT_2_15)
    def test_check_script_passes_where_ci_is_set(self) -> None:
        # CI services set $CI; torch's run_tests() then writes XML reports
        # through xmlrunner, which a test environment need not have
        if shutil.which("patch") is None:
            self.skipTest("check.sh needs the patch tool")
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run(
                ["bash", str(_TOOLS / "check.sh"), "--quick", "0007"],
                env={
                    **os.environ,
                    "CI": "true",
                    "UPSTREAM_TORCH_PYTHON": sys.executable,
                    "UPSTREAM_CHECK_DIR": tmp,
                },
                capture_output=True,
                text=True,
                timeout=900,
            )
        self.assertEqual(done.returncode, 0, done.stdout[-4000:] + done.stderr[-2000:])
        self.assertRegex(
            done.stdout, r"(?m)^0007-1f1b-pipeline-order-last-rank .* PASS"
        )

    def _assert_current(self) -> None:
        generated = make_series.generate(make_series.torch_base(None))
        self.assertEqual(sorted(generated), sorted(p.name for p in make_series.SERIES))
        for name, text in generated.items():
            committed = self._committed(name)
            # assertTrue, not assertEqual: a diff of diffs helps nobody; the command does
            self.assertTrue(
                text == committed,
                f"{name}/patch.diff is not what the package generates: run python tools/upstream/make_series.py",
            )

    @unittest.skipUnless(_IS_2_15, _NOT_2_15)
    def test_rules(self) -> None:
        base = make_series.torch_base(None)
        problems = make_series.check_rules(make_series.generate(base), base)
        self.assertEqual(problems, [], "\n".join(problems))

    def test_test_hunks_apply(self) -> None:
        """The patches' test hunks apply to upstream's test files (no torch needed)."""
        problems = make_series.test_hunk_problems()
        self.assertEqual(problems, [], "\n".join(problems))

    def test_retired_numbers_name_no_patch(self) -> None:
        numbers = {int(p.name[:4]) for p in make_series.SERIES}
        self.assertFalse(numbers & make_series.RETIRED_NUMBERS)
        self.assertEqual(
            [p.name for p in make_series.SERIES if p.name[5:] == "stage-split"], []
        )

    def test_series_applies_to_torch_2_15_without_fuzz(self) -> None:
        if not _IS_2_15:
            self.skipTest(_NOT_2_15)
        site = Path(torch.__file__).parent.parent
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            target = root / make_series.PIPELINING
            shutil.copytree(
                site / make_series.PIPELINING,
                target,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            for path in make_series.BASE_FILES:
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(site / path, root / path)
            for patch in make_series.SERIES:
                diff = str(patch.dir / "patch.diff")
                if not Path(diff).read_text():
                    continue  # a patch of tests only
                done = subprocess.run(
                    ["git", "apply", "--check", diff],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    env=make_series._git_env(root),
                )
                self.assertEqual(
                    done.returncode, 0, f"{patch.name} does not apply: {done.stderr}"
                )
                if shutil.which("patch"):
                    done = subprocess.run(
                        ["patch", "-p1", "--fuzz=0", "--dry-run", "-i", diff],
                        cwd=root,
                        capture_output=True,
                        text=True,
                    )
                    self.assertEqual(
                        done.returncode,
                        0,
                        f"{patch.name}: patch --fuzz=0 refuses it: {done.stdout}",
                    )
                subprocess.run(
                    ["git", "apply", diff],
                    cwd=root,
                    check=True,
                    env=make_series._git_env(root),
                )
            for path in [
                f"{make_series.PIPELINING}/schedules.py",
                f"{make_series.PIPELINING}/stage.py",
                *make_series.BASE_FILES,
            ]:
                compile((root / path).read_text(), path, "exec")

    def test_package_cites_only_patches_of_the_series(self) -> None:
        """Every patch number the package, the docs or the series' texts cite is in it.

        A re-cut renumbers the series (``make_series.py --renumber`` rewrites
        the numbers of the patches it moves, in the Markdown of
        ``tools/upstream`` only); a number of a patch that was dropped, or one
        left behind in the package, would send a reader to another patch or
        to none.
        """
        numbers = {p.name[:4] for p in make_series.SERIES}
        repo = make_series.REPO
        files = [
            *sorted(make_series.PACKAGE.rglob("*.py")),
            *sorted(make_series.PACKAGE.rglob("*.json")),
            repo / "README.md",
            repo / "CONTRIBUTING.md",
            *sorted(make_series.HERE.rglob("*.md")),
            *sorted(make_series.HERE.glob("*.py")),
            *sorted(make_series.HERE.glob("*.sh")),
        ]
        cited = re.compile(r"(?<![\w.])0\d{3}(?![\w.])")
        stale = [
            f"{path.relative_to(repo)}:{n}: {number}"
            for path in files
            for n, line in enumerate(path.read_text().splitlines(), start=1)
            for number in cited.findall(line)
            if number not in numbers
        ]
        self.assertEqual(stale, [], "patch numbers the series does not have")

    def test_newest_upstream_names_every_file_the_series_touches(self) -> None:
        rows = _load_check_newest().report(Path(tempfile.mkdtemp()))
        self.assertEqual(
            [row for row in rows if "SOURCES" in row[2]], [], "paths with no version"
        )
        self.assertTrue(rows)
        self.assertTrue(
            all(
                re.fullmatch(r"[0-9a-f]{40}", c)
                for c in _load_check_newest().sources().values()
            )
        )

    @unittest.skipUnless(_IS_2_15, _NOT_2_15)
    def test_newest_upstream_check_passes_on_the_base(self) -> None:
        """With 2.15.0's own files as the newest versions, every patch applies."""
        check_newest = _load_check_newest()
        site = Path(torch.__file__).parent.parent
        with tempfile.TemporaryDirectory() as tmp:
            for path in check_newest.sources():
                if (site / path).exists():
                    (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(site / path, Path(tmp) / path)
            verdicts = {
                (name, path): v for name, path, v in check_newest.report(Path(tmp))
            }
        self.assertEqual(set(verdicts.values()), {"applies"}, verdicts)


def _load_check_newest():
    sys.path.insert(0, str(_TOOLS))
    try:
        import check_newest
    finally:
        sys.path.remove(str(_TOOLS))
    return check_newest


if __name__ == "__main__":
    run_tests()
