"""The architecture the tree states, checked: dependencies point one way.

    protocol -> host -> engine -> contract <- default_plugins

The contract is what a plugin may use: `kinfer_rpc` itself (hookimpl, the version),
`kinfer_rpc.types`, `kinfer_rpc.hookspecs` and `kinfer_rpc.errors`. A layer may import the layer
right below it and the contract, never one above and never past the next (the protocol reaches
the engine only through the host, which owns the requests); the built-in plugins import only the contract and each
other, as a third-party plugin would. The client library speaks the protocol from outside: it shares
the framing (bytes <-> messages) and imports nothing else of the server; the `kinfer` CLI
(the `cli/` and `terminal/` packages), a tool on top of everything, may import any of it, as
may the adapters for other tools (`kinfer_rpc.integrations`: LangChain's chat model, the `llm`
plugin).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kinfer_rpc"
CONTRACT = {"kinfer_rpc", "kinfer_rpc.types", "kinfer_rpc.hookspecs", "kinfer_rpc.errors"}
RANK = {"kinfer_rpc.engine": 1, "kinfer_rpc.host": 2, "kinfer_rpc.protocol": 3}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every kinfer_rpc module `path` imports, relative imports resolved."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod where one exists
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append(
                    (
                        node.lineno,
                        sub
                        if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                        else base,
                    )
                )
    return [(line, m) for line, m in found if m == "kinfer_rpc" or m.startswith("kinfer_rpc.")]


def _layer(module: str) -> str:
    if module.startswith(("kinfer_rpc.terminal", "kinfer_rpc.cli.")) or module == "kinfer_rpc.cli":
        return "kinfer_rpc.cli"  # the `kinfer` command's own modules
    if module == "kinfer_rpc.client" or module.startswith("kinfer_rpc.client."):
        return "kinfer_rpc.client"  # the Python client's own modules
    if module == "kinfer_rpc.integrations" or module.startswith("kinfer_rpc.integrations."):
        return "kinfer_rpc.integrations"  # adapters for other tools: clients on top, as the CLI is
    for prefix in ("kinfer_rpc.protocol", "kinfer_rpc.host", "kinfer_rpc.engine", "kinfer_rpc.default_plugins"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return module if module in CONTRACT else module  # client, cli, __main__: themselves


def _allowed(importer: str, imported: str) -> bool:
    src, dst = _layer(importer), _layer(imported)
    if dst in CONTRACT or src == dst:
        return True
    if src in ("kinfer_rpc.cli", "kinfer_rpc.__main__", "kinfer_rpc.integrations"):
        return True
    if src == "kinfer_rpc.client" and imported == "kinfer_rpc.protocol.framing":
        return True
    if src in CONTRACT or src in ("kinfer_rpc.client", "kinfer_rpc.default_plugins"):
        return False
    return src in RANK and dst in RANK and RANK[dst] == RANK[src] - 1


def test_every_import_points_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        for line, imported in _imports(path):
            if not _allowed(me, imported):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} {me} imports {imported}")
    assert wrong == []


def test_the_check_catches_an_import_against_the_direction():
    assert not _allowed("kinfer_rpc.engine.scheduler", "kinfer_rpc.host.store")
    assert not _allowed("kinfer_rpc.host.store", "kinfer_rpc.protocol.params")
    assert not _allowed("kinfer_rpc.default_plugins.llama", "kinfer_rpc.engine.scheduler")
    assert not _allowed("kinfer_rpc.types", "kinfer_rpc.engine.slots")
    assert not _allowed("kinfer_rpc.protocol.handlers", "kinfer_rpc.engine.scheduler")
    assert not _allowed("kinfer_rpc.client", "kinfer_rpc.host.runtime")
    assert not _allowed("kinfer_rpc.client", "kinfer_rpc.protocol.server")
    assert _allowed("kinfer_rpc.client", "kinfer_rpc.protocol.framing")
    assert _allowed("kinfer_rpc.protocol.server", "kinfer_rpc.host.runtime")
    assert _allowed("kinfer_rpc.host.runtime", "kinfer_rpc.engine.scheduler")
    assert _allowed("kinfer_rpc.default_plugins.llama.mtp", "kinfer_rpc.default_plugins.llama.batch")
    assert _allowed("kinfer_rpc.terminal.config", "kinfer_rpc.terminal.options")
    assert _allowed("kinfer_rpc.cli", "kinfer_rpc.terminal.wrap")
    assert not _allowed("kinfer_rpc.host.store", "kinfer_rpc.terminal.options")


def _graph() -> dict[str, set[str]]:
    """Every kinfer_rpc module -> the kinfer_rpc modules it imports (type-only imports too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        graph.setdefault(me, set()).update(m for _, m in _imports(path) if m != me)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No module reaches itself through imports, at run time or in type checking."""
    assert _circles(_graph()) == []


def test_the_circle_check_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
