"""The KV connector interface and its factory are the engine's only ways into ``kv_store``,
and the interface names no implementation (docs/design.md §2 import rules, §3
"Connector"). Every import statement counts: module level, inside functions and under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERFACE = "kv_store.base"
# What the engine may import of kv_store: the interface, the factory that builds each
# role's connector (rank 0's, its fan-out over N ranks, a worker rank's end), and the pure
# mapping of layers and KV heads between unlike grids (which ranks hold which cells).
GRID_MAPPING = "kv_store.reshard"
ENGINE_MAY_IMPORT = {INTERFACE, "kv_store.factory", GRID_MAPPING}
# What the interface may import of kv_store: the plain counters only.
INTERFACE_MAY_IMPORT = {"kv_store.stats"}


def kv_store_imports(path: Path) -> set[str]:
    """The ``kv_store`` modules (and ``from kv_store import x`` names) ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kv_store"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kv_store":
                found |= {f"kv_store.{a.name}" for a in node.names}
            elif node.module.startswith("kv_store."):
                found.add(node.module)
    return found


def test_the_engine_imports_only_the_interface_of_kv_store() -> None:
    engine = sorted((REPO / "engine").rglob("*.py"))
    assert len(engine) > 20  # the walk found the engine
    wrong = {
        str(p.relative_to(REPO)): sorted(bad)
        for p in engine
        if (bad := kv_store_imports(p) - ENGINE_MAY_IMPORT)
    }
    assert not wrong, f"engine modules importing kv_store beyond {ENGINE_MAY_IMPORT}: {wrong}"


def test_the_interface_imports_no_transport() -> None:
    imports = kv_store_imports(REPO / "kv_store" / "base.py")
    assert "kv_store.stats" in imports  # the walk sees the interface's imports
    assert imports <= INTERFACE_MAY_IMPORT, sorted(imports - INTERFACE_MAY_IMPORT)


def test_the_grid_mapping_is_as_pure_as_the_interface() -> None:
    imports = kv_store_imports(REPO / "kv_store" / "reshard.py")
    assert INTERFACE in imports  # the walk sees the mapping's imports
    assert imports <= INTERFACE_MAY_IMPORT | {INTERFACE}, sorted(imports - INTERFACE_MAY_IMPORT)


def test_the_walk_catches_every_kind_of_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "import kv_store.p2p.stats\n"
        "from kv_store import factory\n"
        "if TYPE_CHECKING:\n    from kv_store.stats import ConnectorStats\n"
        "def f():\n    from kv_store.tp_connector import TPConnector\n"
        "from .sibling import x\n"
    )
    assert kv_store_imports(probe) == {
        "kv_store.p2p.stats",
        "kv_store.factory",
        "kv_store.stats",
        "kv_store.tp_connector",
    }
