"""The commands are thin: each module of vitlab/cli/ parses its arguments, calls the library
and prints.  Read from the source with ``ast``: no function there is over 40 lines, none
reaches into the library's loggers (the library keeps itself quiet where it should), and none
decides the device itself."""
import ast
from pathlib import Path

CLI = Path(__file__).resolve().parent.parent / "vitlab" / "cli"
MAX_LINES = 40


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_command_function_is_over_40_lines():
    long = [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(CLI.glob("*.py")) for node in functions(path)
            if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, f"functions of vitlab/cli/ over {MAX_LINES} lines: {', '.join(long)}"


def test_the_line_count_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert {n.name: n.end_lineno - n.lineno + 1 for n in functions(tmp_path / "long.py")} == {
        "short": 2, "long": MAX_LINES + 1}


def test_no_command_touches_a_logger():
    touched = [f"{path.name}:{node.lineno} {node.func.attr}" for path in sorted(CLI.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in {"getLogger", "addFilter", "removeFilter", "setLevel", "addHandler", "disable"}]
    assert not touched, f"vitlab/cli/ reaches into loggers: {', '.join(touched)}"


def test_no_command_decides_the_device():
    """A device named "auto" is decided by the library (``vitlab.train.resolve.resolve_device``)."""
    asked = [f"{path.name}:{node.lineno}" for path in sorted(CLI.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "is_available"]
    assert not asked, f"vitlab/cli/ decides the device: {', '.join(asked)}"
