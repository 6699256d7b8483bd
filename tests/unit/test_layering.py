"""The code map's rule: the device plugin (rdma_netns_dp) imports the CNI package's lower layers,
never the other way round. kubelet's PodResources client and its generated stubs live in
rdma_netns.kubelet for that reason; the config defaults sit in a module that imports nothing, so
the pydantic model and the hot-path loader no longer import each other."""

from __future__ import annotations

import ast
from pathlib import Path

CNI = Path(__file__).resolve().parents[2] / "cni" / "rdma_netns"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_cni_package_never_imports_the_device_plugin():
    files = sorted(CNI.rglob("*.py"))
    assert len(files) > 50 and CNI / "grants" / "client.py" in files  # the scan sees the package
    offenders = [f"{path.relative_to(CNI.parent)}:{line}: {module}" for path in files
                 for line, module in _imports(path) if module.split(".")[0] == "rdma_netns_dp"]
    assert offenders == [], "the CNI package imports the device plugin's:\n" + "\n".join(offenders)


def test_config_defaults_import_nothing_and_model_and_loader_not_each_other():
    config = CNI / "config"
    assert _imports(config / "defaults.py") == []
    model = {m for _, m in _imports(config / "model.py")}
    loader = {m for _, m in _imports(config / "loader.py")}
    assert "rdma_netns.config.loader" not in model
    # the loader imports the model lazily, on a cache miss only (its one pydantic validation)
    assert "rdma_netns.config.defaults" in model and "rdma_netns.config.defaults" in loader


DP = CNI.parent.parent / "dp" / "rdma_netns_dp"


def _cycles(package: Path, prefix: str) -> list[list[str]]:
    """Import circles among the package's own modules: every import counts, lazy ones inside
    functions and those under TYPE_CHECKING too (a circle is a design smell either way)."""
    modules = {prefix + "." + ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py") if "api" not in p.relative_to(package).parts}
    graph = {m: {i for _, i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                found.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return found


def test_the_device_plugin_has_no_import_circles():
    assert (DP / "daemon.py").exists() and (DP / "metrics.py").exists()
    circles = _cycles(DP, "rdma_netns_dp")
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def _module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (lazy imports included; `from pkg import mod`
    counts as importing mod)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join((package,) + (parts[:-1] if parts[-1] == "__init__" else parts))
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs or {node.module}
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cni_package_has_no_import_circles():
    """E.g. admin/status.py ran the checks of status_*.py, which took their types from status.py
    (issue 36): the shared types now live in status_context.py."""
    graph = _module_graph(CNI, "rdma_netns")
    assert "rdma_netns.kernel.rdma_sysfs" in graph["rdma_netns.admin.status_hw"]  # the scan sees the edges
    assert _circles(graph) == []


# What each layer of cni/rdma_netns may import, as its __init__.py says (issue 39: the folders
# are the layers). A key is a folder or a module left at the top; "" is the package's face.
LAYERS_MAY_IMPORT = {
    "util": {"util"},
    "spec": {"spec"},
    "kernel": {"kernel", "util", "testhooks"},
    "config": {"config", "spec", "util", "kernel"},
    "kubelet": {"kubelet", "config"},
    "publish": {"publish", "util", "kernel", "testhooks"},
    "rails": {"rails", "kernel", "spec", "util", "config", "state"},
    "grants": {"grants", "util", "spec", "config", "kubelet", "events"},
    "modes": {"modes", "rails", "config", "kernel", "spec", "mode_policy", "faults"},
}
# Faces that hold code (the rest import nothing: the CNI's start-up loads them).
FACES_WITH_CODE = {"commands", "modes"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_each_layer_imports_only_what_its_face_says():
    graph = _module_graph(CNI, "rdma_netns")
    assert "rdma_netns.grants.early" in graph["rdma_netns.grants.client"]  # the scan sees the edges
    offenders = sorted(f"{module} -> {target}" for module, targets in graph.items()
                       if _layer(module) in LAYERS_MAY_IMPORT for target in targets
                       if _layer(target) not in LAYERS_MAY_IMPORT[_layer(module)] | {""})
    assert offenders == [], "imports across the layers' rules (the folders' __init__.py):\n" + "\n".join(offenders)


def test_every_layer_has_a_face_that_says_what_it_is_and_imports_nothing():
    folders = sorted(p.parent for p in CNI.glob("*/__init__.py"))
    assert {f.name for f in folders} >= {"grants", "publish", "rails", "util", "kernel", "commands"}
    for folder in folders:
        face = folder / "__init__.py"
        assert ast.get_docstring(ast.parse(face.read_text())), f"{face.relative_to(CNI.parent)} has no docstring"
        if folder.name not in FACES_WITH_CODE:
            assert _imports(face) == [], f"{face.relative_to(CNI.parent)} imports: the CNI's start-up loads it"
    assert _imports(CNI / "__init__.py") == []
