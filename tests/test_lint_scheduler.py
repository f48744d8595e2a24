"""Lint of the Python package (scheduler/kvadmit): no function over MAX_LINES lines, no
module over MAX_MODULE_LINES (no native module over MAX_NATIVE_LINES), no import cycle
between kvadmit's modules, counting every import statement (module-level and inside
functions: a function-level import only hides a cycle, it does not remove it), and one
door into the core: only kvadmit/port.py calls an AdmissionCore.

The checks read the source with `ast` (nothing is imported), and are tested on small
packages written here, so a lint that cannot fail would fail its own tests."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "scheduler" / "kvadmit"
NATIVE = ROOT / "native" / "kvadmit"
MAX_LINES = 80
MAX_MODULE_LINES = 500
MAX_NATIVE_LINES = 700
PATCHES = ROOT / "patches"
# The one module that calls an AdmissionCore (kvadmit/__init__.py re-exports the class)
PORT = "port.py"

# Functions over MAX_LINES today, in files this change could not edit; each may not grow
# (its length today is the limit) and should leave this list when its owner splits it.
LONG_ALLOWED: dict[tuple[str, str], int] = {}
# Import cycles today, in files this change could not edit (each a set of modules).
CYCLES_ALLOWED: list[set[str]] = []


def function_lengths(package: pathlib.Path) -> dict[tuple[str, str], int]:
    """(file relative to the package, dotted name) -> lines (end - start + 1, decorators not
    counted) of every function and method, nested ones included."""
    out = {}

    def walk(node, prefix, rel):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out[rel, name] = child.end_lineno - child.lineno + 1
                walk(child, name + ".", rel)
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".", rel)
            else:
                walk(child, prefix, rel)

    for path in sorted(package.rglob("*.py")):
        walk(ast.parse(path.read_text()), "", path.relative_to(package).as_posix())
    return out


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every .py under the package (a package is its
    __init__.py)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(package: pathlib.Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}, over every import
    statement (anywhere in the file) that names one of the package's own modules. A
    `from X import name` is an edge to the submodule X.name when that is a module, else
    to X; modules outside the package (the compiled core, vLLM, ...) are not nodes."""
    mods = modules(package)
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here[:len(here) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(graph, comp: set[str], package: pathlib.Path) -> str:
    mods = modules(package)
    return "; ".join(f"{a} imports {b} ({mods[a].relative_to(package.parent)}:{line})"
                     for a in sorted(comp) for b, line in sorted(graph[a].items()) if b in comp)


def module_lengths(root: pathlib.Path, pattern: str) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.read_text().count("\n")
            for p in sorted(root.rglob(pattern))}


def core_calls(root: pathlib.Path) -> list[str]:
    """Every place outside the port that reaches an AdmissionCore: the name AdmissionCore
    used in code (not re-exported by a package's __init__), or an attribute named
    `core` (an adapter's core, a NativeEngine's): "file:line what"."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == PORT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "core":
                out.append(f"{rel}:{node.lineno} .core")
            elif (isinstance(node, ast.Name) and node.id == "AdmissionCore") or \
                    (isinstance(node, ast.Attribute) and node.attr == "AdmissionCore"):
                out.append(f"{rel}:{node.lineno} AdmissionCore")
            elif isinstance(node, ast.ImportFrom) and path.name != "__init__.py" and \
                    any(a.name == "AdmissionCore" for a in node.names):
                out.append(f"{rel}:{node.lineno} imports AdmissionCore")
    return out


def test_only_the_port_calls_the_core():
    assert (PACKAGE / PORT).exists()
    calls = core_calls(PACKAGE) + core_calls(PATCHES)
    assert not calls, ("only kvadmit/port.py calls the core (add a CorePort method for "
                       "what an adapter needs): " + ", ".join(calls))


def test_no_module_is_too_long():
    python = module_lengths(PACKAGE, "*.py")
    native = {**module_lengths(NATIVE, "*.pyx"), **module_lengths(NATIVE, "*.pxd")}
    assert "config.py" in python and "_core.pyx" in native
    too_long = {m: n for m, n in python.items() if n > MAX_MODULE_LINES}
    too_long.update({m: n for m, n in native.items() if n > MAX_NATIVE_LINES})
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (native: {MAX_NATIVE_LINES}): {too_long}"


def test_no_function_is_longer_than_80_lines():
    lengths = function_lengths(PACKAGE)
    # the walk found the package's functions and methods
    assert len(lengths) > 300 and ("config.py", "AdmissionConfig.from_dict") in lengths
    too_long = {k: n for k, n in lengths.items()
                if n > MAX_LINES and n > LONG_ALLOWED.get(k, 0)}
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into functions that "
                          f"each do one thing): {too_long}")


def test_no_import_cycle_between_kvadmit_modules():
    graph = import_graph(PACKAGE)
    assert {"kvadmit", "kvadmit.config", "kvadmit.vllm.settings"} <= set(graph)
    assert "kvadmit.config" in graph["kvadmit.vllm.settings"]
    found = [c for c in cycles(graph) if c not in CYCLES_ALLOWED]
    assert not found, "import cycles: " + " | ".join(describe(graph, c, PACKAGE) for c in found)


def test_the_base_config_imports_no_adapter():
    """kvadmit.config is the base every engine adapter builds on: it imports none of them."""
    graph = import_graph(PACKAGE)
    adapters = ("kvadmit.vllm", "kvadmit.sglang", "kvadmit.simulate")
    assert not [m for m in graph["kvadmit.config"] if m.startswith(adapters)]


def test_the_native_modules_are_not_python_nodes():
    """An import of the compiled core (kvadmit._native, ...) is no edge to the package."""
    assert sorted(NATIVE.glob("*.pyx")) and not (PACKAGE / "_native.py").exists()
    assert "kvadmit" not in import_graph(PACKAGE)["kvadmit.config"]


# -- the lint's own checks, on small packages ------------------------------------------

def write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, cycle", [
    # module level
    ({"__init__.py": "", "a.py": "from pkg.b import x\n", "b.py": "import pkg.a\nx = 1\n"},
     {"pkg.a", "pkg.b"}),
    # hidden in a function, through a package's __init__, and relative
    ({"__init__.py": "from pkg.a import f\n", "a.py": "def f():\n    from . import sub\n",
      "sub/__init__.py": "", "sub/c.py": ""},
     None),
    ({"__init__.py": "from pkg.a import f\n",
      "a.py": "def f():\n    from .sub import c\n    return c\n",
      "sub/__init__.py": "", "sub/c.py": "def g():\n    from pkg import f\n"},
     {"pkg", "pkg.a", "pkg.sub.c"}),
    # a from-import of a submodule is an edge to it, not to the package
    ({"__init__.py": "from pkg import a\n", "a.py": "from pkg import b\n", "b.py": ""}, None),
])
def test_the_cycle_check_finds_cycles_however_hidden(tmp_path, files, cycle):
    pkg = write(tmp_path, files)
    assert cycles(import_graph(pkg)) == ([cycle] if cycle else [])


def test_the_length_check_counts_methods_and_nested_functions(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(81))
    nested = "def outer():\n    def inner():\n        pass\n    return inner\n"
    pkg = write(tmp_path, {"m.py": f"class C:\n    def long(self):\n{body}{nested}"})
    lengths = function_lengths(pkg)
    assert lengths["m.py", "C.long"] == 82
    assert lengths["m.py", "outer"] == 4 and lengths["m.py", "outer.inner"] == 2


@pytest.mark.parametrize("text, found", [
    ("from kvadmit._native import AdmissionCore\nc = AdmissionCore(cfg, 1, 1)\n",
     ["m.py:1 imports AdmissionCore", "m.py:2 AdmissionCore"]),
    ("def f(adapter):\n    return adapter.core.stats()\n", ["m.py:2 .core"]),
    ("def f(adapter):\n    return adapter.port.stats(), adapter.engine_core\n", []),
    ("import kvadmit._native as n\nc = n.AdmissionCore(cfg, 1, 1)\n", ["m.py:2 AdmissionCore"]),
])
def test_the_port_check_finds_core_calls(tmp_path, text, found):
    pkg = write(tmp_path, {"m.py": text, "port.py": "from kvadmit import AdmissionCore\n"})
    assert core_calls(pkg) == found
