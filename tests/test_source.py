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
