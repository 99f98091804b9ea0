"""The house as its code stands: rooms (packages), their lines, the imports between them, and the
functions that break the house rules (over 60 lines, over 8 parameters).

    python -m benchmarks.house            # this checkout
    python -m benchmarks.house --json F   # also as JSON

Read from the source alone (nothing is imported), so it runs on any commit: check one out into
a temporary folder and point `--root` at it to compare before and after.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINES = 60
MAX_PARAMS = 8
# The torch twins of the CPU kernels' bindings keep the kernels' signatures (dflash_kernels/cpu.cpp).
KERNEL_BINDINGS = ("target_node/engine/torch_ops.py",)
SKIP = {"tests", "build", "data", "docs"}


@dataclass
class House:
    rooms: Counter = field(default_factory=Counter)  # room -> lines
    modules: Counter = field(default_factory=Counter)  # room -> modules
    arrows: Counter = field(default_factory=Counter)  # (room, room) -> imports
    long: list[str] = field(default_factory=list)
    wide: list[str] = field(default_factory=list)
    inner_imports: int = 0  # imports inside functions
    cycles: list[tuple[str, str]] = field(default_factory=list)  # module pairs importing each other


def room_of(module: str) -> str:
    """A package, or a target_node subpackage: the floors a reader walks."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "target_node" and len(parts) > 2 else parts[0]


def sources(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or len(rel.parts) < 2:
            continue
        found[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def read(root: Path) -> House:
    house, modules = House(), sources(root)
    imports: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        room = room_of(module)
        house.rooms[room] += len(path.read_text().splitlines())
        house.modules[room] += 1
        imports[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                _judge(house, path.relative_to(root).as_posix(), node)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imports[module].add(node.module)
            elif isinstance(node, ast.Import):
                imports[module].update(alias.name for alias in node.names)
    for module, targets in imports.items():
        for target in targets:
            if target in modules and room_of(target) != room_of(module):
                house.arrows[(room_of(module), room_of(target))] += 1
            if target in modules and module in imports.get(target, ()) and module < target:
                house.cycles.append((module, target))
    return house


def _judge(house: House, path: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    args = node.args
    params = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    params -= 1 if args.args and args.args[0].arg in ("self", "cls") else 0
    lines = node.end_lineno - node.lineno + 1
    if lines > MAX_LINES:
        house.long.append(f"{path}:{node.name} ({lines} lines)")
    if params > MAX_PARAMS and path not in KERNEL_BINDINGS:
        house.wide.append(f"{path}:{node.name} ({params} parameters)")
    house.inner_imports += sum(
        isinstance(inner, (ast.Import, ast.ImportFrom)) for stmt in node.body for inner in ast.walk(stmt)
    )


def report(house: House) -> dict:
    return {
        "rooms": {room: {"modules": house.modules[room], "lines": house.rooms[room]} for room in sorted(house.rooms)},
        "lines": sum(house.rooms.values()),
        "arrows": [f"{a} -> {b} ({n})" for (a, b), n in sorted(house.arrows.items())],
        "imports between rooms": sum(house.arrows.values()),
        "import cycles": [" <-> ".join(pair) for pair in house.cycles],
        "imports inside functions": house.inner_imports,
        f"functions over {MAX_LINES} lines": house.long,
        f"functions over {MAX_PARAMS} parameters": house.wide,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.house", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=".", help="the checkout to read (default: here)")
    parser.add_argument("--json", help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    figures = report(read(Path(args.root)))
    for room, size in figures["rooms"].items():
        print(f"{room:24} {size['modules']:3} modules {size['lines']:6} lines")
    for key, value in figures.items():
        if key != "rooms":
            print(f"{key}: {value if not isinstance(value, list) else len(value)}")
            for item in value if isinstance(value, list) else ():
                print(f"  {item}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
