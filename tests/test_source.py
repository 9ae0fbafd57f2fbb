"""The package's source reads clean: every name it uses is defined and every import is used (pyflakes)."""
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
