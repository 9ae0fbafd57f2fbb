"""The optional packages, the extra of ``pyproject.toml`` that brings each, and one error for a missing one.

vitlab needs only torch, numpy, Pillow and safetensors.  A feature that needs more imports
it with ``require``; when the package is absent the error names the feature, the package
and the ``pip install`` line of its extra, which the command line prints as one line.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

# import name -> (distribution name, extra of pyproject.toml that brings it)
EXTRAS: dict[str, tuple[str, str]] = {
    "sklearn": ("scikit-learn", "demo"),
    "matplotlib": ("matplotlib", "plots"),
    "onnx": ("onnx", "export"),
    "onnxscript": ("onnxscript", "export"),
    "onnxruntime": ("onnxruntime", "export"),
    "huggingface_hub": ("huggingface_hub", "hub"),
    "torchao": ("torchao", "fp8"),
}


class MissingPackage(ImportError):
    """An optional package that a feature needs is not installed (or does not import)."""

    def __init__(self, module: str, needed_for: str, cause: BaseException | None = None) -> None:
        package, extra = EXTRAS[module]
        # a part of an installed package not found (torch.onnx imports onnxscript._framework_apis.torch_2_11,
        # which an onnxscript older than 0.6 lacks) is one too old, not one absent
        absent = cause is None or (isinstance(cause, ModuleNotFoundError)
                                   and str(cause.name or module).split(".")[0] == module and not _found(module))
        state = "is not installed" if absent else f"does not import ({cause})"
        super().__init__(f"{needed_for} needs {package}, which {state}: pip install -e \".[{extra}]\"",
                         name=module)
        self.package, self.extra = package, extra


def _found(module: str) -> bool:
    """Whether the top-level package ``module`` is installed (imported, or found where imports look)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, needed_for: str) -> ModuleType:
    """``import module`` (a dotted name whose root is a key of ``EXTRAS``), or ``MissingPackage``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingPackage(module.split(".")[0], needed_for, err) from err


def missing_package_of(err: ImportError) -> MissingPackage | None:
    """The ``MissingPackage`` an import error amounts to, when it is one of an optional
    package (raised with ``require`` or by a plain ``import`` deep inside); else None."""
    if isinstance(err, MissingPackage):
        return err
    root = str(err.name or "").split(".")[0]
    if isinstance(err, ModuleNotFoundError) and root in EXTRAS:
        return MissingPackage(root, "this command", err)
    return None
