"""The package's shape: no import cycle, the layers import only downwards, modules stay small.

The imports are read with ``ast`` (nothing is imported): every ``import`` and ``from ... import``
of a module, at module level and inside functions alike, resolved to the ``flower_shard`` module
it loads (``from flower_shard.config import TrainConfig`` is ``flower_shard.config``; ``from
flower_shard.ux import metrics`` is ``flower_shard.ux.metrics``). A lazy import inside a function
is still a dependency: it only moves the cycle from import time to call time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flower_shard"

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The flower_shard module that importing ``name`` loads (a package's ``__init__``, or the
    module itself); None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The flower_shard modules that ``module`` imports, anywhere in its body."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from PKG import sub` loads the module PKG.sub; `from PKG import name`, PKG.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless they are this module's
    # own packages: those ran before this module did.
    own = _packages(module)
    for target in list(found):
        found.update(_packages(target) - own)
    found.discard(module)
    return found


def _packages(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


GRAPH: dict[str, set[str]] = {m: imports_of(m) for m in MODULES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    # A function-level import counts: the CLI imports the launcher only inside main().
    assert "flower_shard.flower.node.launcher" in GRAPH["flower_shard.ux.cli"]
    assert "flower_shard.protocol" in GRAPH["flower_shard.config.federation"]


def test_no_import_cycle():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles (module-level and function-level imports):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


# Layer -> the flower_shard packages it must not import (a lower layer never reaches up).
FORBIDDEN = {
    "flower_shard.runtime": ("flower_shard.flower", "flower_shard.launch", "flower_shard.ux"),
    "flower_shard.config": (
        "flower_shard.data",
        "flower_shard.runtime",
        "flower_shard.flower",
        "flower_shard.launch",
        "flower_shard.ux",
    ),
    "flower_shard.data": (
        "flower_shard.runtime",
        "flower_shard.flower",
        "flower_shard.launch",
        "flower_shard.ux",
    ),
    "flower_shard.planning": (
        "flower_shard.data",
        "flower_shard.flower",
        "flower_shard.launch",
        "flower_shard.ux",
    ),
}
# Leaf modules: they import nothing from flower_shard.
LEAVES = (
    "flower_shard.protocol",
    "flower_shard.runfiles",
    "flower_shard.errors",
    "flower_shard.threads",
)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_layers_import_only_downwards():
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        for layer, banned in FORBIDDEN.items():
            if _inside(module, layer):
                wrong += [
                    f"{module} imports {t}"
                    for t in sorted(targets)
                    if any(_inside(t, b) for b in banned)
                ]
        if module in LEAVES:
            wrong += [f"{module} imports {t}" for t in sorted(targets) if t != "flower_shard"]
    assert not wrong, "imports across layers:\n" + "\n".join(wrong)


def _sizes() -> tuple[list[str], list[str]]:
    modules, functions = [], []
    for path in MODULES.values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            modules.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    return modules, functions


def test_modules_and_functions_stay_small():
    modules, functions = _sizes()
    assert not modules and not functions, (
        f"over {MAX_MODULE_LINES} lines per module or {MAX_FUNCTION_LINES} per function "
        "(a function's lines include its docstring):\n" + "\n".join(modules + functions)
    )


HEAVY = ("torch", "numpy", "rich", "cryptography", "flwr", "transformers")


@pytest.mark.parametrize(
    "code",
    [
        "import flower_shard.ux.cli",
        "import flower_shard.planning.planner",
        "import flower_shard.config.federation",
        "import sys; sys.argv = ['flower-shard', '--help']\n"
        "from flower_shard.ux.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass",
    ],
    ids=["import-cli", "import-planner", "import-config", "flower-shard-help"],
)
def test_the_cli_and_the_planner_load_no_heavy_package(code):
    """``flower-shard --help`` (and any subcommand's parser) starts in a fraction of a second:
    torch, numpy, rich, cryptography and flwr are imported by the subcommand that uses them."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout[-2000:]


@pytest.mark.parametrize(
    "code",
    [
        # a bad value of `flower-shard train` fails before torch is imported
        "import sys; sys.argv = ['flower-shard', 'train', '--local-steps', '0']\n"
        "from flower_shard.ux.cli import main\n"
        "assert main() == 2",
        # an aggregator configured for nesterov, checkpointed and loaded: numpy only
        "import tempfile\nfrom pathlib import Path\n"
        "from flower_shard.dataplane import aggregator, persist\n"
        "from flower_shard.dataplane.layout import Layout\n"
        "from flower_shard.dataplane.init import initial_weights\n"
        "from flower_shard.dataplane.state import AggregatorState\n"
        "d, layout = Path(tempfile.mkdtemp()), Layout.build({'w': (4, 3)}, 1)\n"
        "init = initial_weights({'kind': 'random', 'seed': 1, 'std': 1.0}, layout.owned(0))\n"
        "s = AggregatorState(layout, 0, init, d / 'spool', outer='nesterov')\n"
        "persist.save(s, d / 'ckpt'); persist.load(s, d / 'ckpt')",
    ],
    ids=["train-bad-value", "aggregator"],
)
def test_the_launcher_and_the_aggregator_need_no_torch(code):
    """A bad ``flower-shard train`` value fails in a fraction of a second, and an aggregator
    process (central, one per share of the model) holds no torch: numpy does its math."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in ('torch', 'flwr') if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout[-2000:]


def test_ranks_leave_the_torch_world_only_through_shutdown():
    """A rank that destroys its process group while a peer still reads from its gloo sockets can
    make that peer abort ("terminate called without an active exception"); ``shutdown`` holds
    the barrier that prevents it, so no other code (product, tests, benchmarks) calls
    ``destroy_process_group`` or closes a trainer without saying whether it ended cleanly."""
    offenders = []
    for path in [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]:
        if path.name in ("distributed.py", "test_layout.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "destroy_process_group(" in line or re.search(r"trainer\.close\(\)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "use runtime.distributed.shutdown(clean=...):\n" + "\n".join(offenders)


def test_ranks_that_end_cleanly_exit_without_finalization():
    """Every rank entry point (tests/dist, bench workers, the job) that shuts down cleanly then
    calls ``exit_now``: gloo's threads can abort a finalizing interpreter (see exit_now)."""
    entry_points = [*(ROOT / "tests" / "dist").glob("*.py"), *(ROOT / "bench").glob("*.py")]
    entry_points.append(PACKAGE / "launch" / "job.py")
    missing = [
        str(path.relative_to(ROOT))
        for path in entry_points
        if re.search(r"(shutdown|close)\(clean=True\)|job\.close\(clean\)", path.read_text())
        and "exit_now(" not in path.read_text()
    ]
    assert not missing, (
        "call runtime.distributed.exit_now() after the clean shutdown: " + ", ".join(missing)
    )
