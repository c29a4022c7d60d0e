"""Structural checks on `src/phoenixft`, so the architecture cannot drift from what docs/architecture.md
says: no import cycles, the worker private to the runtime, the top level kept to the public surface,
no function over 100 lines, everything etcd-specific inside `controlplane/`, and fault kinds
dispatched in one place.

An import cycle is a cycle among imports that execute: at module level and inside functions (a lazy
import that closes a cycle still ties the two modules together). Imports under `if TYPE_CHECKING:`
never execute (they name types for annotations), so the cycle check leaves them out; the check that
the worker stays private counts them too.
"""

from __future__ import annotations

import ast
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = "phoenixft"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, typing_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import in the module (module level and inside functions); those under `if TYPE_CHECKING:`
    only when `typing_only`."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node) and not typing_only:
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph(typing_only: bool = False) -> dict[str, set[str]]:
    """Module -> the phoenixft modules it imports (`from pkg import mod` counts as mod); `typing_only`:
    with the imports made for annotations only."""
    files = {_module_name(p): p for p in (SRC / PKG).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), typing_only):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` loads a.b.c; a name from a module is that module
                    t = t.rpartition(".")[0]
                if t.startswith(PKG) and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a closed path), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_graph_sees_the_package() -> None:
    g = import_graph()
    assert "phoenixft.runtime.worker" in g
    assert "phoenixft.distributed.comm" in g["phoenixft.runtime.worker"]


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_worker_imported_only_by_runtime() -> None:
    outside = sorted(m for m, deps in import_graph(typing_only=True).items()
                     if "phoenixft.runtime.worker" in deps and not m.startswith("phoenixft.runtime"))
    assert not outside, f"modules outside phoenixft.runtime import the worker: {outside}"


PUBLIC_TOP_LEVEL = {"__init__", "__main__", "errors", "workload", "data"}


def test_top_level_keeps_only_the_public_surface() -> None:
    """The package's top holds what users import; every other module lives in a package named for its role."""
    top = {p.stem for p in (SRC / PKG).glob("*.py")}
    assert top <= PUBLIC_TOP_LEVEL, f"modules at the top of src/phoenixft beyond the public surface: " \
                                    f"{sorted(top - PUBLIC_TOP_LEVEL)}"
    assert len(top) <= 6


def test_no_function_over_100_lines() -> None:
    """Each function reads as one idea: none is longer than 100 lines."""
    long = []
    for path in sorted((SRC / PKG).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 100:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 100 lines:\n" + "\n".join(long)


_TEXT = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # (f-strings split from 3.12)


def _etcd_mentions(path: Path) -> list[tuple[str, bool]]:
    """(`file:line: text`, whether it is a string literal) for each token of `path` naming etcd."""
    found = []
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            if (tok.type in _TEXT or tok.type in (tokenize.NAME, tokenize.COMMENT)) and "etcd" in tok.string.lower():
                where = f"{path.relative_to(SRC)}:{tok.start[0]}: {tok.string.strip()[:80]}"
                found.append((where, tok.type in _TEXT))
    return found


# where the command line's own text lives: flag help and errors (cli/, config/), and the `--inject`
# grammar, whose `kill:etcd=I` names a member of the cluster the run started
FLAG_TEXT = ("cli/", "config/", "faults/spec.py", "faults/kinds.py")


def test_etcd_stays_inside_the_control_plane() -> None:
    """Everything etcd-specific lives in controlplane/; elsewhere the word appears only in text the command
    line shows a person (string literals of FLAG_TEXT): no code, name or comment elsewhere tests for it."""
    bad = []
    for path in sorted((SRC / PKG).rglob("*.py")):
        rel = path.relative_to(SRC / PKG).as_posix()
        if rel.startswith("controlplane/"):
            continue
        bad += [where for where, is_text in _etcd_mentions(path) if not (is_text and rel.startswith(FLAG_TEXT))]
    assert not bad, "etcd outside controlplane/:\n" + "\n".join(bad)


FAULT_KINDS = ("kill", "hang", "crash", "corrupt", "nan", "partition")


def _kind_tests(tree: ast.AST) -> list[int]:
    """Lines that dispatch on a fault kind's name: `x.kind == "kill"`, `x.kind in ("kill", ...)`, or
    `spec.startswith("kill:")`."""
    def names(node: ast.AST) -> list[str]:
        elts = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
            if any(n in FAULT_KINDS for c in node.comparators for n in names(c)):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            if any(n.split(":")[0] in FAULT_KINDS and ":" in n for a in node.args for n in names(a)):
                lines.append(node.lineno)
    return lines


def test_fault_kinds_are_dispatched_in_one_place() -> None:
    """Each fault kind's behaviour lives with the kind (faults/kinds.py, looked up through
    `FaultSpec.kind_of`); no module tests a kind's name to decide what to do."""
    bad = [f"{p.relative_to(SRC)}:{line}" for p in sorted((SRC / PKG).rglob("*.py"))
           if p.relative_to(SRC / PKG).as_posix() != "faults/kinds.py"
           for line in _kind_tests(ast.parse(p.read_text(), str(p)))]
    assert not bad, "fault-kind dispatch outside faults/kinds.py:\n" + "\n".join(bad)


def test_kind_dispatch_check_sees_a_test() -> None:
    tree = ast.parse('if f.kind == "kill": pass\nif spec.startswith(("corrupt:", "x")): pass\nif d.kind == "cpu": pass')
    assert _kind_tests(tree) == [1, 2]
