"""The package's architecture, read from its code: folders, import graph, circles, private names, long functions.

    python scripts/architecture.py            # print the figures
    python scripts/architecture.py --write    # regenerate docs/architecture.md
    python scripts/architecture.py --check    # fail if docs/architecture.md is stale or a rule is broken

The rules it checks (tests/test_architecture.py runs --check's function, so CI fails on a breach):
- no import circle among midlayer's modules, counting function-local imports too;
- no subpackage imports one that sits above it in LAYERS;
- no private name (`_x`, not dunder) imported from, or read off, another midlayer module;
- a function-local import of a midlayer module says why (a comment containing "start-up" on its line or the
  line above): the rest move to the top of the file;
- no function longer than MAX_LINES unless its docstring has a line starting "Long:" that says why.
Only the standard library is used, so it runs before the package's dependencies are installed.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "midlayer"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 80

# The layers, bottom first: a module may import from its own layer or any layer listed before it.
# Top-level modules are their own layer (common, output_lock, compat, config, cli, __main__).
# Modules whose bytes are a recorded version (their sha256 is checked against committed data): they keep the
# layout they were recorded with, function-local imports included.
FROZEN = {"midlayer.data.prompt_recipe": "its sha256 is the committed scaled prompt set's recipe version "
                                         "(prompt_recipe.recipe_hash); an edit means regenerating that set"}

LAYERS = ["common", "output_lock", "compat", "ops", "data", "config", "model", "train", "engine", "speculative",
          "api", "server", "experiments", "commands", "cli", "__main__"]


@dataclass
class Module:
    name: str                      # midlayer.model.attention
    path: Path
    lines: int
    doc: str
    imports: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)  # target -> [(line, local)]
    private: list[str] = field(default_factory=list)     # "line: name from module"
    unexplained_local: list[str] = field(default_factory=list)
    long_functions: list[tuple[str, int, bool]] = field(default_factory=list)  # (qualname, lines, explained)


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.path.name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_local_reason(lines: list[str], lineno: int) -> bool:
    here = lines[lineno - 1]
    above = lines[lineno - 2] if lineno >= 2 else ""
    return "start-up" in here or "start-up" in above


def scan(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Module]:
    """Every module of `root/package`, with its imports of sibling modules (local ones marked), the private
    names it takes from them, its unexplained function-local imports and its long functions."""
    files = sorted((root / package).rglob("*.py"))
    mods: dict[str, Module] = {}
    for f in files:
        text = f.read_text()
        tree = ast.parse(text)
        mods[module_name(f, root)] = Module(module_name(f, root), f, len(text.splitlines()), ast.get_docstring(tree) or "")
    names = set(mods)
    for mod in mods.values():
        text = mod.path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        aliases: dict[str, str] = {}       # local name -> midlayer module it is bound to

        def visit(node: ast.AST, local: bool, qual: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    q = f"{qual}.{child.name}" if qual else child.name
                    n = (child.end_lineno or child.lineno) - child.lineno + 1
                    if n > MAX_LINES:
                        doc = ast.get_docstring(child) or ""
                        explained = any(line.strip().startswith("Long:") for line in doc.splitlines())
                        mod.long_functions.append((q, n, explained))
                    visit(child, True, q)
                    continue
                if isinstance(child, ast.ClassDef):
                    visit(child, local, f"{qual}.{child.name}" if qual else child.name)
                    continue
                targets: list[tuple[str, str | None]] = []
                if isinstance(child, ast.Import):
                    for a in child.names:
                        if a.name.split(".")[0] == package:
                            targets.append((a.name, None))
                            if a.asname:
                                aliases[a.asname] = a.name
                elif isinstance(child, ast.ImportFrom):
                    src = _resolve(mod, child)
                    if src.split(".")[0] == package:
                        for a in child.names:
                            sub = f"{src}.{a.name}"
                            if sub in names:
                                targets.append((sub, None))
                                aliases[a.asname or a.name] = sub
                            else:
                                targets.append((src, a.name))
                if (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                        and getattr(child.func, "attr", getattr(child.func, "id", "")) == "import_module"
                        and child.args and isinstance(child.args[0], ast.Constant)
                        and str(child.args[0].value).split(".")[0] == package):
                    targets.append((str(child.args[0].value), None))  # importlib.import_module("midlayer.x")
                for target, name in targets:
                    if target not in names:
                        continue
                    if target != mod.name:
                        mod.imports.setdefault(target, []).append((child.lineno, local))
                        if local and not _is_local_reason(lines, child.lineno) and mod.name not in FROZEN:
                            mod.unexplained_local.append(f"{child.lineno}: {target}")
                    if name and name.startswith("_") and not name.startswith("__"):
                        mod.private.append(f"{child.lineno}: {name} from {target}")
                visit(child, local, qual)

        visit(tree, False, "")
        # private attributes read off an imported midlayer module: kernels._lib
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")):
                mod.private.append(f"{node.lineno}: {node.attr} of {aliases[node.value.id]}")
    return mods


def circles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over every import, local ones too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in mods[v].imports:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            strong(v)
    return out


def levels(mods: dict[str, Module]) -> dict[str, int]:
    """Import depth: 0 for a module importing no sibling, else 1 + the deepest import (circles cut)."""
    depth: dict[str, int] = {}
    busy: set[str] = set()

    def d(v: str) -> int:
        if v in depth:
            return depth[v]
        busy.add(v)
        deps = [d(w) for w in mods[v].imports if w not in busy]
        busy.discard(v)
        depth[v] = 1 + max(deps) if deps else 0
        return depth[v]

    for v in mods:
        d(v)
    return depth


def upward(mods: dict[str, Module]) -> list[str]:
    """Imports from a lower layer into a higher one (LAYERS order), or into an unknown layer."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for m in mods.values():
        a = layer_of(m.name)
        for t in m.imports:
            b = layer_of(t)
            if a == "__init__" or a == b:
                continue
            if a not in rank or b not in rank:
                bad.append(f"{m.name} -> {t} (layer not in LAYERS)")
            elif rank[b] > rank[a]:
                bad.append(f"{m.name} -> {t}")
    return bad


def figures(mods: dict[str, Module]) -> dict[str, object]:
    per_folder: dict[str, int] = defaultdict(int)
    for m in mods.values():
        per_folder[str(m.path.parent.relative_to(ROOT))] += 1
    edges = sum(len(m.imports) for m in mods.values())
    local = sum(1 for m in mods.values() for uses in m.imports.values() for _, loc in uses if loc)
    longest = sorted(((n, f"{m.name}.{q}") for m in mods.values() for q, n, _ in m.long_functions), reverse=True)
    return {
        "modules": len(mods),
        "lines": sum(m.lines for m in mods.values()),
        "modules per folder": dict(sorted(per_folder.items())),
        "import edges": edges,
        "import levels": max(levels(mods).values()) + 1,
        "circles": circles(mods),
        "function-local imports of midlayer modules": local,
        f"functions over {MAX_LINES} lines": len(longest),
        "longest functions": longest[:8],
    }


def problems(mods: dict[str, Module]) -> list[str]:
    out = [f"import circle: {' <-> '.join(c)}" for c in circles(mods)]
    out += [f"import goes up a layer: {e}" for e in upward(mods)]
    for m in mods.values():
        out += [f"private name crosses modules: {m.name}:{p}" for p in m.private]
        out += [f"function-local import without a start-up reason: {m.name}:{p}" for p in m.unexplained_local]
        out += [f"function over {MAX_LINES} lines without a 'Long:' reason: {m.name}.{q} ({n} lines)"
                for q, n, ok in m.long_functions if not ok]
    return out


def summary(doc: str) -> str:
    """A docstring's first sentence (its first paragraph up to the first full stop)."""
    para = " ".join((doc.strip().split("\n\n") or [""])[0].split())
    if not para:
        return "(no docstring)"
    # a full stop ends the sentence unless it ends an abbreviation (eq. 3, sec. 2, et al., e.g., vs.)
    m = re.search(r"(?<!\beq)(?<!\beqs)(?<!\bsec)(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.\s+(?=[A-Z`*(])", para)
    return para if m is None else para[:m.start() + 1]


def render(mods: dict[str, Module]) -> str:
    """docs/architecture.md: the tree, one paragraph per subpackage, and the subpackage import graph."""
    packages = sorted({layer_of(m) for m in mods if m.count(".") >= 1 and (ROOT / PACKAGE / layer_of(m)).is_dir()},
                      key=lambda p: LAYERS.index(p) if p in LAYERS else len(LAYERS))
    top = sorted(m for m in mods if m.count(".") == 1 and not (ROOT / PACKAGE / layer_of(m)).is_dir())
    out = ["# Architecture", "",
           "Generated by `python scripts/architecture.py --write` from the code; `tests/test_architecture.py` fails",
           "when this file is stale or when a rule below is broken. Do not edit by hand.", "",
           "Rules the test enforces: no import circle (function-local imports count); a subpackage imports only",
           "from the layers below it in this order: " + " < ".join(f"`{x}`" for x in LAYERS) + ";",
           "no private name crosses a module boundary; a function-local import of a sibling says why (start-up",
           f"time); no function over {MAX_LINES} lines without a `Long:` line in its docstring saying why.", "",
           "## Import graph between subpackages", "",
           "An arrow `a --> b` means some module in `a` imports one in `b`; the number is how many module pairs.",
           "", "```mermaid", "flowchart TD"]
    pair: dict[tuple[str, str], int] = defaultdict(int)
    for m in mods.values():
        for t in m.imports:
            a, b = layer_of(m.name), layer_of(t)
            if a != b and a != "__init__":
                pair[(a, b)] += 1
    for (a, b), n in sorted(pair.items()):
        out.append(f"    {a.strip('_')} -->|{n}| {b.strip('_')}")
    out += ["```", "", "## Subpackages", ""]
    for p in packages:
        init = mods[f"{PACKAGE}.{p}"]
        members = sorted(m for m in mods if m.startswith(f"{PACKAGE}.{p}."))
        deps = sorted({layer_of(t) for m in members + [init.name] for t in mods[m].imports} - {p})
        out += [f"### `{PACKAGE}/{p}/`", "", init.doc.strip() or "(no docstring)", "",
                "Imports from: " + (", ".join(f"`{d}`" for d in deps) if deps else "nothing in midlayer") + ".", ""]
        for m in members:
            out.append(f"- `{m.split('.', 2)[2]}` ({mods[m].lines} lines): {summary(mods[m].doc)}")
        out.append("")
    out += ["## Top-level modules", ""]
    for m in top:
        out.append(f"- `{m.split('.', 1)[1]}` ({mods[m].lines} lines): {summary(mods[m].doc)}")
    out += ["", "## The command line", "", "`midlayer/cli.py`'s `COMMANDS` table: each subcommand and the module that "
            "defines it.", "", "| subcommand | module |", "|---|---|"]
    out += [f"| `midlayer {name}` | `{module}` |" for name, module in cli_table()]
    out += ["", "## Investigation scripts (`benchmarks/`)", "",
            "One-off measurements behind a write-up, run as `python benchmarks/NAME.py` (the benchmarks users run "
            "are `midlayer bench ...`). What each measured, and where the result is written up:", "",
            "| script | what it measures | written up in |", "|---|---|---|"]
    for name, what, where in benchmark_scripts():
        out.append(f"| `{name}` | {what} | {where} |")
    f = figures(mods)
    out += ["", "## Figures", ""]
    for k in ("modules", "lines", "import edges", "import levels", "function-local imports of midlayer modules",
              f"functions over {MAX_LINES} lines"):
        out.append(f"- {k}: {f[k]}")
    out.append(f"- circles: {len(f['circles'])}")
    out.append("- modules per folder: " + ", ".join(f"`{k}` {v}" for k, v in f["modules per folder"].items()))
    return "\n".join(out) + "\n"


def benchmark_scripts(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(script, its docstring's first sentence, the first docs/*.md its docstring names) per benchmarks/*.py."""
    rows = []
    for path in sorted((root / "benchmarks").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        flat = " ".join(doc.split()).replace("docs/results/ ", "docs/results/")
        where = re.findall(r"docs/(?:results/)?[\w\-]+\.md", flat)
        rows.append((path.name, summary(doc).replace("|", "\\|"), f"`{where[0]}`" if where else "-"))
    return rows


def cli_table(root: Path = ROOT) -> list[tuple[str, str]]:
    """(subcommand, module) pairs of cli.COMMANDS, read from the source: {"train": (training.add_train, ...)}."""
    tree = ast.parse((root / PACKAGE / "cli.py").read_text())
    imported = {a.asname or a.name: f"{n.module}.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom)
                for a in n.names}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "COMMANDS":
            return [(k.value, imported[v.elts[0].value.id]) for k, v in zip(node.value.keys, node.value.values)]
    raise ValueError("cli.py has no COMMANDS table")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="regenerate docs/architecture.md")
    ap.add_argument("--check", action="store_true", help="fail on a broken rule or a stale docs/architecture.md")
    args = ap.parse_args(argv)
    mods = scan()
    if args.write:
        DOC.write_text(render(mods))
        print(f"wrote {DOC.relative_to(ROOT)}")
    if args.check:
        bad = problems(mods)
        if not DOC.exists() or DOC.read_text() != render(mods):
            bad.append(f"{DOC.relative_to(ROOT)} is stale: run python scripts/architecture.py --write")
        for b in bad:
            print(b)
        return 1 if bad else 0
    if not args.write:
        for k, v in figures(mods).items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
