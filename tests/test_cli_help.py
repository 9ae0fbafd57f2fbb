"""Every command's help renders (a stray % in a help string breaks argparse only at --help)."""
import pytest

from vitlab.cli import COMMANDS, build_parser, main


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


@pytest.mark.parametrize("argv, named, unknown", [(["flops", "ViT-B/16", "--model", "x"], "vitlab flops", "--model x"),
                                                   (["train", "--recipe", "demo", "stray"], "vitlab train", "stray"),
                                                   (["--bogus"], "vitlab", "--bogus")])
def test_an_unknown_argument_is_refused_by_the_command_it_was_given_to(argv, named, unknown, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # one line, as every refusal: no usage block before it
    assert err == f"{named}: error: unrecognized arguments: {unknown} (see {named} --help)\n"


@pytest.mark.parametrize("argv, named, message", [
    (["train", "--recipe", "demo", "--steps", "abc"], "vitlab train", "argument --steps: invalid int value: 'abc'"),
    (["train"], "vitlab train", "the following arguments are required: --recipe"),
    (["traim"], "vitlab", "argument COMMAND: invalid choice: 'traim' (choose from "),
])
def test_argparses_own_refusals_are_one_line(argv, named, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{named}: error: {message}") and err.endswith(f" (see {named} --help)\n")
    assert err.count("\n") == 1


def test_a_models_filter_that_matches_nothing_says_so(capsys):
    assert main(["models", "--filter", "ViT-Q"]) == 2
    assert capsys.readouterr().err.startswith("vitlab models: error: --filter 'ViT-Q': no registered model's name")
    assert main(["models", "--filter", "B/16"]) == 0 and "ViT-B/16" in capsys.readouterr().out


def test_version_prints_the_installed_packages_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"vitlab {version('vitlab')}\n"


def test_the_package_takes_its_version_and_license_from_one_place_each():
    from pathlib import Path

    from helpers.project import pyproject as read_pyproject

    root = Path(__file__).resolve().parent.parent
    pyproject = read_pyproject()
    project = pyproject["project"]
    # no number of its own in pyproject.toml: the metadata's version is vitlab.__version__
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vitlab.__version__"}
    # the license pyproject names ships with the package, in its full text
    assert project["license"] == "Apache-2.0"
    assert all((root / name).is_file() for name in project["license-files"])
    license_text = (root / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def test_a_warning_shows_as_one_line_naming_the_command_and_the_format_is_given_back(capsys, monkeypatch):
    import sys
    import warnings

    import vitlab.cli.models

    def warns(args):  # pytest records warnings rather than showing them: format one as Python would show it
        print(warnings.formatwarning("inference continues eager", RuntimeWarning, "vitlab/x.py", 7), end="",
              file=sys.stderr)
        return 0

    monkeypatch.setattr(vitlab.cli.models, "run", warns)
    python_format = warnings.formatwarning
    assert main(["models"]) == 0
    assert capsys.readouterr().err == "vitlab models: RuntimeWarning: inference continues eager\n"
    assert warnings.formatwarning is python_format


def test_an_interrupted_command_says_so_in_one_line_naming_it(capsys, monkeypatch):
    """Ctrl-C ended with a bare "interrupted", the one line that did not name its command."""
    import vitlab.cli.models

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(vitlab.cli.models, "run", interrupted)
    assert main(["models"]) == 130
    assert capsys.readouterr().err == "vitlab models: interrupted\n"


@pytest.mark.parametrize("command, module, argv", [("train", "train", ["--recipe", "demo"]),
                                                   ("vtab", "vtab", ["--init", "w", "--tasks", "t"]),
                                                   ("experiment", "experiment", ["head"])])
def test_an_interrupted_command_that_can_resume_says_how(capsys, monkeypatch, command, module, argv):
    """Ctrl-C in a training run said only "interrupted": its checkpoints (finished runs) were kept, and
    nothing named the flag that goes on from them."""
    import importlib

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(f"vitlab.cli.{module}"), "run", interrupted)
    assert main([command, *argv]) == 130
    assert capsys.readouterr().err == (f"vitlab {command}: interrupted; run it again with --resume to go on from "
                                       "where it stopped\n")


@pytest.mark.parametrize("command", ["train", "finetune", "sweep", "eval", "fewshot"])
def test_every_command_that_reads_data_names_every_form_it_reads(command):
    """train's --data named ImageFolders, archives, digits and shards, not the Hugging Face datasets and parquet
    files it streams (docs/scale.md), which eval's and fewshot's name."""
    data = next(a for a in build_parser().commands[command]._actions if "--data" in a.option_strings)
    for form in ("ImageFolder", ".tar.gz", "digits", "shards/*.tar", "save_to_disk", "parquet"):
        assert form in data.help, (command, form)


def test_the_help_of_a_flag_says_what_it_does_in_its_command():
    """sweep shares train's flags, and its help was train's: --lr the "base learning rate" (a sweep refuses it:
    every run's rate is the grid's), --show-config the config with its memory estimate (it prints the plan),
    --val-split the held-out split (the final run's alone; the grid is compared on --holdout).  vtab's --set
    named none of the fields it refuses, and its --overwrite only the finished runs it also trains again."""
    from vitlab.train.vtab import PER_RUN_FIELDS

    helps = {command: {a.dest: a.help for a in build_parser().commands[command]._actions}
             for command in ("train", "sweep", "vtab")}
    assert helps["train"]["lr"] == "base learning rate" and helps["sweep"]["lr"].startswith("refused")
    assert "plan" in helps["sweep"]["show_config"] and "memory_estimate" not in helps["sweep"]["show_config"]
    assert "final run" in helps["sweep"]["val_split"] and "final run" in helps["sweep"]["val_data"]
    assert all(name in helps["vtab"]["overrides"] for name in PER_RUN_FIELDS)
    assert "stopped" in helps["vtab"]["overwrite"]



def test_under_torchrun_a_refusal_is_printed_once_and_every_process_exits_with_it(capsys, monkeypatch):
    """Every process of a torchrun launch reads the same arguments and met the same refusal: each printed
    it (N lines for N processes).  Rank 0 prints its own and posts it in torchrun's store; another rank
    prints its own unless it is rank 0's.  (torchrun's agent keeps the store; here the test does.)"""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(store.port)),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    refused = ["train", "--recipe", "demo", "--data", "digits", "--batch-size", "15", "--quiet"]
    line = ("vitlab train: error: optim.batch_size=15 is not divisible by optim.accum_steps=1 x world_size=2 = 2: "
            "every micro-batch must have the same size\n")
    for rank, printed in (("0", line), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        assert main(refused) == 2
        assert capsys.readouterr().err == printed
    assert main(["eval", "--checkpoint", "no/such/run"]) == 2  # rank 1's own error, not rank 0's: printed
    assert capsys.readouterr().err == "vitlab eval: error: no such file or directory: no/such/run\n"
    for rank, printed in (("0", True), ("1", False)):  # argparse's refusals too
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--recipe", "demo", "--bogus"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (
            "vitlab train: error: unrecognized arguments: --bogus (see vitlab train --help)\n" if printed else "")


# every command whose whole path takes a non-square input (the training loop, the data, the evaluators,
# the weights' resampling, the cost figures, the exports): each takes --img-size as N or HxW
IMG_SIZE_COMMANDS = {"train", "finetune", "sweep", "vtab", "flops", "inspect", "eval", "fewshot", "export", "convert",
                     "predict"}


def img_size_actions():
    parser = build_parser()
    return {name: action for name, sub in parser.commands.items() for action in sub._actions
            if "--img-size" in action.option_strings}


def test_every_command_takes_img_size_as_n_or_hxw_with_one_wording():
    """flops, inspect, eval, fewshot, train, finetune, sweep and vtab took --img-size N only (type=int: 16x24
    was "invalid int value"), where export and convert took HxW."""
    from vitlab.cli import image_size

    actions = img_size_actions()
    assert set(actions) == IMG_SIZE_COMMANDS
    for name, action in actions.items():
        assert action.type is image_size and action.metavar == "N|HxW", name
        assert action.help.startswith("N (square) or HxW pixels, e.g. 384 or 384x512: "), name
        assert action.type("16x24") == (16, 24) and action.type("16,24") == (16, 24) and action.type("16") == 16


@pytest.mark.parametrize("command", sorted(IMG_SIZE_COMMANDS))
@pytest.mark.parametrize("value", ["16x0", "16x24x3", "abc", "-16", "1.5"])
def test_a_bad_img_size_is_the_same_one_line_refusal_in_every_command(command, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--img-size", value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"vitlab {command}: error: argument --img-size: {value!r}: expected a positive "
                                       f"size N or HxW, e.g. 384 or 384x512 (see vitlab {command} --help)\n")


def test_flops_names_both_sides_of_a_non_square_size(capsys):
    """`flops --img-size 224x320` (then refused as an int) gave its figures for 224x224 if given a pair."""
    from vitlab.analysis.cost import model_flops
    from vitlab.models.registry import get_config

    assert main(["flops", "ViT-B/16", "--img-size", "224x320"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ViT-B/16 at 224x320, forward")
    gflops = model_flops(get_config("ViT-B/16"), (224, 320)) / 1e9
    assert f"{gflops:10.2f} GFLOPs" in out and gflops != pytest.approx(model_flops(get_config("ViT-B/16")) / 1e9)


def test_models_lists_a_non_square_registration_by_both_sides(capsys, monkeypatch):
    from vitlab.models import registry

    wide = lambda: registry.get_config("ViT-Ti/16", img_size=(224, 320))  # noqa: E731
    monkeypatch.setitem(registry._REGISTRY, "ViT-wide/16", wide)
    assert main(["models", "--filter", "wide"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()  # model, parameters, resolution, GFLOPs
    assert (row[0], row[2]) == ("ViT-wide/16", "224x320")
