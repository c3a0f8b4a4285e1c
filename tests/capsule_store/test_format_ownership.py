"""Contract: capsule_store/format/ is the only code that reads or writes capsule bytes.

Outside format/ no module imports safetensors or calls a safetensors file function (safe_open, save_file,
save/load as st_save/st_load, ...), and none spells a capsule or block file suffix: file names, byte
layouts and checksums are asked of format/. The exceptions are model weights, not capsules: the checkpoint
loader (engine/loader.py, engine/weights.py, engine/default_model.py), and the weights sent as bytes by
update_weights (the orchestrator encodes them, the worker decodes them), allowed in those functions only.
"""
import ast
from pathlib import Path

import capsulert
from capsulert.capsule_store.format.names import BLOCK_SUFFIX, FILE_SUFFIX

ROOT = Path(capsulert.__file__).parent
FORMAT = Path("capsule_store/format")
CHECKPOINT_LOADER = {Path("engine/loader.py"), Path("engine/weights.py"), Path("engine/default_model.py")}
WEIGHT_BYTES = {(Path("orchestrator/orchestrator.py"), "update_weights"), (Path("worker/core.py"), "_update_weights")}
FILE_FUNCTIONS = {"safe_open", "save_file", "load_file", "st_save", "st_load", "safe_save", "safe_load"}
SUFFIXES = (FILE_SUFFIX, BLOCK_SUFFIX)


class _Scan(ast.NodeVisitor):
    """Capsule-byte uses in one module, each with the function it is in (None: module level)."""

    def __init__(self):
        self.found: list[tuple[int, str | None, str]] = []
        self._functions: list[str] = []
        self._from_safetensors: set[str] = set()  # local names bound to safetensors' functions

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, self._functions[-1] if self._functions else None, what))

    def visit_FunctionDef(self, node):
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] == "safetensors":
                self._add(node, f"import {a.name}")

    def visit_ImportFrom(self, node):
        if (node.module or "").split(".")[0] == "safetensors":
            self._add(node, f"from {node.module} import {', '.join(a.name for a in node.names)}")
            self._from_safetensors.update(a.asname or a.name for a in node.names)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in FILE_FUNCTIONS | self._from_safetensors:
            self._add(node, f"call {node.func.id}()")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and any(s in node.value for s in SUFFIXES):
            self._add(node, f"the capsule file suffix literal in {node.value[:60]!r}")


def capsule_byte_uses(source: str, rel: Path) -> list[str]:
    """What in `source` (the module at `rel` under capsulert/) reads or writes capsule bytes outside format/."""
    if rel.is_relative_to(FORMAT):
        return []
    scan = _Scan()
    scan.visit(ast.parse(source))
    out = []
    for line, function, what in scan.found:
        weights = rel in CHECKPOINT_LOADER or (rel, function) in WEIGHT_BYTES
        if weights and not what.startswith("the capsule file suffix"):
            continue
        out.append(f"{rel}:{line} ({function or 'module level'}): {what}")
    return out


def test_only_format_reads_or_writes_capsule_bytes():
    bad = [u for p in sorted(ROOT.rglob("*.py")) for u in capsule_byte_uses(p.read_text(), p.relative_to(ROOT))]
    assert bad == [], "capsule bytes handled outside capsule_store/format/:\n" + "\n".join(bad)


def test_format_is_where_the_capsule_bytes_are():
    """Not vacuous: the scan finds the safetensors uses and the suffixes where they belong."""
    found = {}
    for p in sorted((ROOT / FORMAT).rglob("*.py")):
        scan = _Scan()
        scan.visit(ast.parse(p.read_text()))
        found[p.name] = {what for _, _, what in scan.found}
    assert any(w.startswith("call save_file") for w in found["staging.py"])
    assert any(w.startswith("call safe_open") for w in found["disk.py"]) and \
        any(w.startswith("call safe_open") for w in found["blockfiles.py"])
    assert any(w.startswith("call st_save") for w in found["export.py"]) and \
        any(w.startswith("call st_load") for w in found["export.py"])
    assert sum(w.startswith("the capsule file suffix") for w in found["names.py"]) == 2


def test_the_scan_catches_each_kind_of_use():
    src = '''
import safetensors.torch
from safetensors.torch import save as pack
from x import safe_open

NAME = "abc" + ".capsule.safetensors"

def f(t):
    safe_open("p", framework="pt")
    return pack(t)

def _update_weights(r):
    from safetensors.torch import load as st_load
    return st_load(r)
'''
    outside = capsule_byte_uses(src, Path("worker/pinned_files.py"))
    assert len(outside) == 7 and any("module level): import safetensors.torch" in u for u in outside)
    assert any("(f): call pack()" in u for u in outside) and any("(f): call safe_open()" in u for u in outside)
    assert any("capsule file suffix" in u for u in outside)
    # the weights' bytes are allowed in that one function of the worker, and nowhere else in it
    core = capsule_byte_uses(src, Path("worker/core.py"))
    assert len(core) == 5 and not any("_update_weights" in u for u in core)
    # the checkpoint loader may use safetensors, never a capsule file suffix
    assert capsule_byte_uses(src, Path("engine/loader.py")) == [
        u.replace("worker/pinned_files.py", "engine/loader.py") for u in outside if "capsule file suffix" in u]
    assert capsule_byte_uses(src, FORMAT / "disk.py") == []
