"""Every command's help renders (a stray % in a help string breaks argparse only at --help)."""
import pytest

from vitlab.cli import COMMANDS, main


@pytest.mark.parametrize("command", [None] + [c for c, _, _ in COMMANDS])
def test_help_renders(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vitlab")
    if command is None:
        assert all(c in out for c, _, _ in COMMANDS)
