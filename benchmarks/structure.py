"""The shape of the tree, checked from outside: the targets of the redesign (one table), and the walk of one build.

    python benchmarks/structure.py                 # the targets table, read from the code (nothing is run)
    python benchmarks/structure.py --walk          # and the walk of one stories260K build through the files
    python benchmarks/structure.py --rooms         # and the import arrows between rooms (sub-packages)

What each row counts, over the non-test packages (optimizer, passes, runtime, calibration, kernels):
- format branches: comparisons (==, !=, in, not in, is) whose other side is a WeightFormat or KvFormat member or
  a weight format's name as a string literal ("fp8", "nvfp4", "dense", ...), outside kernels/<format>.py, kernels/registry.py and kernels/formats.py;
- import cycles: strongly connected components of the module graph over top-level imports, and over all imports;
- imports inside functions: every import statement nested in a def; "with a reason" when a comment holding
  `lazy:` stands on its line, or just above the run of consecutive inline imports it belongs to;
- config.json read for structure: outside the loader modules, a spec built from an artifact's config.json
  (`...spec(... "config.json")`) or the structure told by a key of it (`"kv_lora_rank" not in config`);
- the walk (`--walk`): a profile of `build()` on stories260K with the `fp8-weights` recipe and a small gate.
  Each first call from one of our functions into one of ours in another file is a step; "files entered" counts
  the distinct files, "climbs back up" the steps from a lower floor to a higher one (kernels < runtime,
  calibration < passes < optimizer), "returns" the steps into a file the walk had entered before and left.
"""
from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("optimizer", "passes", "runtime", "calibration", "kernels")
FLOORS = {"kernels": 0, "runtime": 1, "calibration": 1, "passes": 2, "optimizer": 3}
FORMAT_HOMES = {"kernels/registry.py", "kernels/formats.py", "kernels/fp8.py", "kernels/fp8_e5m2.py",
                "kernels/nvfp4.py", "kernels/mxfp4.py", "kernels/mxfp6.py", "kernels/dense.py", "kernels/kv_quant.py",
                "kernels/kv_codec.py", "kernels/kv_fp8.py", "kernels/kv_nvfp4.py"}
FORMAT_NAMES = {"fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4", "mxfp6", "dense", "int8"}
LOADERS = {"optimizer/loader.py", "optimizer/loader_config.py"}


def source_files(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "kiln." + ".".join(parts)


def _is_format_side(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in ("WeightFormat", "KvFormat")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in FORMAT_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_format_side(e) for e in node.elts)
    return False


def _is_mlp_kind(sides: list[ast.AST]) -> bool:
    """`m.kind == "dense"`: an MLP's kind (dense or MoE), not a number format."""
    return any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "dense" for s in sides)


def _imports(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = module if is_package else module.rsplit(".", 1)[0]
    if node.level:
        base = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1])
        base = base + ("." + node.module if node.module else "")
    else:
        base = node.module or ""
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            found.append(f"{base}.{alias.name}")
        elif base in known:
            found.append(base)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def measure(root: Path) -> dict:
    files = source_files(root)
    modules = {module_name(root, p): p for p in files}
    known = set(modules)
    top, every = collections.defaultdict(set), collections.defaultdict(set)
    sizes, long_functions, branches = [], [], []
    inline, unexplained, config_reads, module_lines = 0, [], [], {}
    for name, path in modules.items():
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        sizes.append((len(lines), rel))
        module_lines[name] = len(lines)
        is_package = path.name == "__init__.py"
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top[name].update(_imports(node, name, is_package, known))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                every[name].update(_imports(node, name, is_package, known))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > 80:
                    long_functions.append((span, f"{rel}:{node.name}"))
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        inline += 1
                        if not _has_reason(lines, inner):
                            unexplained.append(f"{rel}:{inner.lineno}")
            if isinstance(node, ast.Compare) and rel not in FORMAT_HOMES:
                sides = [node.left, *node.comparators]
                if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)) for op in node.ops) \
                        and any(_is_format_side(s) for s in sides) and not _is_mlp_kind(sides):
                    branches.append(f"{rel}:{node.lineno}")
        if rel not in LOADERS:
            for i, line in enumerate(lines, 1):
                if re.search(r"""spec\(.*["']config\.json["']|["'](kv_lora_rank|q_lora_rank|head_dim|num_\w+|\w+_size)["'] (not )?in config\b""", line):
                    config_reads.append(f"{rel}:{i}")
    sizes.sort(reverse=True)
    return {"files": len(files), "sizes": sizes, "long_functions": sorted(long_functions, reverse=True),
            "branches": branches, "cycles_top": _cycles(top), "cycles_all": _cycles(every), "inline": inline,
            "unexplained": unexplained, "config_reads": config_reads, "graph": every,
            "modules": module_lines}


def _has_reason(lines: list[str], node: ast.AST) -> bool:
    """A `lazy:` comment within the import statement, or in the comment lines just above the run of consecutive
    inline imports it belongs to."""
    if any("lazy:" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
        return True
    i = node.lineno - 1
    while i > 0 and (re.match(r"\s*(from \S+ )?import |\s+\w+,?\s*(#.*)?$|\s*\)", lines[i - 1])
                     and "lazy:" not in lines[i - 1]):
        i -= 1
    if i > 0 and "lazy:" in lines[i - 1]:
        return True
    while i > 0 and lines[i - 1].strip().startswith("#"):
        if "lazy:" in lines[i - 1]:
            return True
        i -= 1
    return False


def table(m: dict, root: Path) -> str:
    readme = len((root / "README.md").read_text().splitlines())
    over = [f"{rel} ({n})" for n, rel in m["sizes"] if n > 500]
    rows = [
        ("modules (non-test)", str(m["files"]), ""),
        ("branches on a format's name outside its module and the registry", str(len(m["branches"])), "<= 10"),
        ("import cycles among modules (top-level imports / all imports)",
         f"{len(m['cycles_top'])} / {len(m['cycles_all'])}", "0"),
        ("imports inside functions (without a `lazy:` reason)", f"{m['inline']} ({len(m['unexplained'])})",
         "each with a reason"),
        ("largest non-test file", f"{m['sizes'][0][0]} lines ({m['sizes'][0][1]})", "<= 500"),
        ("non-test files over 500 lines", str(len(over)), "0"),
        ("functions over 80 lines", str(len(m["long_functions"])), "0"),
        ("config.json read for structure outside the loader", str(len(m["config_reads"])), "0"),
        ("README.md", f"{readme} lines", "<= 150"),
    ]
    out = ["| what | now | target |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    details = [("files over 500 lines", over), ("functions over 80 lines",
                                                [f"{where} ({n})" for n, where in m["long_functions"]]),
               ("format branches", m["branches"]), ("cycles", [" <-> ".join(c) for c in m["cycles_all"]]),
               ("inline imports without a reason", m["unexplained"]), ("config.json reads", m["config_reads"])]
    for title, items in details:
        if items:
            out.append(f"\n{title}: " + ", ".join(items))
    return "\n".join(out)


def _room(module: str) -> str:
    parts = module.split(".")[1:]
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def room_arrows(m: dict) -> collections.Counter:
    """Import arrows between rooms (a sub-package, or a top-level package's own modules), with their counts."""
    arrows = collections.Counter()
    for src, targets in m["graph"].items():
        for dst in targets:
            if _room(src) != _room(dst):
                arrows[_room(src), _room(dst)] += 1
    return arrows


def draw_rooms(m: dict, path: Path, title: str) -> None:
    """The rooms as boxes by floor (top: optimizer), the arrows between them; an upward arrow is drawn red."""
    import matplotlib  # lazy: only --png draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: only --png draws

    arrows = room_arrows(m)
    sizes = collections.Counter()
    for module, file in ((k, v) for k, v in m["modules"].items()):
        sizes[_room(module)] += file
    by_floor = collections.defaultdict(list)
    for room in sorted(sizes):
        by_floor[FLOORS[room.split("/")[0]] + (0.5 if "/" in room else 0)].append(room)
    pos = {}
    for floor, rooms_here in by_floor.items():
        for i, room in enumerate(rooms_here):
            pos[room] = ((i + 0.5) / len(rooms_here), floor)
    fig, ax = plt.subplots(figsize=(12, 7))
    for (a, b), n in arrows.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        up = y1 > y0
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={
            "arrowstyle": "->", "color": "red" if up else "grey", "alpha": 0.8 if up else 0.35,
            "lw": 0.5 + min(n, 20) / 8})
    for room, (x, y) in pos.items():
        ax.text(x, y, f"{room}\n{sizes[room]} lines", ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round", "fc": "white", "ec": "black"})
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.5, 4.0)
    ax.set_yticks([0, 1, 2, 3], ["kernels", "runtime | calibration", "passes", "optimizer"])
    ax.set_xticks([])
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rooms(m: dict) -> str:
    arrows = room_arrows(m)
    lines = ["| from | to | imports |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {n} |" for (a, b), n in sorted(arrows.items())]
    return "\n".join(lines)


def walk(root: Path) -> str:
    """Profile one stories260K build and count the files it enters, its climbs and its returns."""
    import os  # lazy: only --walk builds a model
    import tempfile  # lazy: only --walk builds a model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kiln.optimizer.build import build  # lazy: only --walk builds a model

    shared = ROOT.parent / "shared"
    ours = {str(root / pkg) for pkg in PACKAGES}
    steps, seen = [], set()

    @functools.cache
    def rel(filename: str) -> str | None:
        path = Path(filename).resolve()
        return path.relative_to(root).as_posix() if any(str(path).startswith(p) for p in ours) else None

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = rel(frame.f_code.co_filename)
        caller_frame = frame.f_back
        while caller_frame is not None and rel(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back
        if callee is None or caller_frame is None:
            return
        caller = rel(caller_frame.f_code.co_filename)
        edge = (caller, caller_frame.f_code.co_name, callee, frame.f_code.co_name)
        if caller != callee and edge not in seen:
            seen.add(edge)
            steps.append((caller, callee))

    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(profile)
        try:
            build(shared / "models" / "stories260K", "hopper", "fp8-weights", Path(tmp) / "a",
                  eval_data=shared / "data" / "tinystories" / "evaluation.txt", paragraphs=20, reproducible=True)
        finally:
            sys.setprofile(None)
    files = _walk_counts(steps, lambda f: f)
    rooms_ = _walk_counts(steps, lambda f: _room("kiln." + f[:-3].replace("/", ".")))
    up = collections.Counter((a, b) for a, b in rooms_["climb_pairs"])
    return (f"walk of one build (stories260K, fp8-weights, 20-paragraph gate): {len(steps)} cross-file steps; "
            f"files: {files['entered']} entered, {files['climbs']} climbs back up, {files['returns']} returns to a "
            f"file it had left; rooms: {rooms_['entered']} entered, {rooms_['moves']} moves between rooms, "
            f"{rooms_['climbs']} climbs back up, {rooms_['returns']} returns to a room it had left\n"
            "climbs by room: " + ", ".join(f"{a} -> {b} ({n})" for (a, b), n in up.most_common()))


def _walk_counts(steps: list[tuple[str, str]], place) -> dict:
    """Places entered, moves between places, climbs (to a higher floor) and returns (to a place left before)
    along the steps, each step's files mapped to a place (a file, or its room)."""
    entered, left, current = set(), set(), None
    moves = climbs = returns = 0
    pairs = []
    for caller, callee in steps:
        a, b = place(caller), place(callee)
        entered.update((a, b))
        if a == b:
            continue
        moves += 1
        if FLOORS[callee.split("/")[0]] > FLOORS[caller.split("/")[0]]:
            climbs += 1
            pairs.append((a, b))
        if b in left:
            returns += 1
        if current is not None and current != b:
            left.add(current)
        current = b
    return {"entered": len(entered), "moves": moves, "climbs": climbs, "returns": returns, "climb_pairs": pairs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--walk", action="store_true", help="also profile one stories260K build")
    parser.add_argument("--rooms", action="store_true", help="also list import arrows between rooms")
    parser.add_argument("--json", type=Path, help="write the counts as JSON here")
    parser.add_argument("--png", type=Path, help="draw the rooms and their import arrows to this PNG")
    args = parser.parse_args()
    m = measure(args.root.resolve())
    print(table(m, args.root))
    if args.rooms:
        print("\n" + rooms(m))
    if args.png:
        draw_rooms(m, args.png, f"import arrows between rooms: {args.root.resolve().name}")
    if args.walk:
        print("\n" + walk(args.root.resolve()))
    if args.json:
        keep = {k: v for k, v in m.items() if k not in ("graph", "modules")}
        args.json.write_text(json.dumps(keep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
