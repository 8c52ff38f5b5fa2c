"""The package's shape: the public import paths, and imports that go one way
(docs/design.md's module map)."""
from __future__ import annotations

import ast
import configparser
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_zk"
#: Which subpackage may import which (besides itself and exceptions).
ALLOWED = {
    "compat": set(),
    "zk": {"compat", "server"},   # server: the four-letter words, naming a version
    "worker": {"zk", "features", "broker", "compat"},
    "features": {"zk", "compat"},
    "broker": {"zk", "features", "compat"},
    "backend": {"zk", "compat"},
    "ops": {"zk", "features", "broker", "backend", "server", "compat"},
    "server": set(),
}


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module of ``known`` that ``path`` imports, TYPE_CHECKING and
    function-level imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for candidate in [target, *(f"{target}.{alias.name}" for alias in node.names)]:
                if candidate in known and candidate != name:
                    yield candidate
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names
                        if alias.name in known and alias.name != name)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = _modules(root, package)
    return {name: set(_imports(name, path, set(modules))) for name, path in modules.items()}


def test_no_module_passes_500_lines() -> None:
    """One idea per module: one that passes 500 lines is usually two (docs/design.md)."""
    long = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py")
            if (lines := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_the_package_has_no_import_cycle() -> None:
    assert _cycle(_graph(PACKAGE, "celery_zk")) is None


def test_benchmarks_have_no_import_cycle() -> None:
    """benchmarks/ is an import root: its scripts and its packages import each
    other by top-level names (``common.app``, ``nemesis.run``)."""
    modules = {name.partition(".")[2]: path
               for name, path in _modules(ROOT / "benchmarks", "benchmarks").items()
               if name != "benchmarks"}
    graph = {name: set(_imports(name, path, set(modules))) for name, path in modules.items()}
    assert graph["workers"] and graph["nemesis.run"]   # the imports are seen
    assert _cycle(graph) is None


def test_subpackages_import_only_what_is_below_them() -> None:
    for name, targets in _graph(PACKAGE, "celery_zk").items():
        parts = name.split(".")
        if len(parts) < 3:
            continue   # top-level modules (cli, the public shims) may import anything
        for target in targets:
            below = target.split(".")[1] if target.count(".") else ""
            if below in (parts[1], "exceptions", ""):
                continue
            assert below in ALLOWED[parts[1]], f"{name} imports {target}"


@pytest.mark.parametrize("path", [
    "celery_zk.transport:Transport", "celery_zk.transport:publish_together",
    "celery_zk.backend:ZooKeeperBackend", "celery_zk.server:ZooKeeperServer",
    "celery_zk.server:free_ports", "celery_zk:Singleton", "celery_zk:LockHeld",
    "celery_zk:affinity", "celery_zk.exceptions:MessageTooLarge",
    "celery_zk.server:ZooKeeperEnsemble", "celery_zk.affinity:hold",
])
def test_public_paths_resolve(path: str) -> None:
    module, _, attribute = path.partition(":")
    assert getattr(importlib.import_module(module), attribute) is not None


def test_the_public_affinity_module_is_the_module_itself() -> None:
    """``import celery_zk.affinity`` and ``from celery_zk import affinity`` give
    the one module whose state (worker id, held keys) the transport reads."""
    import celery_zk.affinity
    from celery_zk import affinity
    from celery_zk.features import affinity as inner

    assert celery_zk.affinity is affinity is inner


def test_public_exceptions_name_their_public_module() -> None:
    """Celery stores a task's exception by module and name: results must keep
    resolving when the code behind the public path moves."""
    import celery_zk
    from celery_zk.affinity import AffinityKeyError

    assert (celery_zk.LockHeld.__module__, AffinityKeyError.__module__) == (
        "celery_zk", "celery_zk.affinity")
    assert importlib.import_module(celery_zk.LockHeld.__module__).LockHeld is celery_zk.LockHeld


def test_every_entry_point_resolves() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    for group, lines in config["options.entry_points"].items():
        for line in filter(None, (line.strip() for line in lines.splitlines())):
            target = line.partition("=")[2].strip()
            module, _, attribute = target.partition(":")
            loaded = importlib.import_module(module)
            assert attribute == "" or hasattr(loaded, attribute), (group, target)


def test_kombus_zk_alias_is_the_public_path() -> None:
    from kombu.transport import TRANSPORT_ALIASES, resolve_transport

    import celery_zk  # noqa: F401
    from celery_zk.broker.transport import Transport

    assert TRANSPORT_ALIASES["zk"] == "celery_zk.transport:Transport"
    assert resolve_transport("zk") is Transport


def test_the_package_says_the_version_setup_cfg_releases() -> None:
    import celery_zk

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert celery_zk.__version__ == config["metadata"]["version"]
