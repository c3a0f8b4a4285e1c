"""The capsule store holds its parts: no class of capsule_store/ uses a private attribute it does not
define itself (no inheritance splitting one object across files, no reaching into another's privates)."""
import ast
from pathlib import Path

import capsulert.capsule_store as pkg

ROOT = Path(pkg.__file__).parent


def _modules():
    return sorted(ROOT.rglob("*.py"))


def _defined(cls: ast.ClassDef) -> set[str]:
    """Names a class defines itself: its methods, class attributes and every `self._x = ...` it assigns."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in cls.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Name):
                    names.add(t.id)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def _private_uses(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            yield node


def test_no_class_uses_a_private_attribute_defined_in_another_file():
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if cls.bases and not all(isinstance(b, ast.Name) and b.id in ("object", "Exception") for b in cls.bases):
                bad.append(f"{path.name}: class {cls.name} inherits {[ast.unparse(b) for b in cls.bases]}")
            own = _defined(cls)
            for node in _private_uses(cls):
                if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr not in own:
                    bad.append(f"{path.name}:{node.lineno}: self.{node.attr} is not defined in class {cls.name}")
    assert bad == []


def test_no_module_reads_another_objects_private_attributes():
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        libraries = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for node in _private_uses(tree):
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in {"self", "cls"} | libraries:
                continue  # its own attributes, or a library's API (torch._foreach_copy_)
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


def _imports(path: Path) -> set[str]:
    """The capsule_store modules `path` imports, at any level (a function-level import is a cycle too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("capsulert.capsule_store"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from package import module`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("capsulert.capsule_store"))
    return out


def test_no_import_cycle_between_capsule_store_modules():
    """The package's __init__ (which re-exports) aside, the modules import each other in one direction."""
    name = {p: "capsulert.capsule_store." + ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _modules()}
    mods = {n.removesuffix(".__init__"): p for p, n in name.items()}
    graph = {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()
             if not m.endswith("capsule_store")}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done or m not in graph:
            return
        path.append(m)
        for i in sorted(graph[m]):
            visit(i)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
