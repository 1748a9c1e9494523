"""Regenerate the upstream patch series from the package's sources.

    python tools/upstream/make_series.py            # rewrite every NNNN-*/patch.diff
    python tools/upstream/make_series.py --check    # compare instead; exit 1 if any differs
    python tools/upstream/make_series.py --torch-dir DIR   # DIR/torch/distributed/pipelining is 2.15.0's

The base is torch 2.15.0's ``torch/distributed/pipelining/`` (by default the
installed torch's, which must then be 2.15.x).  Each patch of :data:`SERIES`
is made of parts, applied in order on top of the previous patches:

* :class:`NewModule` -- a new upstream file that is a package module, copied
  under :func:`upstream_source` (the one fixed rule: module and environment
  names);
* :class:`SpliceFunction` -- a whole package function, copied under the same
  rule, added to an upstream file after a named top-level definition (one
  algorithm for the package and the PR);
* :class:`HandWritten` -- hunks written for upstream, kept in the patch's
  directory, for changes the package makes by wrapping torch instead of
  editing it (the package's wrapper and the upstream edit are tested against
  each other by ``check.sh``, not derived from each other).

``patch.diff`` is the difference of the result from the previous patch's, as
``git diff`` prints it; it applies with
``git apply`` / ``patch -p1 --fuzz=0``.  New modules and spliced functions
need no torch file to be produced; hand-written hunks and the diffs of edited
files do, so ``--check`` without torch 2.15.0 compares the new files only
(``--new-files-only``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACKAGE = REPO / "torch_pipelining_ext"
PIPELINING = "torch/distributed/pipelining"
TORCH_VERSION = "2.15"


# --------------------------------------------------------------------------- #
# The rule: package module -> upstream source                                  #
# --------------------------------------------------------------------------- #

# A package module that the series proposes is written as it lands upstream;
# it is copied, with only these names changed:
#   the package modules below become the upstream modules of
#   torch/distributed/pipelining (in imports: relative imports);
#   TORCH_PIPELINING_EXT_ environment variables become TORCH_PIPELINING_;
#   the module docstring's paragraph that starts with "Upstream file" or
#   "Upstream target" (where the code goes) is dropped.
# Nothing may be left that names the package.
UPSTREAM_MODULES = (
    ("torch_pipelining_ext.overlap._handler", "_overlap"),
    ("torch_pipelining_ext.overlap._marks", "_ep_marks"),
    ("torch_pipelining_ext.overlap._turns", "_ep_turns"),
    ("torch_pipelining_ext.overlap._rng", "_ep_rng"),
    ("torch_pipelining_ext.overlap._policy", "_ep_policy"),
    ("torch_pipelining_ext.overlap", "ep_overlap"),
)
ENV_PREFIXES = ("TORCH_PIPELINING_EXT_", "TORCH_PIPELINING_")
_UPSTREAM = dict(UPSTREAM_MODULES)
_LEFTOVERS = re.compile(r"torch_pipelining_ext|TORCH_PIPELINING_EXT")
_FROM_IMPORT = re.compile(
    r"^(\s*)from (torch_pipelining_ext[\w.]*) import (.+)$", re.MULTILINE
)


def _relative_import(match: re.Match[str]) -> str:
    indent, module, names = match.groups()
    # ``from <package> import <module> as <alias>``: one module of the mapping
    child, _, alias = names.partition(" as ")
    upstream = _UPSTREAM.get(f"{module}.{child.strip()}")
    if upstream is not None:
        alias = alias.strip() or child.strip()  # the name the module's code uses
        return f"{indent}from . import {upstream}" + (
            f" as {alias}" if alias != upstream else ""
        )
    if module in _UPSTREAM:
        return f"{indent}from .{_UPSTREAM[module]} import {names}"
    return match.group(0)  # left for the leftover check


def _upstream_names(text: str) -> str:
    text = _FROM_IMPORT.sub(_relative_import, text)
    for module, upstream in UPSTREAM_MODULES:  # longest first
        text = re.sub(
            rf"\b{re.escape(module)}\b",
            f"torch.distributed.pipelining.{upstream}",
            text,
        )
    return text.replace(*ENV_PREFIXES)


def _drop_upstream_paragraph(text: str) -> str:
    """Drop the module docstring's paragraph that says where the code goes upstream."""
    tree = ast.parse(text)
    if not (
        tree.body
        and isinstance(tree.body[0], ast.Expr)
        and isinstance(tree.body[0].value, ast.Constant)
    ):
        return text
    doc = tree.body[0]
    lines = text.splitlines(keepends=True)
    start, end = doc.lineno - 1, doc.end_lineno
    part = "".join(lines[start:end])
    part = re.sub(
        r"\n\nUpstream (?:file|files|target)s?:.*?(?=\n\n|\n?\"\"\")",
        "",
        part,
        count=1,
        flags=re.DOTALL,
    )
    return "".join(lines[:start]) + part + "".join(lines[end:])


def upstream_source(
    text: str, where: str, substitute: tuple[tuple[str, str], ...] = ()
) -> str:
    """A package module's text as the upstream file (see the rule above).

    ``substitute`` lists exact substitutions, each of which must match once,
    for a docstring phrase that names a package-only module (keep it empty
    where possible).
    """
    text = _drop_upstream_paragraph(text)
    for old, new in substitute:
        if text.count(old) != 1:
            raise ValueError(
                f"{where}: substitution {old[:60]!r} matches {text.count(old)} times, expected once"
            )
        text = text.replace(old, new)
    text = _upstream_names(text)
    left = [
        f"{where}: {line.strip()}"
        for line in text.splitlines()
        if _LEFTOVERS.search(line)
    ]
    if left:
        raise ValueError(
            "the upstream file still names the package:\n" + "\n".join(left)
        )
    compile(text, where, "exec")
    return text


# --------------------------------------------------------------------------- #
# The series                                                                   #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class NewModule:
    """``target`` (a new file under torch/distributed/pipelining) is package module ``module``."""

    target: str
    module: str
    substitute: tuple[tuple[str, str], ...] = ()

    def source(self) -> str:
        return upstream_source(
            (PACKAGE / self.module).read_text(), self.module, self.substitute
        )


@dataclasses.dataclass(frozen=True)
class SpliceFunction:
    """Package function ``module:function`` is added to ``target`` after its top-level ``after``.

    ``alias`` is the name under which the package module refers to the
    target module (``_schedules`` for ``schedules.py``): ``alias.name`` becomes
    ``name``.
    """

    target: str
    module: str
    function: str
    after: str
    alias: str = ""

    def source(self) -> str:
        text = (PACKAGE / self.module).read_text()
        tree = ast.parse(text)
        nodes = [
            n
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name == self.function
        ]
        if len(nodes) != 1:
            raise ValueError(f"{self.module}: expected one function {self.function!r}")
        node = nodes[0]
        lines = text.splitlines(keepends=True)
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        text = upstream_source(
            "".join(lines[start : node.end_lineno]), f"{self.module}:{self.function}"
        )
        return re.sub(rf"\b{self.alias}\.", "", text) if self.alias else text

    def apply(self, files: dict[str, str]) -> None:
        text = files[self.target]
        tree = ast.parse(text)
        nodes = [n for n in tree.body if getattr(n, "name", None) == self.after]
        if len(nodes) != 1:
            raise ValueError(f"{self.target}: expected one top-level {self.after!r}")
        lines = text.splitlines(keepends=True)
        end = nodes[0].end_lineno
        lines[end:end] = ["\n", "\n", *self.source().splitlines(keepends=True)]
        files[self.target] = "".join(lines)


@dataclasses.dataclass(frozen=True)
class HandWritten:
    """Hunks (``a/torch/...`` paths) kept as ``file`` in the patch's directory."""

    file: str


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    parts: tuple[NewModule | SpliceFunction | HandWritten, ...]

    @property
    def dir(self) -> Path:
        return HERE / self.name


def _overlap_modules() -> tuple[NewModule, ...]:
    return tuple(
        NewModule(target, module)
        for target, module in (
            ("_overlap.py", "overlap/_handler.py"),
            ("ep_overlap.py", "overlap/__init__.py"),
            ("_ep_marks.py", "overlap/_marks.py"),
            ("_ep_rng.py", "overlap/_rng.py"),
            ("_ep_turns.py", "overlap/_turns.py"),
            ("_ep_policy.py", "overlap/_policy.py"),
        )
    )


SERIES: tuple[Patch, ...] = (
    Patch("0001-fsdp-split-backward", (HandWritten("patch.diff"),)),
    Patch("0002-scale-grads-per-step", (HandWritten("patch.diff"),)),
    Patch("0003-pipeline-context-step-options", (HandWritten("patch.diff"),)),
    Patch("0004-step-error-names-rank", (HandWritten("patch.diff"),)),
    Patch(
        "0005-compute-comms-reduce-grad",
        (
            HandWritten("validate.diff"),
            SpliceFunction(
                "schedules.py",
                "_compute_comms.py",
                "_add_missing_reduce_grad",
                "_add_reduce_grad",
                "_schedules",
            ),
        ),
    ),
    Patch(
        "0006-stage-split",
        (NewModule("stage_split.py", "stage_split.py"),),
    ),
    Patch("0007-runtime-per-action-functions", (HandWritten("patch.diff"),)),
    Patch("0008-runtime-prepare-compute-action", (HandWritten("patch.diff"),)),
    Patch(
        "0009-overlap-f-b-ep-overlap",
        (*_overlap_modules(), HandWritten("schedules.diff")),
    ),
)


# --------------------------------------------------------------------------- #
# Making the diffs                                                             #
# --------------------------------------------------------------------------- #


def _read_tree(root: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((root / PIPELINING).glob("*.py"))}


def _apply_hunks(files: dict[str, str], diff: Path) -> None:
    """``git apply`` (no fuzz) of ``diff`` to ``files``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / PIPELINING).mkdir(parents=True)
        for name, text in files.items():
            (root / PIPELINING / name).write_text(text)
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(diff)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(
                f"{diff.relative_to(REPO)} does not apply: {done.stderr.strip()}"
            )
        files.clear()
        files.update(_read_tree(root))


_GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "LC_ALL": "C",
}


def _file_diff(name: str, old: str | None, new: str) -> str:
    """``git diff`` of one file (``a/torch/...`` and ``b/torch/...``, function names in hunk headers)."""
    path = f"{PIPELINING}/{name}"
    with tempfile.TemporaryDirectory() as tmp:
        for side, text in (("a", old), ("b", new)):
            if text is not None:
                (Path(tmp) / side / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / side / path).write_text(text)
        done = subprocess.run(
            [
                "git",
                "diff",
                "--no-index",
                "--no-prefix",
                "--no-color",
                "--no-ext-diff",
                "--diff-algorithm=myers",
                "/dev/null" if old is None else f"a/{path}",
                f"b/{path}",
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            env=_GIT_ENV,
        )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"git diff failed: {done.stderr.strip()}")
    if "\\ No newline at end of file" in done.stdout:
        raise ValueError(f"{name}: a file must end with a newline")
    # (against /dev/null, git names the new file twice on the first line)
    return done.stdout.replace(
        f"diff --git b/{path} b/{path}\n", f"diff --git a/{path} b/{path}\n", 1
    )


def patch_text(before: dict[str, str], after: dict[str, str]) -> str:
    names = sorted(n for n in after if before.get(n) != after[n])
    return "".join(_file_diff(n, before.get(n), after[n]) for n in names)


def generate(base: dict[str, str] | None) -> dict[str, str]:
    """patch name -> patch.diff text.

    With ``base=None`` (no torch 2.15 at hand): for each patch, only the
    sections of its new files (see :func:`new_file_sections`).
    """
    result: dict[str, str] = {}
    files = dict(base or {})
    for patch in SERIES:
        before = dict(files)
        for part in patch.parts:
            if isinstance(part, NewModule):
                if part.target in before:
                    raise ValueError(f"{patch.name}: {part.target} exists already")
                files[part.target] = part.source()
            elif base is None:
                continue
            elif isinstance(part, SpliceFunction):
                part.apply(files)
            else:
                _apply_hunks(files, patch.dir / part.file)
        result[patch.name] = patch_text(before, files)
    return result


def new_file_sections(text: str) -> str:
    """The sections of a patch that create files (they need no torch file to be made)."""
    sections = re.split(r"(?m)^(?=diff --git )", text)
    return "".join(s for s in sections if "\nnew file mode " in s[:300])


def torch_base(torch_dir: str | None) -> dict[str, str] | None:
    """torch 2.15's pipelining sources: from ``torch_dir``, else the installed torch if it is 2.15.x."""
    if torch_dir is not None:
        return _read_tree(Path(torch_dir))
    try:
        import torch
    except ImportError:
        return None
    if not torch.__version__.startswith(TORCH_VERSION + "."):
        return None
    return _read_tree(Path(torch.__file__).parent.parent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the committed patches, write nothing",
    )
    parser.add_argument(
        "--torch-dir",
        help="a directory holding torch/distributed/pipelining of torch 2.15.0",
    )
    parser.add_argument(
        "--new-files-only",
        action="store_true",
        help="check only the new files of each patch (no torch needed)",
    )
    args = parser.parse_args()
    base = None if args.new_files_only else torch_base(args.torch_dir)
    if base is None and not args.new_files_only:
        print(
            f"make_series: needs torch {TORCH_VERSION}.x (installed, or --torch-dir); or --new-files-only",
            file=sys.stderr,
        )
        return 2
    patches = generate(base)
    stale = []
    for name, text in patches.items():
        target = HERE / name / "patch.diff"
        committed = target.read_text() if target.exists() else None
        if base is None and committed is not None:
            committed = new_file_sections(committed)
        if args.check or base is None:
            if committed != text:
                stale.append(name)
        elif committed != text:
            target.write_text(text)
            print(f"wrote {target.relative_to(REPO)}")
    if stale:
        print(
            "stale (run python tools/upstream/make_series.py): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
