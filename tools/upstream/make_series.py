"""Regenerate the upstream patch series from the package's sources.

    python tools/upstream/make_series.py            # rewrite every NNNN-*/patch.diff
    python tools/upstream/make_series.py --check    # compare instead; exit 1 if any differs
    python tools/upstream/make_series.py --torch-dir DIR   # DIR/torch is 2.15.0's

The base is torch 2.15.0's ``torch/distributed/pipelining/`` and the few other
torch files a patch edits (:data:`BASE_FILES`), by default the installed
torch's (which must then be 2.15.x).  Each patch of :data:`SERIES` is
:class:`HandWritten` hunks of torch's own files, kept in the patch's
directory, for changes the package makes by wrapping torch instead of
editing it (the package's wrapper and the upstream edit are tested against
each other by ``check.sh``, not derived from each other), applied in order on
top of the previous patches.

``patch.diff`` is the difference of the result from the previous patch's, as
``git diff`` prints it (so its line numbers follow the earlier patches); it
applies with ``git apply`` / ``patch -p1 --fuzz=0``.

Each patch's ``PR.md`` declares ``Depends on:`` (patch numbers, or
``none``); :func:`check_rules` checks that every ``[Note: ...]`` a patch
refers to is defined by torch, the patch or one it depends on, and that the
lines it adds fit torch's line width.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
# torch files outside PIPELINING that a patch edits
BASE_FILES = ("torch/random.py", "torch/utils/checkpoint.py")
TORCH_VERSION = "2.15"
LINE_WIDTH = 88  # torch's pyproject.toml: [tool.ruff] line-length
# --------------------------------------------------------------------------- #
# The series                                                                   #
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class HandWritten:
    """Hunks (``a/torch/...`` paths) of torch's own files, kept as ``file`` in the patch's directory."""

    file: str


@dataclasses.dataclass(frozen=True)
class Patch:
    """One PR of the series: ``NNNN-slug/`` with its ``PR.md`` and ``patch.diff``.

    ``tests``: the file of the patch's directory holding its test hunks
    (``a/test/...`` paths: :func:`torch_test_path`), applied to upstream's own
    test files (:data:`TORCH_TESTS`, unchanged copies) together with those of
    the patches it depends on; ``None`` for a patch with no test of its own
    (a refactor: upstream's tests before and after).
    """

    name: str
    parts: tuple[HandWritten, ...] = ()
    tests: str | None = None

    @property
    def dir(self) -> Path:
        return HERE / self.name


def _fix(slug: str) -> Patch:
    """A fix: hand-written hunks of torch's files, tests inside upstream's test files."""
    return Patch(slug, (HandWritten("patch.diff"),), tests="test.diff")


# Fixes upstream can take one PR at a time, each on its declared dependencies.
FIXES: tuple[Patch, ...] = (
    _fix("fsdp-split-backward"),
    _fix("eval-leaves-gradients"),
    _fix("scale-grads-scales-loss"),
    _fix("pipeline-context-step-options"),
    _fix("step-error-names-rank"),
    _fix("compute-comms-reduce-grad"),
    _fix("1f1b-pipeline-order-last-rank"),
    _fix("eval-adjacent-local-stages"),
)

# Proposals: the runtime refactor in two PRs, the extraction (no test of its
# own: upstream's tests before and after) and the custom-function API (tests
# inside upstream's test files, like a fix's).
PROPOSALS: tuple[Patch, ...] = (
    Patch("runtime-action-methods", (HandWritten("patch.diff"),)),
    Patch(
        "runtime-custom-function-api", (HandWritten("patch.diff"),), tests="test.diff"
    ),
)

# Fixes that came after the proposals, numbered after them (the reviews cite
# the earlier numbers): selective checkpointing under a split backward, in
# torch/utils/checkpoint.py, tested in upstream's test/test_utils.py; the
# weight pass's parameter groups under one recompute per checkpointed region.
LATER_FIXES: tuple[Patch, ...] = (
    _fix("checkpoint-split-backward"),
    _fix("weight-pass-one-recompute"),
)


# Numbers no patch holds: 9, the stage_split module, left the series for a
# proposal to torchtitan (stage-split-torchtitan-proposal.md); the patches
# after it keep the numbers their reviews cite.
RETIRED_NUMBERS = frozenset({9})


def _numbered(patches: tuple[Patch, ...]) -> tuple[Patch, ...]:
    """``patches`` named ``NNNN-slug`` by their place, from 0001, skipping
    :data:`RETIRED_NUMBERS` (see :func:`renumber`)."""
    numbers = (i for i in itertools.count(1) if i not in RETIRED_NUMBERS)
    return tuple(
        dataclasses.replace(p, name=f"{i:04d}-{p.name}")
        for i, p in zip(numbers, patches)
    )


SERIES: tuple[Patch, ...] = _numbered(FIXES + PROPOSALS + LATER_FIXES)

# Unchanged copies of upstream's test files (provenance in its SOURCES.txt),
# of TORCH_TESTS_PATH unless TORCH_TESTS_ELSEWHERE names another directory
TORCH_TESTS = HERE / "pytorch_tests"
TORCH_TESTS_PATH = "test/distributed/pipelining"
TORCH_TESTS_ELSEWHERE = {"test_utils.py": "test"}


def torch_test_path(name: str) -> str:
    """Upstream's path (``test/...``) of the copy ``pytorch_tests/<name>``."""
    return f"{TORCH_TESTS_ELSEWHERE.get(name, TORCH_TESTS_PATH)}/{name}"


# --------------------------------------------------------------------------- #
# Making the diffs                                                             #
# --------------------------------------------------------------------------- #


def _read_tree(root: Path) -> dict[str, str]:
    """torch's files the series edits, by path under ``root`` (``torch/...``)."""
    files = {
        f"{PIPELINING}/{p.name}": p.read_text()
        for p in sorted((root / PIPELINING).glob("*.py"))
    }
    for path in BASE_FILES:
        files[path] = (root / path).read_text()
    return files


def _git_env(cwd: str | Path) -> dict[str, str]:
    """The environment of the git commands run in the scratch directory ``cwd``.

    No user or system configuration, and no repository found above ``cwd``:
    inside a repository's work tree (a ``TMPDIR`` there), ``git apply`` takes
    paths as relative to the repository's top and skips those outside ``cwd``,
    without an error.
    """
    return {
        **os.environ,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CEILING_DIRECTORIES": str(Path(cwd).resolve().parent),
        "LC_ALL": "C",
    }


def _apply_hunks(files: dict[str, str], diff: Path) -> None:
    """``git apply`` (no fuzz) of ``diff`` to ``files``, in place."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(diff)],
            cwd=root,
            capture_output=True,
            text=True,
            env=_git_env(root),
        )
        if done.returncode:
            raise RuntimeError(
                f"{diff.relative_to(REPO)} does not apply: {done.stderr.strip()}"
            )
        for path in files:
            files[path] = (root / path).read_text()


def _file_diff(path: str, old: str | None, new: str) -> str:
    """``git diff`` of one file (``a/torch/...`` and ``b/torch/...``, function names in hunk headers)."""
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
            env=_git_env(tmp),
        )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"git diff failed: {done.stderr.strip()}")
    if "\\ No newline at end of file" in done.stdout:
        raise ValueError(f"{path}: a file must end with a newline")
    # (against /dev/null, git names the new file twice on the first line)
    return done.stdout.replace(
        f"diff --git b/{path} b/{path}\n", f"diff --git a/{path} b/{path}\n", 1
    )


def patch_text(before: dict[str, str], after: dict[str, str]) -> str:
    paths = sorted(p for p in after if before.get(p) != after[p])
    return "".join(_file_diff(p, before.get(p), after[p]) for p in paths)


def generate(base: dict[str, str]) -> dict[str, str]:
    """patch name -> patch.diff text, each on the patches before it in ``base``."""
    result: dict[str, str] = {}
    files = dict(base)
    for patch in SERIES:
        before = dict(files)
        for part in patch.parts:
            _apply_hunks(files, patch.dir / part.file)
        result[patch.name] = patch_text(before, files)
    return result


def _sections(text: str) -> list[str]:
    return re.split(r"(?m)^(?=diff --git )", text)


def torch_base(torch_dir: str | None) -> dict[str, str] | None:
    """torch 2.15's files: from ``torch_dir``, else the installed torch if it is 2.15.x."""
    if torch_dir is not None:
        return _read_tree(Path(torch_dir))
    try:
        import torch
    except ImportError:
        return None
    if not torch.__version__.startswith(TORCH_VERSION + "."):
        return None
    return _read_tree(Path(torch.__file__).parent.parent)


# --------------------------------------------------------------------------- #
# Rules every patch keeps                                                      #
# --------------------------------------------------------------------------- #

_DEPENDS = re.compile(r"(?m)^Depends on: (.+)$")
# a note is defined by a line of its own: ``# [Note: X]``, ``"""[Note: X]``
# or, in a docstring, ``[Note: X]``
_NOTE_DEFINED = re.compile(r'^\s*(?:#\s*|"""\s*)?\[Note: ([^\]]+)\]\s*$')
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def dependencies(patch: Patch) -> list[str]:
    """The patches ``patch``'s ``PR.md`` declares it depends on (names), in series order."""
    found = _DEPENDS.findall((patch.dir / "PR.md").read_text())
    if not found:
        return []  # reported by check_rules
    if len(found) > 1:
        raise ValueError(f"{patch.name}/PR.md: more than one 'Depends on:' line")
    numbers = re.findall(r"\b(\d{4})\b", found[0])
    if not numbers and not found[0].lower().startswith("none"):
        raise ValueError(f"{patch.name}/PR.md: 'Depends on: {found[0]}'")
    names = {p.name[:4]: p.name for p in SERIES}
    unknown = [n for n in numbers if n not in names or names[n] >= patch.name]
    if unknown:
        raise ValueError(f"{patch.name}: depends on unknown or later patches {unknown}")
    return [names[n] for n in sorted(set(numbers))]


def closure(patch: Patch) -> list[str]:
    """``patch``'s dependencies and theirs, in series order (``patch`` excluded)."""
    by_name = {p.name: p for p in SERIES}
    seen: set[str] = set()
    todo = list(dependencies(patch))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(dependencies(by_name[name]))
    return [p.name for p in SERIES if p.name in seen]


def _added_lines(diff: str) -> list[str]:
    return [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++ ")
    ]


def notes_defined(lines: list[str]) -> set[str]:
    return {m.group(1) for line in lines if (m := _NOTE_DEFINED.match(line))}


def check_rules(patches: dict[str, str], base: dict[str, str]) -> list[str]:
    """What breaks the series' rules (an empty list when nothing does).

    * every ``[Note: X]`` a patch's added lines refer to is defined in torch's
      files (``base``), by the patch or by one it depends on (``[Note: X]`` on
      a line of its own, in a comment or a docstring);
    * every line the patch adds is at most :data:`LINE_WIDTH` columns, unless
      the file already has it, indented otherwise or not (code moved, not
      written).
    """
    problems = test_hunk_problems()
    defined_in_torch = notes_defined(
        [ln for t in base.values() for ln in t.splitlines()]
    )
    for patch in SERIES:
        if not _DEPENDS.search((patch.dir / "PR.md").read_text()):
            problems.append(f"{patch.name}/PR.md has no 'Depends on:' line")
        own = _added_lines(patches[patch.name])
        visible = notes_defined(own)
        for dep in closure(patch):
            visible |= notes_defined(_added_lines(patches[dep]))
        visible |= defined_in_torch
        referred = {n for line in own for n in _NOTE.findall(line)}
        for note in sorted(referred - visible):
            problems.append(
                f"{patch.name}: [Note: {note}] is defined nowhere it can see"
            )
        for section in _sections(patches[patch.name]):
            if not section:
                continue
            path = section.split()[2][2:]
            known = {ln.strip() for ln in base.get(path, "").splitlines()}
            for line in _added_lines(section):
                if len(line) > LINE_WIDTH and line.strip() not in known:
                    problems.append(
                        f"{patch.name}: {path}: {len(line)} columns: {line.strip()[:60]}"
                    )
    return problems


def torch_test_files() -> dict[str, str]:
    """Upstream's test files the fixes' hunks apply to (``test/...`` path -> text)."""
    return {
        torch_test_path(p.name): p.read_text() for p in sorted(TORCH_TESTS.glob("*.py"))
    }


def added_tests(patch: Patch) -> dict[str, list[str]]:
    """The test methods ``patch``'s test hunks add, by upstream path (``test/...``)."""
    found: dict[str, list[str]] = {}
    for section in _sections((patch.dir / patch.tests).read_text()):
        if section:
            name = section.split()[2][2:]
            tests = re.findall(r"(?m)^\+\s+def (test_\w+)\(", section)
            if tests:
                found.setdefault(name, []).extend(tests)
    return found


def test_hunk_problems() -> list[str]:
    """What keeps the fixes' test hunks from applying (no fuzz) or from adding a test.

    Each patch's hunks must apply to upstream's test files with those of its
    dependencies applied first, and all of them in series order.
    """
    problems = []
    base = torch_test_files()
    by_name = {p.name: p for p in SERIES}
    series = dict(base)
    for patch in SERIES:
        if patch.tests is None:
            continue
        if not added_tests(patch):
            problems.append(f"{patch.name}/{patch.tests} adds no test method")
        own = dict(base)
        for name in [*closure(patch), patch.name]:
            tests = by_name[name].tests
            if tests is not None:
                try:
                    _apply_hunks(own, by_name[name].dir / tests)
                except RuntimeError as e:
                    problems.append(f"{patch.name} on its dependencies: {e}")
                    break
        try:
            _apply_hunks(series, patch.dir / patch.tests)
        except RuntimeError as e:
            problems.append(f"{patch.name} in series order: {e}")
    for path in sorted(HERE.glob("*/test_*.py")):
        if "Upstream path:" in path.read_text():
            problems.append(
                f"{path.relative_to(HERE)}: a package-only 'Upstream path:' line"
            )
    return problems


_NUMBER = re.compile(r"(?<![\d.])(\d{4})(?![\d.])")


def renumber() -> list[str]:
    """Give each patch directory the number its place in :data:`SERIES` gives it.

    A re-cut edits ``FIXES``, ``PROPOSALS`` and ``LATER_FIXES`` (entries are
    slugs, numbered by place) and runs ``make_series.py --renumber``: every
    ``NNNN-slug/`` whose
    number changed is moved (``git mv``), and every four-digit patch number in
    the Markdown of ``tools/upstream`` (``Depends on:`` lines, PR texts, RFCs,
    READMEs, reports) follows.  New entries need their directories; directories
    no entry names are listed, not removed.  Returns what it did.
    """
    existing = {d.name[5:]: d.name for d in HERE.glob("[0-9]" * 4 + "-*") if d.is_dir()}
    moves = {
        existing[p.name[5:]]: p.name
        for p in SERIES
        if p.name[5:] in existing and existing[p.name[5:]] != p.name
    }
    done = [f"{old} -> {new}" for old, new in sorted(moves.items())]

    def git_mv(src: str, dst: str) -> None:
        subprocess.run(["git", "mv", src, dst], cwd=HERE, check=True)

    for old in moves:  # two passes: a new name may be another's old one
        git_mv(old, f"{old}.renumbering")
    for old, new in moves.items():
        git_mv(f"{old}.renumbering", new)
    numbers = {old[:4]: new[:4] for old, new in moves.items()}
    for md in sorted(HERE.rglob("*.md")):
        text = md.read_text()
        new_text = _NUMBER.sub(lambda m: numbers.get(m.group(1), m.group(1)), text)
        if new_text != text:
            md.write_text(new_text)
            done.append(f"rewrote the patch numbers of {md.relative_to(HERE)}")
    named = {p.name for p in SERIES}
    left = [d for d in existing.values() if d not in moves and d not in named]
    done += [f"no entry names {d}/" for d in sorted(left)]
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the committed patches, write nothing",
    )
    parser.add_argument(
        "--torch-dir",
        help="a directory holding torch/ of torch 2.15.0 (its site-packages)",
    )
    parser.add_argument(
        "--renumber",
        action="store_true",
        help="move the patch directories to their numbers in SERIES (then regenerate)",
    )
    args = parser.parse_args()
    if args.renumber:
        print("\n".join(renumber()) or "every patch has its number")
        return 0
    base = torch_base(args.torch_dir)
    if base is None:
        print(
            f"make_series: needs torch {TORCH_VERSION}.x (installed, or --torch-dir)",
            file=sys.stderr,
        )
        return 2
    patches = generate(base)
    stale = []
    for name, text in patches.items():
        target = HERE / name / "patch.diff"
        committed = target.read_text() if target.exists() else ""
        if args.check:
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
    problems = check_rules(patches, base)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
