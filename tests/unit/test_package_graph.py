"""The package graph of services/ stays acyclic: common imports nothing outside common, no
service imports another (the worker may use the cache's client API), and no packages import
each other in a cycle. Every import counts, including ones inside functions.

The top-level modules (`services/config.py`, `services/entrypoint.py`) are the composition
root: they assemble every service's config sections, and services load their config through
them, so they are not packages of the graph; common must not import them either."""

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
# Packages that run as their own process.
SERVICE_PACKAGES = {"router", "worker", "cache", "backfill"}
# The one import allowed between services: the worker saves and restores KV through the cache's client.
ALLOWED = {("worker", "cache")}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            # `from services import config` names a module, not a symbol.
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def package_graph(root: Path = SERVICES, with_modules: bool = False) -> dict[str, set[str]]:
    """services/ package -> the packages it imports (and the top-level modules, `with_modules`)."""
    units = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    targets = units | ({p.stem for p in root.glob("*.py") if p.stem != "__init__"} if with_modules else set())
    graph: dict[str, set[str]] = {unit: set() for unit in units}
    for path in root.rglob("*.py"):
        source = path.relative_to(root).parts[0].removesuffix(".py")
        if source not in graph:
            continue
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] in targets and parts[1] != source:
                graph[source].add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk, as the path that closes it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_common_imports_nothing_outside_common():
    assert package_graph(with_modules=True)["common"] == set()


def test_services_do_not_import_each_other():
    graph = package_graph()
    crossing = {(a, b) for a in SERVICE_PACKAGES for b in graph[a] & SERVICE_PACKAGES} - ALLOWED
    assert crossing == set()


def test_no_import_cycle_among_packages():
    assert cycles(package_graph()) == []


def test_the_checks_can_fail(tmp_path):
    for package in ("common", "router", "backfill"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "common" / "x.py").write_text("def f():\n    from services.router import y\n")
    (tmp_path / "common" / "w.py").write_text("from services import config\n")
    (tmp_path / "config.py").write_text("")
    (tmp_path / "router" / "y.py").write_text("import services.backfill.z\n")
    (tmp_path / "backfill" / "z.py").write_text("from services.common import x\n")
    graph = package_graph(tmp_path)
    assert graph == {"common": {"router"}, "router": {"backfill"}, "backfill": {"common"}}
    assert cycles(graph) == [["backfill", "common", "router", "backfill"]]
    assert package_graph(tmp_path, with_modules=True)["common"] == {"router", "config"}
