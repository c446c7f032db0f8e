"""The package's shape, checked by ``./dev lint``: no class over 300 lines, no module over
600, no import circle between the modules of ``pikku_celery/``, and no import of a layer
above the importer's own (``LAYERS``: the one place the order is written down).

    python tools/structure.py [ROOT]     # ROOT holds pikku_celery/ (default: .)

Prints each finding, then a summary line; exits 1 when any limit is passed. The limits are
the ceiling of issue 23 ("One redesign of the core's shape"), a consequence of one concern
per module rather than a target: split by concern, never to get under a number. The same
logic as ``../shared/tools/structure.py``, plus relative imports (``from . import x``),
resolved to the modules they name. An import of ``a.b`` counts as an edge to ``a.b`` (and,
for ``from a import b``, to ``a.b`` when that is a module); a module's import of its own
enclosing package does not. ``tests/unit/test_structure.py`` proves it fails on a circle,
an oversized class, an oversized module and an upward import.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator

PACKAGE = "pikku_celery"
MAX_CLASS, MAX_MODULE = 300, 600

#: The package's layers, lowest first: a module may import its own layer and those before it,
#: never one after. A name is a folder or a top-level module of the package; ``""`` is the
#: package's ``__init__`` (its public face). ``docs/internals/how-it-works.md`` draws it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("model",),                                    # the vocabulary
    ("store", "leases"),                           # where state lives
    ("workflow",),                                 # what users write, and replay
    ("engine",),                                   # the runtime, no Celery
    ("worker", "schedules", "observe"),            # Celery, schedules, what tools are told
    ("operations", "app", "testing", "signals", "backend", ""),  # the public face
    ("operate", "dashboard", "contrib"),           # what people use
)


def _modules(root: str) -> Iterator[tuple[str, str, bool]]:
    """``(dotted name, path, is a package __init__)`` of every module under the package."""
    for dirpath, dirnames, files in os.walk(os.path.join(root, PACKAGE)):
        dirnames.sort()
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(dirpath, file)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                init = name.endswith(".__init__")
                yield (name[: -len(".__init__")] if init else name), path, init


def _layer(module: str) -> int | None:
    """The index in ``LAYERS`` of a module of the package, None for one no layer names."""
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def _edges(tree: ast.AST, name: str, init: bool, modules: set[str]) -> set[str]:
    """The modules of the package this one imports, for the layer order: ``from a import b``
    is an import of the module ``a.b`` when there is one, of ``a`` when ``b`` is a name in it
    (so ``from pikku_celery import PikkuCelery`` imports the public face)."""
    edges: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, init)
            if module == PACKAGE or module.startswith(PACKAGE + "."):
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    edges.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in modules)
    return edges


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a layer above the importer's, and each module in no layer."""
    found = []
    for importer in sorted(edges):
        own = _layer(importer)
        if own is None:
            found.append(f"module {importer}: in no layer of LAYERS")
            continue
        for dep in sorted(edges[importer]):
            theirs = _layer(dep)
            if theirs is not None and theirs > own:
                found.append(f"upward import: {importer} (layer {own + 1}) imports {dep} "
                             f"(layer {theirs + 1})")
    return found


def _absolute(node: ast.ImportFrom, name: str, init: bool) -> str:
    """The module an ``import from`` names, a relative one resolved against the importer."""
    module = node.module or ""
    if node.level:
        base = name.split(".") if init else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join([*base, module] if module else base)
    return module


def _imported(tree: ast.AST, name: str, init: bool) -> set[str]:
    """Every ``pikku_celery`` name the module imports (modules, or names inside them)."""
    deps: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, init)
            if module == PACKAGE or module.startswith(PACKAGE + "."):
                deps.add(module)
                deps.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names
                        if a.name == PACKAGE or a.name.startswith(PACKAGE + "."))
    return deps


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def check(root: str) -> tuple[list[str], int]:
    """The findings under ``root``, and the length of its longest module."""
    lengths: dict[str, int] = {}
    imports: dict[str, set[str]] = {}
    parsed: dict[str, tuple[ast.AST, bool]] = {}
    problems: list[str] = []
    for name, path, init in _modules(root):
        with open(path, encoding="utf-8") as file:
            source = file.read()
        tree = ast.parse(source, path)
        lengths[name] = len(source.splitlines())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_CLASS:
                    problems.append(f"class {name}.{node.name}: {length} lines (> {MAX_CLASS})")
        imports[name] = _imported(tree, name, init)
        parsed[name] = (tree, init)
    problems += [f"module {name}: {n} lines (> {MAX_MODULE})"
                 for name, n in lengths.items() if n > MAX_MODULE]
    graph = {m: {d for d in deps if d in lengths and d != m and not m.startswith(d + ".")}
             for m, deps in imports.items()}
    problems += ["import circle: " + " <-> ".join(c) for c in _circles(graph)]
    modules = set(lengths)
    problems += _upward({name: _edges(tree, name, init, modules)
                         for name, (tree, init) in parsed.items()})
    return problems, max(lengths.values(), default=0)


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else "."
    problems, longest = check(root)
    for problem in problems:
        print(problem)
    circles = sum(p.startswith("import circle") for p in problems)
    upward = sum(p.startswith("upward import") for p in problems)
    print(f"structure: {len(problems)} over the limits ({circles} import circles, "
          f"{upward} upward imports, largest module {longest} lines)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
