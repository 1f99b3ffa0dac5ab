"""The import graph of `src/steadylm` has no circle, and no function-level import exists to hide one.

The graph is read with `ast`, not by importing: every `import steadylm.x` and `from steadylm.x import y`
(relative ones too), wherever it is written. An edge goes to the module named; `from steadylm.a import b`
goes to the submodule `steadylm.a.b` when there is one (so a package importing its own submodules is
an edge to each). A function-level import runs the same code, only later, so it is an edge like any
other; it is legitimate for import-time cost (matplotlib, transformers) and to keep code a run only loads when its
config asks for it off the training path (`optim=muon`), never to break a circle.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src"


class Import(NamedTuple):
    source: str
    target: str
    line: int
    lazy: bool  # written inside a function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "steadylm").rglob("*.py"))}


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                named = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
                targets = list(dict.fromkeys(named))  # `from steadylm.model import GPT, GPTConfig`: one edge
            found.extend(Import(name, t, child.lineno, lazy) for t in targets if t in known and t != name)
            visit(child, inner)

    visit(ast.parse(source, filename=name), lazy=False)
    return found


def import_graph() -> list[Import]:
    mods = modules()
    return [
        imp for name, p in mods.items() for imp in imports_of(name, p.read_text(), p.name == "__init__.py", set(mods))
    ]


def shortest_path(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """Modules from `start` to `goal` along `edges` (breadth first), or None when `goal` is unreachable."""
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for t in sorted(edges[node]):
                if t not in previous:
                    previous[t] = node
                    nxt.append(t)
        frontier = nxt
    if goal not in previous:
        return None
    path = [goal]
    while previous[path[-1]] is not None:
        path.append(previous[path[-1]])
    return path[::-1]


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """One shortest circle through each group of modules that import each other, and the group's members."""
    seen: set[str] = set()
    found = []
    for node in sorted(edges):
        if node in seen:
            continue
        back = [shortest_path(edges, t, node) for t in sorted(edges[node])]
        back = [p for p in back if p]
        if back:
            members = {m for m in edges if shortest_path(edges, node, m) and shortest_path(edges, m, node)}
            seen |= members
            found.append(
                " -> ".join([node, *min(back, key=len)]) + f" (the circle's modules: {', '.join(sorted(members))})"
            )
    return found


def edges_of(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        edges[imp.source].add(imp.target)
        edges[imp.target]  # every module is a node
    return edges


def test_the_reader_sees_every_kind_of_import():
    """The graph reader itself: module-level, function-level, relative, and package-to-submodule edges."""
    graph = import_graph()
    edges = {(i.source, i.target, i.lazy) for i in graph}
    assert ("steadylm.train", "steadylm.config", False) in edges  # from steadylm.config import ...
    assert ("steadylm.model", "steadylm.model.gpt", False) in edges  # a package importing its submodule
    assert ("steadylm.memory", "steadylm.model", True) in edges  # inside count_params
    snippet = (
        "from . import gpt\nfrom .config import GPTConfig\nfrom .. import errors\ndef f():\n    import steadylm.data\n"
    )
    found = imports_of("steadylm.model.fake", snippet, False, set(modules()))
    assert [(i.target, i.lazy) for i in found] == [
        ("steadylm.model.gpt", False),
        ("steadylm.model.config", False),
        ("steadylm.errors", False),
        ("steadylm.data", True),
    ]


def test_no_import_cycle():
    found = cycles(edges_of(import_graph()))
    assert not found, "import cycles in src/steadylm:\n" + "\n".join(found)


def test_no_lazy_import_hides_a_cycle():
    """A function-level steadylm import that, written at module level, would close an import-time circle."""
    graph = import_graph()
    eager = edges_of([i for i in graph if not i.lazy])
    hiding = []
    for imp in (i for i in graph if i.lazy):
        back = shortest_path(eager, imp.target, imp.source) if imp.target in eager else None
        if back:
            hiding.append(
                f"{imp.source} line {imp.line} imports {imp.target} lazily: {' -> '.join([imp.source, *back])}"
            )
    assert not hiding, "lazy imports that hide a cycle:\n" + "\n".join(hiding)


# The most lines of steadylm a plain `python train.py` loads (a real run of a few steps, the default config and
# callbacks, the in-training eval callback among them), and with the suite cut to guard, spike and rollback. Alarms,
# not targets: the whole path's bar is 7,500 (nanochat, SFT, RL and its inference engine included, is 6,006; each
# check's `describe`, diagnose's reading of its events, lives in the check's file and adds ~250; the resolved run
# config, the mixture's refusals and resume, Hugging Face import's hooks, sweep jobs' ranks, FSDP2's
# sharded measure/snapshot/clip paths and activation checkpointing add ~900 more, FSDP2's whole-or-nothing
# asynchronous checkpoint save and sharded disk rollback ~130), the cut path's 6,250; a fork that adds a check or
# two stays under both.
TRAINING_PATH_LINES = 7500
CUT_SUITE_LINES = 6250
CUT = [f"callbacks.stability.{name}=null" for name in ("stats", "loss_scale", "qk_clip", "init_loss", "signals")]
TOOLS = (
    "steadylm.doctor",
    "steadylm.diagnose",
    "steadylm.export",
    "steadylm.generate",
    "steadylm.eval.harness",
    "steadylm.sweep",
    "steadylm.stability.faults",  # breaks a run on purpose: loaded when a config names it
    "steadylm.muon",  # loaded when optim=muon builds its optimizer
)
RUN = """
import atexit, runpy, sys
def dump():
    for n, m in list(sys.modules.items()):
        if n.startswith("steadylm"):
            print("MODULE", n, getattr(m, "__file__", None) or "", file=sys.__stderr__)
atexit.register(dump)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@functools.cache
def training_path(*overrides: str) -> dict[str, int]:
    """The steadylm modules a real `python train.py` of three steps loads, with their line counts."""
    import subprocess
    import sys
    import tempfile

    from steadylm.data.prepare import prepare

    root = SRC.parent
    with tempfile.TemporaryDirectory() as tmp:
        prepare(input=None, out_dir=Path(tmp) / "data", max_bytes=100_000, val_fraction=0.05, progress=False)
        args = [f"data.dir={tmp}/data", "trainer.max_steps=3", f"hydra.run.dir={tmp}/run", *overrides]
        env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HOME": tmp}
        run = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" ", 2)[1:] for line in run.stderr.splitlines() if line.startswith("MODULE ")]
    return {m: len(Path(f).read_text().splitlines()) if f else 0 for m, f in rows}


def test_the_training_path_never_imports_the_tools():
    """`python train.py` loads the training code only: doctor, diagnose, export, generate, the offline eval
    runner and the sweep summary are tools that import the training path, never the other way round; fault
    injection and Muon load when a config asks for them."""
    modules = training_path()
    assert "steadylm.stability.step" in modules  # the probe saw the training path
    assert not [m for m in modules if m.startswith(TOOLS)], sorted(modules)


def test_the_training_path_fits_its_line_budget():
    lines = training_path()
    biggest = ", ".join(f"{m} {n}" for m, n in sorted(lines.items(), key=lambda kv: -kv[1])[:5])
    assert sum(lines.values()) <= TRAINING_PATH_LINES, f"{sum(lines.values())} lines; the largest: {biggest}"
    cut = training_path(*CUT)
    assert not [m for m in cut if m.endswith((".qk_clip", ".signals", ".stats", ".loss_scale"))], sorted(cut)
    assert sum(cut.values()) <= CUT_SUITE_LINES, f"{sum(cut.values())} lines with the suite cut to guard and spike"
