# Owner(s): ["oncall: distributed"]
"""The upstream bug reports (``tools/upstream/issues/``) are complete and reproduce on stock torch 2.15.

Every report directory holds a ``repro.py`` that imports only torch and the
standard library (checked on its syntax tree: the package must not be
imported, so that the script shows stock torch) and a ``REPORT.md`` with the
script's pasted output, expected and actual behaviour, ``collect_env``'s
version output, a "Fixed by" section and no word about the package; the
README lists every report.  Under torch 2.15.x each script also runs in a fresh interpreter,
which does not import the package (the test process does), and must exit 1
with its ``defect present:`` line: the defect is in stock 2.15.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


_ISSUES = Path(__file__).resolve().parents[3] / "tools" / "upstream" / "issues"
_REPORTS = sorted(p.name for p in _ISSUES.iterdir() if re.match(r"\d\d-", p.name))
_IS_2_15 = torch.__version__.startswith("2.15.")
_TIMEOUT_S = 180


def _imported_modules(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports (``""`` for a relative import)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("" if node.level else node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
        ):
            found.add("<importlib.import_module>")
        elif (
            isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__"
        ):
            found.add("<__import__>")
    return found


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


class UpstreamIssuesTest(TestCase):
    def test_reports_are_listed(self) -> None:
        self.assertGreaterEqual(len(_REPORTS), 5, f"no reports under {_ISSUES}")
        readme = (_ISSUES / "README.md").read_text()
        for name in _REPORTS:
            self.assertIn(f"({name}/REPORT.md)", readme, f"README.md lacks {name}")
        self.assertIn(
            "for d in tools/upstream/issues/*/; do python $d/repro.py", readme
        )

    @parametrize("name", _REPORTS)
    def test_repro_imports_only_torch_and_stdlib(self, name: str) -> None:
        source = (_ISSUES / name / "repro.py").read_text()
        allowed = set(sys.stdlib_module_names) | {"torch"}
        self.assertEqual(_imported_modules(source) - allowed, set())
        self.assertNotIn("torch_pipelining_ext", source)
        self.assertIn("torch.set_num_threads(1)", source)
        self.assertIn("defect present:", source)
        self.assertIn("defect absent:", source)

    @parametrize("name", _REPORTS)
    def test_report_pastes_output_and_names_the_fix(self, name: str) -> None:
        report = (_ISSUES / name / "REPORT.md").read_text()
        self.assertTrue(report.startswith("# [pipelining] "), "no issue title")
        self.assertIn("python repro.py", report)
        outputs = [
            block
            for block in _fenced_blocks(report)
            if "defect present:" in block and "torch 2.15.0" in block
        ]
        self.assertEqual(
            len(outputs), 1, "the output of a stock 2.15.0 run is not pasted"
        )
        for section in ("## Versions", "## Root cause (torch 2.15.0)"):
            self.assertIn(section, report)
        # an issue text for pytorch: versions as collect_env prints them, what
        # was expected and what happened, nothing about this package
        versions = report.partition("## Versions")[2].partition("\n## ")[0]
        self.assertIn("PyTorch version: 2.15.0", versions, "no collect_env output")
        self.assertRegex(report, r"(?m)^Expected: ")
        self.assertRegex(report, r"(?m)^(Actual: |Observed \(stock torch 2\.15\.0)")
        self.assertNotRegex(report, r"torch_pipelining_ext|\bthe package\b")
        fixed_by = report.partition("\n## Fixed by\n")[2].strip()
        self.assertTrue(fixed_by, "no Fixed by section")
        series = re.findall(r"`(\d{4}-[a-z0-9-]+)`", fixed_by)
        for directory in series:
            self.assertTrue(
                (_ISSUES.parent / directory / "PR.md").is_file(),
                f"Fixed by names {directory}, which is not a PR of the series",
            )
        if not series:
            self.assertIn("No PR of this series fixes it", fixed_by)

    @parametrize("name", _REPORTS)
    def test_repro_shows_the_defect_on_stock_torch_2_15(self, name: str) -> None:
        if not _IS_2_15:
            self.skipTest(
                f"the reports are about stock torch 2.15 (this is {torch.__version__})"
            )
        done = subprocess.run(
            [sys.executable, str(_ISSUES / name / "repro.py")],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            cwd=_ISSUES / name,
        )
        detail = f"stdout:\n{done.stdout}\nstderr (end):\n{done.stderr[-3000:]}"
        self.assertIn("defect present:", done.stdout, detail)
        self.assertEqual(done.returncode, 1, detail)


instantiate_parametrized_tests(UpstreamIssuesTest)


if __name__ == "__main__":
    run_tests()
