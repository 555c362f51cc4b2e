"""The module structure: no import cycles inside nanscan, and a report needs no torch.

The import graph is read from the source (every ``import`` statement, those inside functions
included): a lazy import only hides a cycle from the interpreter, the modules still depend on each
other. Importing a submodule makes Python import its parent package first; that implicit edge is
not a dependency the submodule chose, so only written imports count."""
import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import nanscan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "nanscan")


def _modules() -> dict:
    """Dotted name -> path of every module in the package (extension modules included: they can be
    imported, they just import nothing from nanscan)."""
    mods = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            stem = f.split(".")[0]
            if not (f.endswith(".py") or f.endswith(".so") or f.endswith(".pyd")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, stem), REPO).split(os.sep)
            name = ".".join(rel[:-1] if stem == "__init__" else rel)
            mods[name] = os.path.join(dirpath, f)
    return mods


def import_graph() -> dict:
    """Module -> the nanscan modules it imports anywhere in its source."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        if not path.endswith(".py"):
            graph[name] = set()
            continue
        is_pkg = os.path.basename(path) == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:  # `from pkg import sub` imports the submodule, else the package
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "nanscan.kernels.reference" in graph["nanscan._ops"]  # imported inside a function
    assert {"nanscan.monitor.incident", "nanscan.monitor.monitor"} <= graph["nanscan.monitor"]


def test_no_import_cycles_in_nanscan():
    found = cycles(import_graph())
    assert found == [], f"import cycles (lazy imports included): {found}"


def test_report_imports_neither_torch_nor_the_rest_of_nanscan(tmp_path):
    """``nanscan.report`` works where only the log is: torch blocked, and nanscan/__init__ (which
    imports torch) replaced by a bare package so that only the report's own modules (and the
    torch-free JSON format, nanscan.jsonl, and the phase / kind words, nanscan.vocabulary) run."""
    log = tmp_path / "events.jsonl"
    log.write_text('{"type": "step", "step": 0, "rank": 0, "loss": {"finite": false, "value": "nan"}}\n')
    code = textwrap.dedent(f"""
        import sys, types
        sys.modules["torch"] = None  # `import torch` now raises ImportError
        package = types.ModuleType("nanscan")
        package.__path__ = [{PACKAGE!r}]
        sys.modules["nanscan"] = package
        from nanscan import report
        text = report.text_report({str(log)!r})
        assert "step 0: loss non-finite" in text, text
        loaded = sorted(m for m in sys.modules if m.startswith("nanscan."))
        assert all(m.startswith("nanscan.report") or m in ("nanscan.jsonl", "nanscan.vocabulary")
                   for m in loaded), loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_every_subpackage_is_packaged():
    """pyproject's explicit package list names every package under nanscan/ (an editable install
    finds them anyway; a wheel would silently leave one out)."""
    import tomllib

    root = pathlib.Path(nanscan.__file__).parent
    found = {".".join(p.parent.relative_to(root.parent).parts) for p in root.rglob("__init__.py")}
    listed = set(tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert found == listed
