"""Imports flow one way: cli -> server -> engine -> runner -> model/export, with the lifecycle
beside the engine and observability, base and host at the bottom (docs/architecture.md#layers).

Every `import` and `from ... import` of every module in src/tokenserve, at module level or
inside a function, is read with `ast` (nothing is imported), mapped to its layer, and must
point to the importer's own group or to a lower layer. Groups that share a layer (the engine
and the lifecycle, say) do not import each other. A new import that runs back up fails here;
the few that exist on purpose are listed in ALLOWED_BACK_IMPORTS with their reason.

Inside one group the layers say nothing, so the same imports must also form no cycle: no
module may reach itself by following imports, wherever in the file they are. An import
inside a function hides a cycle from Python (both modules load) but not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tokenserve"

LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("server", "tools"),
    ("engine", "lifecycle"),
    ("runner",),
    ("export",),
    ("model",),
    ("kernels", "state"),
    ("observability",),
    ("base",),
    ("host",),
]
"""Top to bottom. A module may import its own group and every group of a lower layer."""

GROUPS: dict[str, str] = {
    "tokenserve.__main__": "cli",
    "tokenserve.cli": "cli",
    "tokenserve.server": "server",
    # tools: commands' workhorses above the engine (eval, optimize, generation through an
    # export's own signatures; TFLite, training, the load generator)
    "tokenserve.tools": "tools",
    "tokenserve.edge": "tools",
    "tokenserve.bench": "tools",
    "tokenserve.train": "tools",
    "tokenserve.engine": "engine",
    "tokenserve.engine.runner": "runner",
    "tokenserve.engine.step": "runner",
    "tokenserve.engine.encoder_runner": "runner",
    "tokenserve.engine.encoder_shapes": "runner",
    "tokenserve.lifecycle": "lifecycle",
    "tokenserve.export": "export",
    "tokenserve.model": "model",
    "tokenserve.kernels": "kernels",
    "tokenserve.state": "state",
    "tokenserve.observability": "observability",
    # plain data every layer reads: configs, errors, sampling parameters, stats, and the
    # package itself (its __init__ imports only these and host eagerly)
    "tokenserve": "base",
    "tokenserve.config": "base",
    "tokenserve.errors": "base",
    "tokenserve.sampling": "base",
    "tokenserve.stats": "base",
    # what the machine gives (CPU quota and flags, the user cache directory, the Python
    # heap): standard library only, so every layer may read it
    "tokenserve.host": "host",
}
"""Module prefix -> group; the longest matching prefix wins."""

RUNNER_DATA = ("tokenserve.engine.cache_accounting", "tokenserve.engine.config",
               "tokenserve.engine.kv_budget", "tokenserve.engine.lora_adapter",
               "tokenserve.engine.lora_moe", "tokenserve.engine.prefix_cache",
               "tokenserve.engine.scheduler_output")
"""What the runner reads from the engine above it: configs, cache accounting, the scheduler's
output (the dataclass it executes) and the LoRA adapter format (its roles and widths, a
mixture of experts' too). Never
the loop (core, async_engine, llm)."""

ALLOWED_BACK_IMPORTS: dict[tuple[str, str], str] = {}
"""(importer, imported) -> why this import may run up. Keep it short."""


def group_of(module: str) -> str | None:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        group = GROUPS.get(".".join(parts[:end]))
        if group is not None:
            return group
    return None


def layer_of(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, text: str | None = None) -> set[str]:
    """Every tokenserve module `path` (or `text`, as if it were that file) imports, anywhere
    in the file."""
    module, found = module_name(path), set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    text = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importer's package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from tokenserve.engine import runner` names a module too
            found.update(f"{target}.{alias.name}" for alias in node.names
                         if (PACKAGE.parent / f"{target}.{alias.name}".replace(".", "/")
                             ).with_suffix(".py").exists())
    return {name for name in found if name == "tokenserve" or name.startswith("tokenserve.")}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def violations(edited: dict[Path, str] | None = None) -> list[str]:
    """Every import that runs back up; `edited` replaces some files' text."""
    found, edited = [], edited or {}
    for path in modules():
        importer = module_name(path)
        source = group_of(importer)
        for imported in sorted(imports_of(path, edited.get(path))):
            target = group_of(imported)
            if (importer, imported) in ALLOWED_BACK_IMPORTS or target == source:
                continue
            if source == "runner" and target == "engine" and imported in RUNNER_DATA:
                continue
            if layer_of(target) <= layer_of(source):
                found.append(f"{importer} ({source}) imports {imported} ({target})")
    return found


def import_graph(edited: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """module -> the tokenserve modules it imports (anywhere in the file); `edited` replaces
    some files' text. Importing `a.b.c` also runs `a` and `a.b`'s __init__, but a package's
    own modules import from it all the time: only the modules an import names are edges."""
    edited, known = edited or {}, {module_name(p) for p in modules()}
    return {module_name(p): {m for m in imports_of(p, edited.get(p))
                             if m in known and m != module_name(p)} for p in modules()}


def cycles(edited: dict[Path, str] | None = None) -> list[list[str]]:
    """Each set of modules that import each other around a loop (a strongly connected
    component of the import graph, found with Tarjan's algorithm), as one shortest loop
    through its first module: [a, b, ..., a]."""
    graph = import_graph(edited)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = set(stack[stack.index(module):])
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(_loop_through(min(component), graph, component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def _loop_through(start: str, graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside `component` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph[module] & component):
                if imported == start:
                    return paths[module] + [start]
                if imported not in paths:
                    paths[imported] = paths[module] + [imported]
                    following.append(imported)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


def test_every_module_has_a_layer():
    assert [module_name(p) for p in modules() if group_of(module_name(p)) is None] == []


def test_imports_never_run_back_up():
    assert violations() == []


def test_every_listed_exception_still_exists():
    """An exception whose import is gone must leave the list (so the list stays true)."""
    stale = [pair for pair in ALLOWED_BACK_IMPORTS
             if pair[1] not in imports_of(PACKAGE.parent / (pair[0].replace(".", "/") + ".py"))]
    assert stale == []


@pytest.mark.parametrize("source, line", [
    ("model/checkpoint.py", "from tokenserve.export.exporter import export_model"),
    ("lifecycle/warmup_replay.py", "from tokenserve.engine.core import LLMEngine"),
    ("engine/runner.py", "from tokenserve.engine.core import LLMEngine"),
    ("observability/stack.py", "from tokenserve.server.openai import build_openai_app"),
    ("export/module.py", "from tokenserve.sampling import SamplingParams\n"
                         "from tokenserve.tools.token_stream import sample_tokens"),
])
def test_a_new_back_import_is_caught(source, line):
    """The check can fail: each of these lines, added to a real module, is reported."""
    path = PACKAGE / source
    assert violations({path: path.read_text() + "\n" + line + "\n"}) != []


def test_no_import_cycles():
    assert [" -> ".join(loop) for loop in cycles()] == []


@pytest.mark.parametrize("source, text, expected", [
    # module level, inside one group (the layers alone allow it)
    ("model/layers.py", "from tokenserve.model.transformer import TransformerLM",
     {"tokenserve.model.layers", "tokenserve.model.transformer"}),
    # inside a function, relative
    ("server/ui/stats.py", "def _ui():\n    from .files import StaticUI\n",
     {"tokenserve.server.ui.stats", "tokenserve.server.ui.files"}),
    # inside a function, around three modules: the TFLite converter reading the holdout
    # fraction from evaluate, which loads .tflite files through the runner, which reads the
    # converter's file names
    ("edge/convert.py", "def _fraction():\n    from tokenserve.tools.evaluate import "
                        "heldout_fraction\n",
     {"tokenserve.edge.convert", "tokenserve.tools.evaluate", "tokenserve.edge.runner"}),
    # a GGUF file's reader importing the importer that reads it
    ("model/gguf_file.py", "def _load():\n    from tokenserve.model.gguf import load_gguf\n",
     {"tokenserve.model.gguf_file", "tokenserve.model.gguf"}),
])
def test_a_new_cycle_is_caught(source, text, expected):
    """The check can fail: each of these, added to a real module, closes a loop that is
    reported with exactly the modules on it (whatever other cycle there may be), and that
    the layer check alone lets through."""
    path = PACKAGE / source
    edited = {path: path.read_text() + "\n" + text + "\n"}
    assert expected in [set(loop) for loop in cycles(edited)]
    assert violations(edited) == violations()
