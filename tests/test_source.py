"""The package's source reads clean: every name it uses is defined and every import is used (pyflakes); the
tests import nothing that the oldest Python the package supports (requires-python) lacks."""
import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

PACKAGE = Path(__file__).resolve().parent.parent / "vitlab"


def test_the_package_uses_no_undefined_name_and_imports_nothing_unused():
    out, err = io.StringIO(), io.StringIO()
    checkRecursive([str(PACKAGE)], Reporter(out, err))
    problems = (out.getvalue() + err.getvalue()).strip()
    assert not problems, problems


def test_importing_the_package_and_its_commands_loads_no_compiler():
    # torch's compiler stack (dynamo, inductor) adds tens of MB to every process that imports it; vitlab
    # imports it only where something is compiled, so that an eager run's memory is its own
    import subprocess
    import sys

    code = ("import sys, vitlab, vitlab.fast, vitlab.cli.train, vitlab.cli.eval, vitlab.train.loop; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_tests_import_nothing_the_oldest_python_the_package_supports_lacks():
    """requires-python is >=3.10, which has no tomllib (3.11): four test modules imported it, so that on 3.10
    `python -m pytest tests` stopped at collection and ran nothing.  They read pyproject.toml through
    helpers.project, which takes tomli there, and the test extra brings tomli there."""
    import ast
    import re

    from helpers.project import pyproject

    project = pyproject()["project"]
    oldest = tuple(map(int, re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups()))
    newer = {"tomllib"} if oldest < (3, 11) else set()  # standard-library modules the oldest Python lacks
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        if path == tests / "helpers" / "project.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names = [node.args[0].value]
            found += [f"{path.relative_to(tests)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in newer]
    assert not found, found
    if newer:
        assert any(re.fullmatch(r'tomli>=[\d.]+; python_version < "3\.11"', req)
                   for req in project["optional-dependencies"]["test"])


# torch APIs added after 2.4 that the package calls, as its source spells them, and the torch release that added each
NEWER_TORCH_APIS = {
    "torch.nn.utils.get_total_norm": (2, 6),           # the compiled update's gradient norm
    "set_priority=True": (2, 6),                       # torch.nn.attention.sdpa_kernel's (run.gpu_attention)
    "from torch.distributed.fsdp import fully_shard": (2, 6),  # public there from 2.6 (run.fsdp)
    "torch.OutOfMemoryError": (2, 5),
    "dynamo=True": (2, 5),                             # torch.onnx.export's torch.export-based exporter
}


def test_the_torch_floor_has_every_torch_api_the_package_calls():
    """pyproject.toml said torch>=2.4, on which a compiled update, run.gpu_attention='cudnn', run.fsdp and
    ONNX export each failed on an API torch did not have yet."""
    import re

    from helpers.project import pyproject

    torch_req = next(r for r in pyproject()["project"]["dependencies"] if re.match(r"torch\b", r))
    floor = tuple(map(int, re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_req).groups()))
    source = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    called = {api: added for api, added in NEWER_TORCH_APIS.items() if api in source}
    assert called, "the table names none of the APIs the package calls: bring it up to date"
    assert {api: added for api, added in called.items() if added > floor} == {}, f"torch>={floor}"
