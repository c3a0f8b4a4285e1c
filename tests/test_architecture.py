"""The package's shape, checked: the import contracts (pyproject's [tool.importlinter]: the layers, no
cycles), no object reading another's private attributes, no inheritance splitting one object across files."""
import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from abc import ABC
from pathlib import Path

import capsulert

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "capsulert"
# optional dependencies a CPU box lacks: their modules are checked by the import contracts, not imported here
NEEDS_GPU = ("capsulert.kernels.triton_",)


def _modules():
    for info in pkgutil.walk_packages(capsulert.__path__, "capsulert."):
        if not info.name.startswith(NEEDS_GPU):
            yield importlib.import_module(info.name)


def test_import_contracts_hold():
    """lint-imports over the contracts in pyproject.toml: each package imports only the layers below it,
    and no two modules import each other (imports under TYPE_CHECKING excepted)."""
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _private_names() -> set[str]:
    """Every _name capsulert defines: functions, methods, classes and attributes assigned on self."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_object_reads_another_objects_private_attributes():
    """`other._x` for a private name capsulert defines is a reach into another object's insides; only self
    and cls may use their own. (Third-party privates, such as torch's, are not ours to police here.)"""
    ours = _private_names()
    reaches = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ours:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "\n".join(reaches)


def test_no_inheritance_splits_an_object_across_files():
    """A class may extend a class of another module only when that base is an interface (an ABC, whose
    subclasses are the registered implementations), an error type or a plain data record (a dataclass or a
    pydantic model): never a concrete class whose behaviour it continues."""
    from pydantic import BaseModel
    from dataclasses import is_dataclass

    split = []
    for module in _modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for base in cls.__bases__:
                if not base.__module__.startswith("capsulert.") or base.__module__ == cls.__module__:
                    continue
                if issubclass(base, (BaseException, BaseModel)) or ABC in base.__mro__ or is_dataclass(base):
                    continue
                split.append(f"{cls.__module__}.{cls.__qualname__} extends {base.__module__}.{base.__qualname__}")
    assert not split, "\n".join(split)
