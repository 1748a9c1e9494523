"""Report how each patch of the series meets the newest upstream files known here.

    python tools/upstream/check_newest.py                      # the report, offline
    python tools/upstream/check_newest.py --from-checkout DIR  # first copy the files
                                                               # out of a pytorch clone

The series is cut against torch 2.15.0's files (``make_series.py``).  Upstream
moves on; this asks, for each patch and each upstream file its ``patch.diff``
touches, whether the patch applies (``git apply``, no fuzz) to the version of
that file named in ``newest_upstream/SOURCES.txt`` (one 40-hex commit per
path) on the patches it declares it depends on, as ``check.sh`` applies it to
2.15.0.  It is a report, not a gate: a patch that does
not apply there needs a re-cut before it can be sent, nothing more.

The copies live under ``newest_upstream/`` at their repository paths
(``newest_upstream/torch/distributed/pipelining/schedules.py``) and are not
committed (``newest_upstream/.gitignore``): ``--from-checkout`` writes them
with ``git show COMMIT:PATH`` from a pytorch clone that has those commits, and
every later run works offline from them.  A path without a copy is reported
as such.  The versions are those the SOURCES note names, each the newest one
found of its file, of different dates: not a snapshot of any one commit and
not a verified ``main``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from make_series import _git_env, closure, Patch, SERIES


HERE = Path(__file__).resolve().parent
NEWEST = HERE / "newest_upstream"
SOURCES = NEWEST / "SOURCES.txt"
_SOURCE_LINE = re.compile(r"^(?P<path>\S+)\s+(?P<commit>[0-9a-f]{40})\b")
_DIFF_PATH = re.compile(r"(?m)^diff --git a/(\S+) b/")


def sources() -> dict[str, str]:
    """Upstream path -> the 40-hex commit of its newest known version (SOURCES.txt)."""
    found = {}
    for line in SOURCES.read_text().splitlines():
        if match := _SOURCE_LINE.match(line):
            found[match["path"]] = match["commit"]
    return found


def copy_from_checkout(checkout: Path) -> list[str]:
    """Write every file SOURCES.txt names under ``newest_upstream/``; returns what failed."""
    failed = []
    for path, commit in sources().items():
        done = subprocess.run(
            ["git", "-C", str(checkout), "show", f"{commit}:{path}"],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            failed.append(f"{path} at {commit}: {done.stderr.strip()}")
            continue
        target = NEWEST / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(done.stdout)
    return failed


def applies(patch: Patch, path: str, newest: Path = NEWEST) -> str:
    """Whether ``patch``'s hunks for ``path`` apply to its copy under ``newest``.

    The hunks of ``patch``'s dependencies for ``path`` are applied first; the
    answer is one line.
    """
    copy = newest / path
    if not copy.exists():
        return "no copy (run with --from-checkout)"
    by_name = {p.name: p for p in SERIES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / path).parent.mkdir(parents=True)
        shutil.copy(copy, root / path)
        for name in [*closure(patch), patch.name]:
            done = subprocess.run(
                [
                    "git",
                    "apply",
                    f"--include={path}",
                    str(by_name[name].dir / "patch.diff"),
                ],
                cwd=root,
                capture_output=True,
                text=True,
                env=_git_env(root),
            )
            if done.returncode:
                lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
                where = "" if name == patch.name else f"its dependency {name[:4]}: "
                return f"does not apply ({where}{lines[0].removeprefix('error: ')})"
    return "applies"


def report(newest: Path = NEWEST) -> list[tuple[str, str, str]]:
    """(patch, upstream path, verdict) for every file every patch touches."""
    known = sources()
    rows = []
    for patch in SERIES:
        diff = patch.dir / "patch.diff"
        for path in sorted(set(_DIFF_PATH.findall(diff.read_text()))):
            if path not in known:
                rows.append((patch.name, path, "no version named in SOURCES.txt"))
            else:
                rows.append((patch.name, path, applies(patch, path, newest)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from-checkout",
        type=Path,
        help="a pytorch clone holding the commits SOURCES.txt names",
    )
    args = parser.parse_args()
    if args.from_checkout is not None:
        failed = copy_from_checkout(args.from_checkout)
        if failed:
            print("\n".join(failed), file=sys.stderr)
            return 2
    known = sources()
    for path, commit in sorted(known.items()):
        print(f"{path} @ {commit}")
    print()
    for name, path, verdict in report():
        print(f"{name:34} {path:45} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
