"""The import rules of docs/design.md §2, machine-checked.

Every module of our packages is parsed (nothing is imported); every ``import`` counts,
wherever it stands: at module level, inside a function, under ``TYPE_CHECKING``. An edge
goes to the module named (``from a.b import c`` reaches ``a.b.c`` when that is a module,
else ``a.b``); the parent packages Python also runs on import are not edges. The rules:

1. Packages import only the packages ``ALLOWED`` lists for them: ``common`` and the wire
   stubs ``pdserve_api`` nothing of ours; ``engine`` and ``kv_store`` at the bottom (the
   engine uses the ``kv_store`` interface, never the reverse); ``service`` (the gRPC
   services, both roles) above them; ``router``, ``autoscaler`` and the CLI ``pdserve``
   on top. Nothing imports ``pdserve``
   but ``pdserve``.
2. The router never loads torch (it runs in small CPU pods): no router module imports
   torch, triton or numpy, and nothing the router imports at module level does, however
   deep. ``common`` imports torch only inside the functions that need it.
3. Inside ``engine``, the subpackages are layered in the order of ``ENGINE_LAYERS``
   (bottom first): a subpackage imports only itself and those before it, never the
   engine's top-level modules (the loop and its front ends, which may import any).
   Inside ``router`` likewise in the order of ``ROUTER_LAYERS``: its shared top-level
   modules, then the subpackages tools, discovery, routing, legs, openai; the front
   (app, cli, args) may import any.
4. No import cycles among the modules of any package (tests excluded): every module of a
   package can be read after those it imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "pdserve_api": set(),
    "kv_store": {"common"},
    "engine": {"common", "kv_store"},
    "service": {"common", "pdserve_api", "kv_store", "engine"},
    "router": {"common", "pdserve_api"},
    "autoscaler": {"common", "pdserve_api"},
    "pdserve": {
        "common",
        "pdserve_api",
        "kv_store",
        "engine",
        "service",
        "router",
        "autoscaler",
    },
}
OURS = set(ALLOWED)
HEAVY = {"torch", "triton", "numpy"}  # what a router pod must never load

# Bottom first: each engine subpackage may import only itself and those before it.
ENGINE_LAYERS = (
    "distributed",  # tensor-parallel process groups
    "attention",  # backends and kernels
    "models",  # the Llama family, its layers and loaders
    "lora",  # LoRA adapters, device slots, their kernels and slot policy
    "config",  # EngineConfig (checked against the model's config)
    "core",  # requests, blocks, scheduler, outputs
    "sampling",  # sampler, guided decoding
    "kv",  # the engine's side of KV transfer
    "executor",  # model runner, single process and tensor-parallel ranks
    "spec_decode",  # proposers and verification
    "step",  # the step seam: sync, async scheduling, batches in flight; hooks; outputs
)

# Bottom first, the router's layers: its shared top-level modules, then its subpackages.
# The front (app, cli, args, http_deadline: every top-level module not named here) may
# import any; a layer imports only itself and those before it.
ROUTER_LAYERS = (
    "errors",  # the OpenAI error body and APIError
    "metrics",  # the router's Prometheus registry
    "lora",  # which adapters the instances serve
    "tokenizer",  # torch-free prompt processing
    "tools",  # tool calling: parsers, request fields, template inputs, flag checks
    "settings",  # RouterSettings (checks the tool-call parser's name)
    "discovery",  # where the instances are: static, file, DNS, Kubernetes
    "routing",  # pools, policies, the KV block index and its event feed, prefix matching
    "legs",  # one request across the pools: placement, prefill and decode legs, failover
    "openai",  # the HTTP protocol and endpoints: completions, chat, responses, tokenize
)


class Module:
    """One parsed module: every import it makes, and those made at module level."""

    def __init__(self, name: str, path: Path, is_package: bool) -> None:
        self.name, self.path, self.is_package = name, path, is_package
        self.imports: set[str] = set()  # absolute dotted names, as written
        self.eager: set[str] = set()  # the subset run when the module is imported

    def parse(self) -> None:
        tree = ast.parse(self.path.read_text(), str(self.path))
        self._visit(tree.body, eager=True)

    def _visit(self, body: Iterable[ast.stmt], eager: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in self._names(node):
                    self.imports.add(name)
                    if eager:
                        self.eager.add(name)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self._visit(node.body, eager=False)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                self._visit(node.body, eager=False)
                self._visit(node.orelse, eager)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        self._visit([child], eager)
                    elif isinstance(child, ast.excepthandler):
                        self._visit(child.body, eager)

    def _names(self, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            pkg = self.name.split(".")
            if not self.is_package:
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        return [f"{base}.{a.name}" for a in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def scan(root: Path = REPO) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in sorted(OURS):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, path, is_package)
    for module in modules.values():
        module.parse()
    return modules


def resolve(names: Iterable[str], modules: dict[str, Module]) -> set[str]:
    """The modules of ours that ``names`` reach (``a.b.c`` may be a module or a name in
    ``a.b``); outside names keep their top-level package (``torch``)."""
    out = set()
    for name in names:
        if name.split(".")[0] not in OURS:
            out.add(name.split(".")[0])
            continue
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def package_violations(modules: dict[str, Module]) -> list[str]:
    bad = []
    for m in modules.values():
        own = m.name.split(".")[0]
        for target in resolve(m.imports, modules):
            top = target.split(".")[0]
            if top in OURS and top != own and top not in ALLOWED[own]:
                bad.append(f"{m.name} imports {target}: {own} may import {sorted(ALLOWED[own])}")
    return sorted(bad)


def router_heavy_imports(modules: dict[str, Module]) -> list[str]:
    """Router modules importing torch anywhere, or reaching it through module-level imports."""
    bad = [
        f"{m.name} imports {t}"
        for m in modules.values()
        if m.name.split(".")[0] == "router"
        for t in resolve(m.imports, modules) & HEAVY
    ]
    seen: dict[str, str] = {}  # module -> the router module whose eager imports reach it
    stack = [(n, n) for n in modules if n.split(".")[0] == "router"]
    while stack:
        name, origin = stack.pop()
        if name in seen:
            continue
        seen[name] = origin
        for t in resolve(modules[name].eager, modules):
            if t in HEAVY:
                bad.append(f"{origin} loads {t} through {name}")
            elif t in modules:
                stack.append((t, origin))
    return sorted(set(bad))


def common_heavy_imports(modules: dict[str, Module]) -> list[str]:
    return sorted(
        f"{m.name} imports {t} at module level"
        for m in modules.values()
        if m.name.split(".")[0] == "common"
        for t in resolve(m.eager, modules) & HEAVY
    )


def layer_violations(
    modules: dict[str, Module], package: str, layers: tuple[str, ...]
) -> list[str]:
    """Imports against ``layers`` (bottom first) inside ``package``: a module of a layer (a
    subpackage, or a top-level module the layers name) imports only its own layer and
    those before it; the package's other top-level modules (its front) may import any."""

    def layer(name: str) -> int | None:  # None: a front module (or the package itself)
        parts = name.split(".")
        if len(parts) < 2:
            return None
        if parts[1] in layers:
            return layers.index(parts[1])
        subpackage = len(parts) > 2 or modules[name].is_package
        return -1 if subpackage else None

    bad = []
    for m in modules.values():
        if m.name.split(".")[0] != package:
            continue
        own = layer(m.name)
        if own == -1:
            bad.append(f"{m.name} is in a subpackage of {package} its layers do not place")
        if own is None or own == -1:
            continue
        for t in resolve(m.imports, modules):
            if t.split(".")[0] != package:
                continue
            theirs = layer(t)
            if theirs is None or theirs > own:
                where = f"a top-level {package} module" if theirs is None else layers[theirs]
                bad.append(f"{m.name} ({layers[own]}) imports {t} ({where})")
    return sorted(bad)


def engine_layer_violations(modules: dict[str, Module]) -> list[str]:
    return layer_violations(modules, "engine", ENGINE_LAYERS)


def router_layer_violations(modules: dict[str, Module]) -> list[str]:
    return layer_violations(modules, "router", ROUTER_LAYERS)


def cycles(modules: dict[str, Module], package: str) -> list[list[str]]:
    """The import cycles among ``package``'s modules (one per strongly connected set)."""
    graph = {
        n: {t for t in resolve(m.imports, modules) if t.split(".")[0] == package and t != n}
        for n, m in modules.items()
        if n.split(".")[0] == package
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return scan()


def test_the_scan_sees_every_package(modules: dict[str, Module]) -> None:
    assert {n.split(".")[0] for n in modules} == OURS
    # a known edge of each kind, so a broken parser cannot pass the rules by seeing nothing
    assert "engine.core.request" in resolve(modules["engine.core.scheduler"].imports, modules)
    assert "torch" in resolve(modules["engine.executor.model_runner"].eager, modules)


def test_packages_import_only_what_the_layering_allows(modules: dict[str, Module]) -> None:
    assert package_violations(modules) == []


def test_the_router_never_loads_torch(modules: dict[str, Module]) -> None:
    assert router_heavy_imports(modules) == []


def test_common_imports_torch_only_where_used(modules: dict[str, Module]) -> None:
    assert common_heavy_imports(modules) == []


def test_engine_subpackages_import_only_downward(modules: dict[str, Module]) -> None:
    assert engine_layer_violations(modules) == []


def test_router_layers_import_only_downward(modules: dict[str, Module]) -> None:
    assert router_layer_violations(modules) == []


@pytest.mark.parametrize("package", sorted(OURS))
def test_no_import_cycles_in_any_package(modules: dict[str, Module], package: str) -> None:
    assert cycles(modules, package) == []


def test_the_checks_catch_each_kind_of_break(tmp_path: Path) -> None:
    """Each rule fires on a tree that breaks it (the checks are not vacuous)."""
    files = {
        "common/__init__.py": "",
        "common/heavy.py": "import torch\n",
        "router/__init__.py": "",
        "router/app.py": "from engine.core import request\nfrom common import heavy\n",
        "router/lazy.py": "def f():\n    import numpy\n",
        "router/a.py": "from router import b\n",
        "router/b.py": "def f():\n    from router.a import x\n",
        "router/errors.py": "",
        "router/legs/__init__.py": "",
        "router/legs/rpc.py": "from router.openai import handlers\nfrom router import errors\n",
        "router/openai/__init__.py": "",
        "router/openai/handlers.py": "from router.legs import rpc\nfrom router import cli\n",
        "router/cli.py": "",
        "service/__init__.py": "from router import app\n",
        "service/servicer.py": "from pdserve import cli\n",
        "pdserve/__init__.py": "",
        "pdserve/cli.py": "",
        "engine/__init__.py": "",
        "engine/llm_engine.py": "",
        "engine/core/__init__.py": "",
        "engine/core/request.py": "from ..sampling import sampler\n",
        "engine/core/outputs.py": "from engine import llm_engine\n",
        "engine/sampling/__init__.py": "",
        "engine/sampling/sampler.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from engine.core.request import Request\n"
        ),
        "engine/misc/__init__.py": "",
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in OURS:
        (tmp_path / package).mkdir(exist_ok=True)
    tree = scan(tmp_path)
    assert package_violations(tree) == [
        "router.app imports engine.core.request: router may import ['common', 'pdserve_api']",
        "service imports router.app: service may import "
        "['common', 'engine', 'kv_store', 'pdserve_api']",
        "service.servicer imports pdserve.cli: service may import "
        "['common', 'engine', 'kv_store', 'pdserve_api']",
    ]
    assert router_heavy_imports(tree) == [
        "router.app loads torch through common.heavy",
        "router.lazy imports numpy",
    ]
    assert common_heavy_imports(tree) == ["common.heavy imports torch at module level"]
    assert engine_layer_violations(tree) == [
        "engine.core.outputs (core) imports engine.llm_engine (a top-level engine module)",
        "engine.core.request (core) imports engine.sampling.sampler (sampling)",
        "engine.misc is in a subpackage of engine its layers do not place",
    ]
    assert cycles(tree, "engine") == [["engine.core.request", "engine.sampling.sampler"]]
    assert router_layer_violations(tree) == [
        "router.legs.rpc (legs) imports router.openai.handlers (openai)",
        "router.openai.handlers (openai) imports router.cli (a top-level router module)",
    ]
    assert cycles(tree, "router") == [
        ["router.a", "router.b"],
        ["router.legs.rpc", "router.openai.handlers"],
    ]
    assert cycles(tree, "pdserve") == []
