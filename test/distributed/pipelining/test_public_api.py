# Owner(s): ["oncall: distributed"]
"""The package's public face: what the docs document exists, and the demo,
the tools and the docs use public names only.

* Every ``torch_pipelining_ext.<name>`` the README, CONTRIBUTING and the pages
  of ``docs/`` mention (dotted references and the imports of their code
  blocks) resolves, and every public module lists what it exports in
  ``__all__``.
* Every relative link of those files leads to a file that exists and, with a
  ``#fragment``, to a heading of it; every file and folder CONTRIBUTING's
  Layout section names exists.
* The README stays the front door: the two commands CI runs, a link to every
  page of ``docs/``, at most 300 lines (the rest belongs in ``docs/``).
* The package's modules import each other without a cycle (a cycle works
  only while every import in it stays lazy or in the right order, and it hides
  which module is the lower layer).
* No function or method of the package is longer than 80 lines (docstring
  included): a longer one is split into named steps.
* No Python file of ``tools/``, ``examples/`` or ``torch_pipelining_ext/demo/`` and no code
  block of the docs imports a private name of the package (a module or a name
  that starts with ``_``); the demo's own private modules
  (``torch_pipelining_ext.demo._*``) are allowed inside ``demo/`` only, and
  the benchmarks of ``MEASURED_INTERNALS`` reach the one internal each swaps
  for the alternatives it measures side by side.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import unittest.mock
import warnings
from pathlib import Path

from torch.testing._internal.common_utils import run_tests, TestCase

import torch_pipelining_ext


REPO = Path(__file__).resolve().parents[3]
PACKAGE = "torch_pipelining_ext"
DOCS = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    *sorted((REPO / "docs").glob("*.md")),
]
# tools/upstream/NNNN-*/ hold upstream's files (they import torch only)
CODE = (
    sorted(
        p
        for p in (REPO / "tools").rglob("*.py")
        if not re.match(r"\d{4}-", p.parent.name)
    )
    + sorted((REPO / PACKAGE / "demo").rglob("*.py"))
    + sorted((REPO / "examples").rglob("*.py"))
)
PUBLIC_MODULES = (
    "torch_pipelining_ext",
    "torch_pipelining_ext.expert_parallel",
    "torch_pipelining_ext.hf",
    "torch_pipelining_ext.launcher",
    "torch_pipelining_ext.overlap",
    "torch_pipelining_ext.plan",
    "torch_pipelining_ext.runtime",
    "torch_pipelining_ext.sim",
    "torch_pipelining_ext.sim.plan",
    "torch_pipelining_ext.stage_split",
    "torch_pipelining_ext.train",
)
# Benchmarks that replace an internal of the package with the alternatives they
# measure beside it, and the private modules they may import for that: path ->
# modules.  Anything else private they import still fails the test.
MEASURED_INTERNALS = {
    # the stage reader against safetensors per file, DCP's reader, the former one
    "tools/bench_load.py": {"torch_pipelining_ext.hf._checkpoint"},
    # the coordination kernels at their key against BackendSelect and none
    "tools/bench_overlap.py": {
        "torch_pipelining_ext.overlap._collectives",
        "torch_pipelining_ext.overlap._marks",
    },
}

# Former names, kept importable with a DeprecationWarning: name -> the module it is
DEPRECATED_MODULES = {
    "torch_pipelining_ext.ep_overlap": "torch_pipelining_ext.overlap",
    "torch_pipelining_ext.simulate": "torch_pipelining_ext.sim",
}


def _code_blocks(text: str) -> list[str]:
    """The Python code blocks of a Markdown text (```python ... ```)."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def _imports(source: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import of the package in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (a.name, None) for a in node.names if a.name.split(".")[0] == PACKAGE
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == PACKAGE:
                found += [(node.module, a.name) for a in node.names]
    return found


def _strip_fences(text: str) -> str:
    """``text`` without its fenced code blocks (indented ones in list items too)."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.DOTALL | re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


def _anchors(text: str) -> set[str]:
    """The fragments GitHub gives the headings of a Markdown text (first occurrence)."""
    anchors = set()
    for heading in re.findall(
        r"^#{1,6} (.*)$", _strip_fences(text), flags=re.MULTILINE
    ):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _private_parts(module: str, name: str | None) -> list[str]:
    parts = module.split(".")[1:] + ([name] if name else [])
    return [
        p
        for p in parts
        if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
    ]


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _package_imports() -> dict[str, set[str]]:
    """For every module of the package, the package modules it imports
    (anywhere in the file: at module level, in functions, under TYPE_CHECKING)."""
    files = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = parts[: len(parts) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    if f"{source}.{a.name}" in files:
                        targets.add(f"{source}.{a.name}")
                    elif source in files:
                        targets.add(source)
        graph[module] = targets - {module}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node a path of one or more edges leads to from ``start``."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes of ``graph`` that reach each other (each a sorted
    list; the package has about sixty modules, so reachability per node is
    cheap)."""
    reach = {node: _reachable(graph, node) for node in graph}
    found: list[list[str]] = []
    for node in sorted(graph):
        if node in reach[node] and not any(node in group for group in found):
            found.append(sorted(n for n in reach[node] if node in reach[n]))
    return found


class PublicApiTest(TestCase):
    def test_documented_names_exist(self) -> None:
        checked = 0
        for doc in DOCS:
            text = doc.read_text()
            names = set(re.findall(r"\btorch_pipelining_ext(?:\.[A-Za-z_]\w*)+", text))
            for block in _code_blocks(text):
                for module, name in _imports(block):
                    names.add(f"{module}.{name}" if name else module)
            for dotted in sorted(names):
                if _private_parts(dotted, None):
                    continue  # the Layout sections name private modules: they are files, checked below
                with self.subTest(doc=doc.name, name=dotted), warnings.catch_warnings():
                    # the docs may name a former module (it warns on import)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    _resolve(dotted.removesuffix(".py"))
                    checked += 1
        self.assertGreater(checked, 10)

    def test_public_modules_have_all(self) -> None:
        for name in PUBLIC_MODULES:
            with self.subTest(module=name):
                module = importlib.import_module(name)
                exported = getattr(module, "__all__", None)
                self.assertIsNotNone(exported, f"{name} has no __all__")
                for attr in exported:
                    self.assertTrue(
                        hasattr(module, attr),
                        f"{name}.__all__ names {attr!r}, which it lacks",
                    )
                    obj = getattr(module, attr)
                    if callable(obj) and not isinstance(
                        obj, type(torch_pipelining_ext)
                    ):
                        self.assertTrue(
                            getattr(obj, "__doc__", None),
                            f"{name}.{attr} has no docstring",
                        )

    def test_aliases_are_the_same_modules(self) -> None:
        import torch_pipelining_ext.plan as plan
        import torch_pipelining_ext.sim.plan as sim_plan

        self.assertIs(plan, sim_plan)

    def test_former_names_warn_and_are_the_same_modules(self) -> None:
        """Each former name warns on import, naming the new one, and is the new module."""
        for old, new in DEPRECATED_MODULES.items():
            with self.subTest(module=old):
                saved = sys.modules.pop(old, None)
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        module = importlib.import_module(old)
                    self.assertIs(module, importlib.import_module(new))
                    messages = [
                        str(w.message)
                        for w in caught
                        if issubclass(w.category, DeprecationWarning)
                    ]
                    self.assertEqual(len(messages), 1, messages)
                    self.assertIn(old, messages[0])
                    self.assertIn(new, messages[0])
                finally:
                    if saved is not None:
                        sys.modules[old] = saved

    def test_tools_demo_and_docs_use_no_former_names(self) -> None:
        sources = [(p, p.read_text()) for p in CODE]
        sources += [
            (doc, block) for doc in DOCS for block in _code_blocks(doc.read_text())
        ]
        offenders = [
            f"{path.relative_to(REPO)}: {module}"
            for path, source in sources
            for module, name in _imports(source)
            if module in DEPRECATED_MODULES
            or (name is not None and f"{module}.{name}" in DEPRECATED_MODULES)
        ]
        self.assertEqual(offenders, [], "former module names imported")

    def test_plan_command_exit_status(self) -> None:
        """``python -m torch_pipelining_ext.plan`` (the alias) exits 0 after a plan, 2 on bad arguments.

        Run in this process (``runpy``, as ``-m`` runs it): a subprocess would
        only add an interpreter start.
        """
        import contextlib
        import io
        import runpy

        def run(*args: str) -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            argv = ["plan", "--model", "qwen3-235b-a22b", *args]
            with (
                unittest.mock.patch.object(sys, "argv", argv),
                # the alias module, run afresh as -m runs it; sys.modules
                # (and __main__, which the alias replaces) restored after
                unittest.mock.patch.dict(sys.modules),
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
            ):
                sys.modules.pop("torch_pipelining_ext.plan", None)
                try:
                    runpy.run_module("torch_pipelining_ext.plan", run_name="__main__")
                    code = 0
                except SystemExit as e:
                    code = 0 if e.code is None else e.code
            return code, out.getvalue(), err.getvalue()

        code, out, err = run(
            "--gpus", "256", "--preset", "H100", "--pp", "8", "--ep", "8"
        )
        self.assertEqual(code, 0, err)
        self.assertIn("DualPipeV", out)
        code, out, err = run("--gpus", "0")
        self.assertEqual(code, 2, out + err)
        self.assertIn("gpus", err)

    def test_package_imports_have_no_cycles(self) -> None:
        graph = _package_imports()
        self.assertGreater(len(graph), 40)
        self.assertEqual(
            _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), [["a", "b", "c"]]
        )
        cycles = _cycles(graph)
        self.assertEqual(
            cycles,
            [],
            "modules of the package that import each other in a cycle:\n"
            + "\n".join(" <-> ".join(c) for c in cycles),
        )

    def test_no_function_over_80_lines(self) -> None:
        long = []
        for path in sorted((REPO / PACKAGE).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        where = path.relative_to(REPO)
                        long.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
        self.assertEqual(long, [], "functions over 80 lines:\n" + "\n".join(long))

    def test_relative_links_resolve(self) -> None:
        """Every relative link of the docs leads to a file, and a fragment to a heading."""
        checked = 0
        for doc in DOCS:
            for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, fragment = target.partition("#")
                linked = (doc.parent / path).resolve() if path else doc
                with self.subTest(doc=doc.name, link=target):
                    self.assertTrue(linked.exists(), f"{doc.name}: {target} is missing")
                    if fragment:
                        self.assertIn(
                            fragment,
                            _anchors(linked.read_text()),
                            f"{doc.name}: {target}: no such heading",
                        )
                    checked += 1
        self.assertGreater(checked, 10)

    def test_readme_is_the_front_door(self) -> None:
        """The README keeps the two commands CI runs and links every page of docs/."""
        text = (REPO / "README.md").read_text()
        commands = re.findall(
            r"^\s*```bash\n(.*?)^\s*```", text, re.DOTALL | re.MULTILINE
        )
        lines = {line.strip() for block in commands for line in block.splitlines()}
        # .ci/run runs the README's test command as it is written here
        self.assertIn("bash tools/run_demo.sh", lines)
        self.assertIn("bash tools/run_tests.sh", lines)
        for page in sorted((REPO / "docs").glob("*.md")):
            with self.subTest(page=page.name):
                self.assertIn(f"](docs/{page.name})", text)
        self.assertLessEqual(
            len(text.splitlines()), 300, "README.md: move the details to docs/"
        )

    def test_layout_paths_exist(self) -> None:
        """Every file and folder CONTRIBUTING's Layout section names exists, where it says."""
        text = (REPO / "CONTRIBUTING.md").read_text()
        layout = re.search(
            r"^## Layout\n(?:(?!^#).)*?^```\n(.*?)^```",
            text,
            flags=re.DOTALL | re.MULTILINE,
        )
        self.assertIsNotNone(
            layout, "CONTRIBUTING.md has no Layout section with a code block"
        )
        folders: list[
            tuple[int, Path]
        ] = []  # (indent, folder) of the enclosing entries
        checked = 0
        for line in layout.group(1).splitlines():
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            while folders and folders[-1][0] >= indent:
                folders.pop()
            base = folders[-1][1] if folders else REPO
            for name in re.split(r"\s{2,}", line.strip())[0].split(", "):
                path = base / name
                with self.subTest(path=str(path.relative_to(REPO))):
                    self.assertTrue(
                        path.exists(),
                        f"{path.relative_to(REPO)} (CONTRIBUTING.md Layout) does not exist",
                    )
                    checked += 1
                if name.endswith("/"):
                    folders.append((indent, path))
        self.assertGreater(checked, 20)

    def test_tools_demo_and_docs_use_public_names(self) -> None:
        offenders = []
        sources = [(p, p.read_text()) for p in CODE]
        sources += [
            (doc, block) for doc in DOCS for block in _code_blocks(doc.read_text())
        ]
        for path, source in sources:
            in_demo = (REPO / PACKAGE / "demo") in path.parents
            for module, name in _imports(source):
                private = _private_parts(module, name)
                if (
                    in_demo
                    and module.startswith(f"{PACKAGE}.demo")
                    and private
                    and module.split(".")[1] == "demo"
                ):
                    continue
                where = path.relative_to(REPO)
                if private and f"{module}.{name}" in MEASURED_INTERNALS.get(
                    str(where), ()
                ):
                    continue
                if private:
                    offenders.append(f"{where}: {module}{'.' + name if name else ''}")
        self.assertEqual(
            offenders,
            [],
            "private names of the package imported:\n" + "\n".join(offenders),
        )
        self.assertGreater(len(sources), 10)


if __name__ == "__main__":
    run_tests()
