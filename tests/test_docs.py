"""README.md and docs/ cannot drift from the code: what they name must exist, and what they draw must parse.

What is checked, and the convention that decides what counts as what:

- **Commands** (lines of fenced `bash` blocks, and inline code that starts with `python ` or `make `):
  `python -m steadylm.X` must be a module of `src/steadylm` that runs as a script (a file with a `__main__`
  guard, or a package with `__main__.py`); `python <file>` and `benchmarks/...` must be files of the tree;
  `make T` must be a target of the Makefile. Their `key=value` overrides are checked as config keys (below).
  Nothing is run: `tests/test_readme.py` composes the README's commands in full.
- **Config keys**: an inline-code token `a.b...` (or the key of an `a.b...=value` override) whose first segment is
  a config group (`model`, `data`, `optim`, `trainer`, `callbacks`, `logger`, `paths`, `hydra`, `probe`) must be a
  key, leaf or node, of one of the composed configs: train.py's (default, `optim=muon`, `logger=many`, `data=hf_stream`), doctor's
  and prepare's, the other commands' files, and `conf/hydra/launcher/slurm.yaml` under `hydra.launcher`. A group
  choice `group=value` (`model=small`, `experiment=divergence/lr_spike`) must name a file under `conf/`. Tokens
  with a `+` (an addition), `*` or `<...>` (a pattern) are not keys. Keys that are not dotted (`seed`, `resume`)
  are checked only in overrides and default tables.
- **Code paths**: an inline-code token whose first path component is a top-level file or folder of the
  repository (`src/`, `conf/`, `tests/`, `benchmarks/`, `Makefile`, ...) must exist; `steadylm.a.b.Name` must be
  a module of `src/steadylm`, and `Name` defined at its top level. Run-folder paths (`stability/events.jsonl`)
  and data paths (`data/...`) are not files of the tree and are not checked.
- **Defaults**: in a table with a `default` column whose first cell names config keys (or config groups), the
  stated default must be the composed config's, and so must a default written in prose right after its key,
  `key` (value) (`check_defaults`; cells and parentheses that are prose, such as `optim.lr × 0.1`, are skipped).
- **Layout**: the names in the README's layout block exist (top-level lines from the root, indented ones in
  `src/steadylm/`).
- **Links**: every relative Markdown link or image must reach a file, and a `#anchor` a heading of it (GitHub's
  slug rule); so must every `docs/<page>.md#anchor` written as text.
- **Diagrams**: every `mermaid` block must pass `check_mermaid`, a structural check of the flowchart subset these
  docs use. It is not Mermaid's parser: it catches an unknown diagram type, unbalanced brackets, an unquoted label
  with characters that are (or may be) Mermaid syntax, an edge to a node never labelled, arrows without spaces and
  reserved ids; not every error Mermaid could raise, and it is stricter than Mermaid in places (no `;` in an
  unquoted label, every node labelled).
- **Mistakes shown on purpose** (`MISTAKES`, e.g. `model=huge`) and file names (`model.safetensors`) are not keys.
- **Sizes and tone**: README ≤ 180 lines, each docs/ page ≤ 350; no run history.
"""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from steadylm.config import compose

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
README = ROOT / "README.md"
PAGES = [README, *DOCS]
GROUPS = ("model", "data", "optim", "trainer", "callbacks", "logger", "paths", "hydra", "probe")
FILE_SUFFIX = re.compile(r"\.(safetensors|json|jsonl|ckpt|yaml|py|h5|md|png|txt|parquet|gz|zst|log|bin|sh)$")
# Refused input the docs show on purpose, as examples of a mistake and its one-line error.
MISTAKES = {"model=huge", "trainer.max_stepz=3"}
TREE = {"README.md", "LICENSE", "Makefile", "pyproject.toml", "train.py", ".ci"} | {
    p.name
    for p in ROOT.iterdir()
    if p.is_dir() and p.name in ("conf", "src", "tests", "benchmarks", "docs", "notebooks")
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", text)


def fenced(text: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if kind == lang]


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


# -- what exists ---------------------------------------------------------------------------------------------------
def _values(node, prefix: str = "") -> dict[str, object]:
    """Every key (leaf or node) under `node` -> its raw value (interpolations unresolved)."""
    container = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig | ListConfig) else node
    out: dict[str, object] = {}
    if isinstance(container, dict):
        for k, v in container.items():
            out[f"{prefix}{k}"] = v
            out.update({key: val for key, val in _values(v, f"{prefix}{k}.").items() if key not in out})
    return out


@cache
def config_values() -> dict[str, object]:
    """Every key of the configs a user's overrides reach -> its default (train.py's default config first)."""
    values: dict[str, object] = {}
    overrides = [[], ["optim=muon", "logger=many"], ["data=hf_stream"], ["trainer=fsdp"]]
    sources = [compose(o, config_name="train") for o in overrides]
    sources += [compose([], config_name=n) for n in ("doctor", "prepare")]
    own = ("generate", "export", "diagnose", "window", "eval", "eval_fetch")
    sources += [OmegaConf.load(ROOT / "conf" / f"{n}.yaml") for n in own]
    for source in sources:
        values.update({k: v for k, v in _values(source).items() if k not in values})
    # The launchers' and Optuna's keys from their files: composing them needs the optional plugins.
    for launcher in ("slurm", "parallel"):
        keys = _values(OmegaConf.load(ROOT / "conf" / "hydra" / "launcher" / f"{launcher}.yaml"), "hydra.launcher.")
        values.update({k: v for k, v in keys.items() if k not in values})
    optuna = _values(OmegaConf.load(ROOT / "conf" / "hparams_search" / "lr_optuna.yaml"))  # global, optional plugin
    values.update({k: v for k, v in optuna.items() if k not in values})
    return values


@cache
def config_keys() -> frozenset[str]:
    return frozenset(config_values())


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def module_path(dotted: str) -> Path | None:
    """`steadylm.a.b` -> its file (a module, or a package's `__init__.py`), or None."""
    base = ROOT / "src" / Path(*dotted.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.ImportFrom | ast.Import):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
            if isinstance(node, ast.ImportFrom | ast.Import) and any((a.asname or a.name) == name for a in node.names):
                return True
    return False


# -- the checks, each returning what is wrong ------------------------------------------------------------------------
def check_key(token: str) -> str | None:
    """A config key or group choice (see the module docstring); None when fine or not a key."""
    if any(c in token for c in "+*<>{} ") or token.startswith("$") or token in MISTAKES or FILE_SUFFIX.search(token):
        return None
    token = token.lstrip("~")
    key, eq, value = token.partition("=")
    if "." not in key:
        if eq and key.replace("/", "") and (ROOT / "conf" / key).is_dir():
            if not re.fullmatch(r"[\w/.-]+", value):
                return None
            return None if (ROOT / "conf" / key / f"{value}.yaml").exists() else f"no config conf/{key}/{value}.yaml"
        return None
    if key.split(".")[0] not in GROUPS or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
        return None
    return None if key in config_keys() else f"no config key {key}"


def check_path(token: str) -> str | None:
    token = token.split(" ")[0].split("::")[0].rstrip(".,:)")
    if token.startswith("steadylm.") and re.fullmatch(r"[\w.]+", token):
        parts = token.split(".")
        for i in range(len(parts), 0, -1):
            path = module_path(".".join(parts[:i]))
            if path is not None:
                rest = parts[i:]
                ok = not rest or defines(path, rest[0])
                return None if ok else f"{token}: {rest[0]} is not defined in {path.relative_to(ROOT)}"
        return f"{token}: no such module"
    first = token.split("/")[0]
    if "/" not in token and token not in TREE or first not in TREE:
        return None
    fixed = re.split(r"[<*{]", token)[0]  # up to a placeholder or a glob
    fixed = fixed if fixed.endswith("/") or fixed == token else fixed.rsplit("/", 1)[0]
    return None if (ROOT / fixed).exists() else f"no file or folder {fixed}"


def check_command(line: str) -> list[str]:
    words = shlex.split(line.split("  #")[0].strip(), comments=True)
    if words and words[0] == "srun":
        words = words[1:]
    if not words:
        return []
    if words[0] == "make":
        target = next((w for w in words[1:] if "=" not in w and not w.startswith("-")), None)
        return [] if target is None or target in make_targets() else [f"no make target {target}"]
    if words[0].startswith("benchmarks/"):
        return [] if (ROOT / words[0]).exists() else [f"no file {words[0]}"]
    if words[0] != "python":
        return []
    problems = []
    args = words[1:]
    if args[:1] == ["-m"]:
        if not args[1].startswith("steadylm"):
            return []
        path = module_path(args[1])
        runnable = path is not None and (
            path.name == "__init__.py" and (path.parent / "__main__.py").exists() or "__main__" in path.read_text()
        )
        if not runnable:
            problems.append(f"python -m {args[1]}: no runnable module")
        args = args[2:]
    elif args and args[0].endswith(".py"):
        if not (ROOT / args[0]).exists():
            problems.append(f"no file {args[0]}")
        args = args[1:]
    for word in args:
        if "=" not in word or word.startswith(("-", "+")):
            continue
        key = word.split("=")[0].lstrip("~")
        if "." not in key and "/" not in key and not (ROOT / "conf" / key).is_dir():
            if key not in config_keys():
                problems.append(f"no config key {key}")
            continue
        problem = check_key(word)
        if problem:
            problems.append(problem)
    return problems


def table_rows(text: str):
    """(header cells, row cells) of every Markdown table outside fenced blocks; `\\|` inside a cell is kept."""
    for block in re.split(r"\n\s*\n", prose(text)):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("|")]
        split = [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip("|"))] for ln in lines]
        for row in split[2:]:
            yield split[0], row


def same_default(cell: str, raw) -> bool:
    """A table's default cell against the config's raw value: literals compared as values, `a.b` as `${a.b}`."""
    if isinstance(raw, str) and raw == "${" + cell + "}":
        return True
    if isinstance(raw, list):
        items = [c.strip() for c in cell.strip("[]").split(",")] if cell.startswith("[") else None
        return items is not None and len(items) == len(raw) and all(same_default(c, r) for c, r in zip(items, raw))
    if raw is None or isinstance(raw, bool):
        return cell == {None: "null", True: "true", False: "false"}[raw] or (raw is None and cell == "none")
    if isinstance(raw, int | float):
        try:
            return float(cell) == float(raw)
        except ValueError:
            return False
    return cell == str(raw)


def check_defaults(text: str) -> list[str]:
    """Rows of tables with a `default` column whose first cell names config keys (or the groups of
    `conf/train.yaml`'s defaults list): the stated default must be the config's. Cells that are prose (spaces,
    `<placeholders>`, arithmetic) are not compared."""
    groups = {}
    for entry in OmegaConf.load(ROOT / "conf" / "train.yaml").defaults:
        if isinstance(entry, DictConfig | dict):
            groups.update(dict(entry))
    problems = []
    for header, row in table_rows(text):
        if "default" not in header or len(row) != len(header):
            continue
        keys = re.findall(r"`([\w.]+)`", row[0])
        if not keys or re.sub(r"`[\w.]+`|[,\s]", "", row[0]):
            continue  # the first cell is not a plain list of keys
        cell = row[header.index("default")].replace("`", "")
        cells = [c.strip() for c in cell.split(", ")] if len(keys) > 1 and cell.count(", ") == len(keys) - 1 else None
        for i, key in enumerate(keys):
            value = cells[i] if cells else cell
            if " " in value or "<" in value or "×" in value:
                continue
            if header[0] == "group":
                stated = None if value == "none" else value
                if key in groups and groups[key] != stated:
                    problems.append(f"group {key}: the docs say {value}, conf/train.yaml {groups[key]}")
            elif key in config_values() and not same_default(value, config_values()[key]):
                problems.append(f"{key}: the docs say {value}, the config {config_values()[key]!r}")
    # In prose: "`callbacks.stability.spike.window` (128)", a key followed by its default in parentheses.
    for key, value in re.findall(r"`([\w.]+)` \(`?([\w.+-]+)`?\)", prose(text)):
        if key in config_values() and not same_default(value, config_values()[key]):
            problems.append(f"{key}: the docs say ({value}), the config {config_values()[key]!r}")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def check_link(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
        return f"link to a missing file: {target}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"link to a missing heading: {target}"
    return None


# -- Mermaid: the flowchart subset ----------------------------------------------------------------------------------
SHAPES = [("([", "])"), ("[(", ")]"), ("((", "))"), ("[[", "]]"), ("[", "]"), ("(", ")"), ("{", "}")]
EDGE = re.compile(r"^\s+(-->|---|-\.->|==>)(\|[^|]*\|)?\s+")
RESERVED = {"end", "subgraph", "graph", "flowchart", "style", "classDef", "class", "click", "linkStyle", "default"}
UNQUOTED_BAD = set('()[]{}|"<>;#')


def _node(text: str) -> tuple[str, str | None, str]:
    """One node at the start of `text` -> (id, label or None, rest). Raises ValueError."""
    m = re.match(r"[A-Za-z][\w]*", text)
    if not m:
        raise ValueError(f"expected a node id at {text!r}")
    node_id, rest = m.group(0), text[m.end() :]
    if node_id in RESERVED:
        raise ValueError(f"{node_id!r} is a reserved word, not a node id")
    for open_, close in SHAPES:
        if rest.startswith(open_):
            body = rest[len(open_) :]
            if body.startswith('"'):
                end = body.find('"', 1)
                if end < 0:
                    raise ValueError(f"unterminated quoted label in {text!r}")
                label, after = body[1:end], body[end + 1 :]
            else:
                end = body.find(close)
                label, after = (body[:end], body[end:]) if end >= 0 else (body, "")
                if UNQUOTED_BAD & set(label):
                    raise ValueError(f"unquoted label {label!r} has characters Mermaid reads as syntax")
            if not after.startswith(close):
                raise ValueError(f"label of {node_id} not closed with {close!r}: {text!r}")
            return node_id, label, after[len(close) :]
    return node_id, None, rest


def check_mermaid(source: str) -> list[str]:
    """Problems in one `mermaid` block of the subset described in the module docstring ([] when none)."""
    lines = [ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("%%")]
    if not lines or not re.fullmatch(r"(flowchart|graph) (TD|TB|BT|LR|RL)", lines[0]):
        return [f"the first line must be a flowchart type (e.g. 'flowchart TD'), not {lines[:1]}"]
    declared: set[str] = set()
    used: set[str] = set()
    problems, depth = [], 0
    for line in lines[1:]:
        if line.startswith("subgraph "):
            depth += 1
            continue
        if line == "end":
            depth -= 1
            if depth < 0:
                problems.append("'end' without a subgraph")
            continue
        try:
            node_id, label, rest = _node(line)
            (declared if label is not None else used).add(node_id)
            while rest.strip():
                m = EDGE.match(rest)
                if not m:
                    raise ValueError(f"expected ' --> ' (spaces around the arrow) in {line!r}, at {rest!r}")
                if m.group(2) and UNQUOTED_BAD & set(m.group(2)[1:-1]):
                    raise ValueError(f"edge label {m.group(2)!r} has characters Mermaid reads as syntax")
                node_id, label, rest = _node(rest[m.end() :])
                (declared if label is not None else used).add(node_id)
        except ValueError as err:
            problems.append(str(err))
    if depth:
        problems.append("a subgraph without 'end'")
    problems += [f"node {n} is used but never given a label" for n in sorted(used - declared)]
    return problems


# -- tests -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_command_key_and_path_a_page_names_exists(page):
    text = page.read_text()
    problems = []
    for body in fenced(text, "bash"):
        for line in body.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                problems += check_command(line)
    for token in inline_code(text):
        if token.startswith(("python ", "make ")):
            problems += check_command(token)
            continue
        for word in token.split():
            problems += [p for p in (check_key(word), check_path(word)) if p]
    assert not problems, f"{rel(page)}: " + "; ".join(sorted(set(problems)))


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_default_a_table_states_is_the_configs(page):
    problems = check_defaults(page.read_text())
    assert not problems, f"{rel(page)}: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_page_links_to_a_missing_file_or_heading(page):
    text = page.read_text()
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(text))
    problems = [p for t in targets if (p := check_link(page, t))]
    for mention in re.findall(r"(?<![\w/])(?<!\]\()(docs/[\w-]+\.md(?:#[\w-]+)?)", prose(text)):
        problems += [p for p in [check_link(ROOT / "README.md", mention)] if p]
    assert not problems, f"{rel(page)}: " + "; ".join(problems)


def test_the_readme_layout_names_files_that_exist():
    """The names column of the README's layout block: top-level lines from the root, indented ones in src/steadylm."""
    (layout,) = [b for b in fenced(README.read_text(), "") if "src/steadylm/" in b]
    missing = []
    for line in layout.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0] if line.strip() else ""
        if not names or line.startswith(" " * 4):  # a continuation line
            continue
        base = ROOT / "src" / "steadylm" if line.startswith("  ") else ROOT
        missing += [n for n in names.split() if not (base / n).exists()]
    assert not missing, missing


def test_every_diagram_parses_and_the_three_diagrams_exist():
    blocks = {rel(p): fenced(p.read_text(), "mermaid") for p in PAGES}
    for page, sources in blocks.items():
        for source in sources:
            assert not check_mermaid(source), f"{page}: {check_mermaid(source)}"
    assert blocks["docs/stability.md"] and blocks["docs/data.md"] and blocks["docs/diagnostics.md"]


def test_the_mermaid_check_catches_what_it_claims_to():
    good = 'flowchart LR\n    a["x (y)"] --> b{"z?"}\n    b -->|no| c(["done"])\n'
    assert check_mermaid(good) == []
    for bad in [
        "sequenceDiagram\n    a->>b: hi",  # not a flowchart
        "flowchart LR\n    a[x (y)] --> b[z]",  # unquoted parentheses
        'flowchart LR\n    a["x"] --> b',  # b never labelled
        'flowchart LR\n    a["x"]-->b["y"]',  # no spaces around the arrow
        'flowchart LR\n    a["x"] -->|p; q| b["y"]',  # stricter than Mermaid: no ';' in unquoted text
        'flowchart LR\n    end["x"] --> b["y"]',  # reserved id
        'flowchart LR\n    a["x" --> b["y"]',  # unbalanced
        'flowchart LR\n    subgraph s\n    a["x"]',  # unclosed subgraph
    ]:
        assert check_mermaid(bad), bad


def test_the_checks_reject_what_does_not_exist():
    assert check_key("optim.lr") is None and check_key("callbacks.stability.spike.sigma=5") is None
    assert check_key("optim.lrr") and check_key("model=enormous") and check_key("callbacks.stability.spike.sigmaa")
    assert check_path("src/steadylm/stability/step.py") is None and check_path("src/nothing.py")
    assert check_path("steadylm.checkpointing.AtomicCheckpointIO") is None and check_path("steadylm.nope")
    assert check_command("make demo") == [] and check_command("make nope")
    assert check_command("python -m steadylm.doctor lr_probe=false") == []
    assert check_command("python -m steadylm.nope") and check_command("python train.py optim.nope=1")
    assert check_link(ROOT / "README.md", "docs/stability.md#nothing-here")
    assert slug("Run status: ok, unstable, diverged") == "run-status-ok-unstable-diverged"


def test_sizes_and_no_run_history():
    lines = {rel(p): len(p.read_text().splitlines()) for p in PAGES}
    assert lines.pop("README.md") <= 180  # alarms with headroom, not targets for the prose
    assert max(lines.values()) <= 350, lines
    history = re.compile(
        r"session \d|this session|kept for the history|this machine|(before|after) the change|DESIGN\.md", re.I
    )
    found = [f"{rel(p)}: {m.group(0)}" for p in PAGES for m in history.finditer(p.read_text())]
    assert not found, found
