"""pyproject.toml as a dict on every Python the package supports: tomllib is 3.11's; on 3.10 the
test extra brings tomli, the parser tomllib was made from."""
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())
