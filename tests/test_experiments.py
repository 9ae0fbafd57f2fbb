"""Every experiment's --quick form runs on the digits and writes its table, JSON and section."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vitlab import experiments
from vitlab.cli import main
from vitlab.experiments.tables import aggregate, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_aggregate_mean_and_std():
    rows = [dict(m="a", acc=0.5), dict(m="a", acc=0.7), dict(m="b", acc=0.1)]
    table = aggregate(rows, ["m"], ["acc"])
    assert table[0]["n"] == 2 and table[0]["acc"] == pytest.approx(0.6)
    assert table[0]["acc_std"] == pytest.approx(0.1414, abs=1e-3) and table[1]["acc_std"] == 0.0
    assert "0.6 ± 0.14" in markdown_table(table, ["m"], ["acc"])
    # a metric equal in every seed (FLOPs, parameters) is shown without a spread
    rows = [dict(m="a", gflops=0.3, steps=90.0), dict(m="a", gflops=0.3, steps=350.0)]
    text = markdown_table(aggregate(rows, ["m"], ["gflops", "steps"]), ["m"], ["gflops", "steps"])
    assert "| a | 0.3 | 220 ± 184 | 2 |" in text


def test_the_machine_names_a_gpu_only_where_the_runs_trained_on_it(monkeypatch):
    """--device cpu on a machine with a GPU was recorded as run on that GPU."""
    import torch

    from vitlab.experiments.tables import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"GPU{index}")
    assert "GPU" not in machine("cpu")
    assert machine("auto").endswith(", GPU0") and machine("cuda").endswith(", GPU0")
    assert machine("cuda:1").endswith(", GPU1")


def test_list(capsys):
    assert main(["experiment", "--list"]) == 0
    text = capsys.readouterr().out
    for name in experiments.EXPERIMENTS:
        assert name in text


def test_list_with_a_name_shows_that_one_and_a_misspelt_name_is_suggested(capsys):
    # --list NAME printed every experiment (the name had no effect); an unknown name got no suggestion
    assert main(["experiment", "--list", "posemb"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("posemb ") and lines[1].strip().startswith("paper: Table 8")
    for argv in (["posmb", "--list"], ["posmb", "--quick"]):
        assert main(["experiment", *argv]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("vitlab experiment: error: unknown experiment 'posmb'. Did you mean posemb? Choose from ")


def test_quick_settings_are_small():
    for name in experiments.EXPERIMENTS:
        s = experiments.settings(name, quick=True)
        assert s.data == "digits" and s.seeds == 1 and s.time_limit == 0
        full = experiments.settings(name)
        assert full.seeds >= 2  # a spread over seeds in every default-size table


@pytest.mark.parametrize("name", list(experiments.EXPERIMENTS))
def test_quick_form(name, tmp_path):
    out = tmp_path / name
    # posemb-similarity and shape train models of 64 tokens: fewer steps keep the file fast (compute's
    # steps are its budgets')
    fewer = [] if name == "compute" else ["--set", "steps=6"]
    assert main(["experiment", name, "--quick", "--out", str(out), "--threads", "1", *fewer]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["experiment"] == name and result["rows"] and result["table"]
    assert (out / "results.md").read_text().startswith("|")
    section = (out / "section.md").read_text()
    assert f"vitlab experiment {name}" in section and "Machine:" in section
    # the table read alone (docs link results.md) says where it came from: it said nothing
    provenance = [line for line in section.splitlines() if line.startswith(("Command:", "Machine:", "Date:"))]
    assert len(provenance) == 3 and (out / "results.md").read_text().endswith("\n\n" + "\n".join(provenance) + "\n")
    # both are rendered from the record alone, so a stored results.json gives them again (nothing trained)
    assert section == experiments.section_markdown(result, figure=(out / "figure.png").exists())
    assert any(r.get("val_top1") is not None for r in result["rows"])
    if name == "resolution":  # fine-tuned at the pre-training size and at 1.5x it (Figure 12: tests/perf/test_figure12.py)
        assert [(r["part"], r["img_size"]) for r in result["rows"]] == [("finetune", 16), ("finetune", 24)]
    if name == "posemb-similarity":  # seed 0's similarity map of every setting is kept beside the table
        pytest.importorskip("matplotlib")
        assert sorted(p.name for p in out.glob("similarity-*.png")) == [
            "similarity-p2-lr0.001.png", "similarity-p2-lr0.003.png", "similarity-p4-lr0.001.png",
            "similarity-p4-lr0.003.png"]
    if name == "compute":  # ViT+Muon is charged its orthogonalisation: fewer steps for the same compute
        by = {(r["model"], r["budget"]): r for r in result["rows"]}
        for budget in experiments.settings(name, quick=True).get("budgets"):
            vit, muon = by[("ViT", budget)], by[("ViT+Muon", budget)]
            assert muon["steps"] < vit["steps"] and muon["gflops_per_image"] == vit["gflops_per_image"]
            assert abs(muon["train_eflops"] - vit["train_eflops"]) <= muon["train_eflops"] / muon["steps"]
    if name == "mpp":  # the three targets of Appendix B.1.2 against scratch, at the same budget
        assert {r["run"] for r in result["rows"]} == {"scratch", "mpp:color+finetune", "mpp:color4x4+finetune",
                                                     "mpp:pixels+finetune"}


def test_findings_block_is_replaced(tmp_path):
    from vitlab.cli.experiment import update_findings

    doc = tmp_path / "findings.md"
    doc.write_text("# Findings\n\nintro\n")
    update_findings(str(doc), "head", "### head\nfirst\n", str(tmp_path / "results/head"))
    update_findings(str(doc), "head", "### head\nsecond\n", str(tmp_path / "results/head"))
    text = doc.read_text()
    assert "intro" in text and "second" in text and "first" not in text
    # the author's reading below the marker survives a re-run; the generated part above it does not
    doc.write_text(text.replace("<!-- /experiment:head -->", "<!-- reading -->\nReading: kept.\n\n<!-- /experiment:head -->"))
    update_findings(str(doc), "head", "### head\nthird\n", str(tmp_path / "results/head"))
    text = doc.read_text()
    assert "third" in text and "second" not in text and text.count("Reading: kept.") == 1
    assert text.index("third") < text.index("<!-- reading -->") < text.index("Reading: kept.")


def test_findings_markers_that_make_no_one_block_are_refused_before_any_run(tmp_path, capsys):
    """A begin marker left alone got a new pair appended, and the next run replaced everything from
    the lone marker to that pair's end: the author's text between them was lost."""
    doc = tmp_path / "findings.md"
    for text in ("# F\n<!-- experiment:head -->\nmy notes, kept\n",
                 "<!-- experiment:head -->\na\n<!-- /experiment:head -->\n<!-- experiment:head -->\nb\n"
                 "<!-- /experiment:head -->\n",
                 "<!-- /experiment:head -->\nmy notes\n<!-- experiment:head -->\n"):
        doc.write_text(text)
        out = tmp_path / "x"
        assert main(["experiment", "head", "--quick", "--out", str(out), "--findings", str(doc)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: --findings {doc}: <!-- experiment:head --> appears ")
        assert line.endswith("expected one of each, in that order (or neither: the section is appended): fix the "
                             "markers")
        assert doc.read_text() == text and not out.exists()


def test_a_findings_write_that_fails_leaves_the_file_as_it_was(tmp_path):
    """The file was truncated and written in place: a full disk (here a file-size limit) left the
    hand-written document cut short."""
    doc = tmp_path / "findings.md"
    original = "# Findings\n\n" + "hand-written text. " * 100 + "\n"
    doc.write_text(original)
    script = (
        "import resource, signal, sys\n"
        "from vitlab.cli.experiment import update_findings\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(original) + 100}, {len(original) + 100}))\n"
        "try:\n"
        f"    update_findings({str(doc)!r}, 'head', '### head\\n' + 'x' * 500, {str(tmp_path / 'r')!r})\n"
        "except OSError as err:\n"
        "    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert doc.read_text() == original
    assert done.stdout.startswith(f"--findings {doc}: could not be written (File too large); the section is in ")
    assert os.listdir(tmp_path) == ["findings.md"]  # no temporary file left


def test_set_values_are_read_as_the_train_config_reads_them():
    from vitlab.cli.experiment import parse_settings

    # the type of each setting's default decides: a bool, a tuple, a bare word, a float
    assert parse_settings("mpp", False, ["all_targets=false", "budgets=[3.0, 9.0]", "targets=color4x4",
                                         "lr=2e-3", "time_limit=1", "resume=True"]) == dict(
        all_targets=False, budgets=(3.0, 9.0), targets="color4x4", lr=2e-3, time_limit=1.0, resume=True)
    assert parse_settings("resolution", True, ["finetune_size=40", "pretrain_minutes=0.5"]) == dict(
        finetune_size=40, pretrain_minutes=0.5)  # a setting of the full size, set on the quick form
    with pytest.raises(ValueError, match="all_targets='maybe': expected true or false"):
        parse_settings("mpp", False, ["all_targets=maybe"])


def test_settings_carry_the_trainers_names_and_accept_the_former_ones(tmp_path, capsys):
    from vitlab.config import ConfigError
    from vitlab.cli.experiment import parse_settings
    from vitlab.configs import load_recipe

    s = experiments.settings("shape", batch=32, heads=4, mlp=96, patch=2, val=100, minutes=0.5)
    assert (s.batch_size, s.num_heads, s.mlp_dim, s.patch_size, s.val_split, s.time_limit) == (32, 4, 96, 2, 100, 0.5)
    assert parse_settings("shape", False, ["heads=4", "minutes=0"]) == dict(num_heads=4, time_limit=0.0)
    # the full size trains on the CIFAR-10 recipe's data; --data overrides it
    assert s.data == load_recipe("cifar10_scratch").data.source
    assert experiments.settings("shape", data=str(tmp_path)).data == str(tmp_path)
    with pytest.raises(ConfigError, match="experiment mpp: unknown setting 'budget'. Did you mean budgets"):
        experiments.settings("mpp", budget=(3.0,))
    # a typo is refused in one line before any work, as the trainer's --set refuses one
    assert main(["experiment", "data-scale", "--quick", "--out", str(tmp_path / "x"), "--set", "sizez=[10]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("vitlab experiment: error: experiment data-scale: unknown setting 'sizez'. Did you mean sizes")
    assert not (tmp_path / "x").exists()


def test_no_seeds_or_a_findings_folder_are_refused_before_any_run(tmp_path, capsys):
    # --seeds 0 ran nothing and wrote an empty table over the folder's results; a --findings
    # folder was refused only after every run, as "[Errno 21] Is a directory"
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.md").write_text("kept")
    for seeds in ("0", "-1"):
        assert main(["experiment", "head", "--quick", "--out", str(tmp_path / "x"), "--seeds", seeds]) == 2
        assert capsys.readouterr().err.strip() == f"vitlab experiment: error: seeds={seeds}: must be a positive integer"
    assert main(["experiment", "head", "--quick", "--out", str(tmp_path / "x"), "--findings", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab experiment: error: --findings='{tmp_path}' is a folder; "
                                              "expected a file to write")
    assert os.listdir(tmp_path / "x") == ["results.md"] and (tmp_path / "x" / "results.md").read_text() == "kept"


def test_an_experiments_own_settings_of_the_wrong_shape_are_refused_before_any_run(tmp_path, capsys):
    # sizes=2000 and sizes=[2000, ended in a TypeError traceback, lrs=abc was iterated letter by letter
    # into runs at lr 'a', sizes=[] ran nothing and wrote an empty table over the folder's results
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.md").write_text("kept")
    for name, item, said in (
            ("data-scale", "sizes=2000", "sizes=2000: expected a non-empty list of integers, such as [2000, "),
            ("data-scale", "sizes=[2000,", "sizes='[2000,': expected a non-empty list of integers, such as [2000, "),
            ("data-scale", "sizes=[]", "sizes=(): expected a non-empty list of integers"),
            ("data-scale", "sizes=[2.5]", "sizes=(2.5,): expected a non-empty list of integers"),
            ("data-scale", "shots=abc", "shots='abc': expected a non-empty list of integers, such as [5, 10, 25]"),
            ("head", "lrs=abc", "lrs='abc': expected a non-empty list of numbers, such as [0.0008, 0.0003]"),
            ("optimiser", "settings=[['adam']]", "settings=(['adam'],): expected a non-empty list, such as [[")):
        assert main(["experiment", name, "--quick", "--out", str(tmp_path / "x"), "--set", item]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: experiment {name}: {said}"), line
    assert os.listdir(tmp_path / "x") == ["results.md"] and (tmp_path / "x" / "results.md").read_text() == "kept"
    # what either form holds is taken: the quick form's integer budget and the full form's fractional one
    assert experiments.settings("mpp", quick=True, budgets=(1.5,)).get("budgets") == (1.5,)
    assert experiments.settings("optimiser", settings=[["sgd", 0.1]]).get("settings") == [["sgd", 0.1]]


def test_a_setting_an_experiments_runs_do_not_read_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """Accepted and ignored: compute's steps come from its budgets (--steps 5 trained the budgets' steps),
    mpp's, resolution's and transfer's minutes from their budgets and *_minutes (--time-limit did nothing),
    head's and posemb-similarity's learning rates from lrs, optimiser's from its settings and its model is a
    ResNet, transfer's full form pins its model; the table and results.json then recorded the value given."""
    trained = record_training(monkeypatch)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.md").write_text("kept")
    for name, argv, said in (
            ("compute", ["--steps", "5"], "steps=5: its runs do not read it; each model's steps are its budget's"),
            ("compute", ["--time-limit", "1"], "time_limit=1.0: its runs do not read it;"),
            ("mpp", ["--time-limit", "1"], "time_limit=1.0: its runs do not read it; each run's minutes are its "
                                           "budget's"),
            ("resolution", ["--time-limit", "1"], "time_limit=1.0: its runs do not read it; pretrain_minutes and "),
            ("transfer", ["--time-limit", "1"], "time_limit=1.0: its runs do not read it; pretrain_minutes and "),
            ("head", ["--set", "lr=0.5"], "lr=0.5: its runs do not read it; each run's learning rate is one of lrs"),
            ("posemb-similarity", ["--set", "lr=0.5"], "lr=0.5: its runs do not read it; "),
            ("posemb-similarity", ["--set", "patch_size=2"], "patch_size=2: its runs do not read it; "),
            ("optimiser", ["--set", "lr=0.5"], "lr=0.5: its runs do not read it; "),
            ("optimiser", ["--set", "width=64"], "width=64: its runs do not read it; it trains a ResNet")):
        for form in (["--quick"], []):
            assert main(["experiment", name, *form, "--out", str(tmp_path / "x"), *argv]) == 2
            (line,) = capsys.readouterr().err.splitlines()
            assert line.startswith(f"vitlab experiment: error: experiment {name}: {said}"), line
    # transfer's full form trains the model its setting `model` pins; the quick form builds it from these
    for item in ("width=64", "depth=3", "img_size=48", "patch_size=2"):
        assert main(["experiment", "transfer", "--out", str(tmp_path / "x"), "--set", item]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: experiment transfer: {item}: its runs do not read it; "
                               "the setting model pins the architecture"), line
    assert experiments.settings("transfer", quick=True, width=64, img_size=24).width == 64
    assert trained == [] and os.listdir(tmp_path / "x") == ["results.md"]


def test_an_experiments_counts_below_one_are_refused_by_name(tmp_path, capsys):
    # sizes=[-1] was refused by the trainer as "data.val_split=300: takes 300 of the 299 examples", naming
    # neither sizes nor what it takes; a setting whose defaults are positive integers (sizes, budgets,
    # shots, total...) is a count, and mpp's budgets, 0 in the quick form, is not
    for name, item, said in (
            ("data-scale", "sizes=[-1]", "sizes=(-1,): expected a non-empty list of integers above 0, such as [2000, "),
            ("data-scale", "shots=[0]", "shots=(0,): expected a non-empty list of integers above 0, such as [5, "),
            ("compute", "budgets=[10,0]", "budgets=(10, 0): expected a non-empty list of integers above 0")):
        assert main(["experiment", name, "--quick", "--out", str(tmp_path / "x"), "--set", item]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: experiment {name}: {said}"), line
    assert experiments.settings("mpp", quick=True, budgets=(0,)).get("budgets") == (0,)


def test_every_value_of_a_list_setting_is_checked_before_the_first_run(tmp_path, capsys, monkeypatch):
    # lrs=[0.001,-1] trained both of lr 0.001's runs, then was refused as "optim.lr=-1: must be a number >= 0"
    # when lr -1's started, naming neither the experiment nor lrs (minutes per run in the full forms)
    trained = record_training(monkeypatch)
    for name, item, said in (
            ("head", "lrs=[0.001,-1]", "lrs=(0.001, -1): -1 is refused as a run's optim.lr: optim.lr=-1: must be a "),
            ("posemb-similarity", "patches=[4,3]", "patches=(4, 3): 3 is refused as a run's model.patch_size: "),
            ("posemb-similarity", "lrs=[0.001,-1]", "lrs=(0.001, -1): -1 is refused as a run's optim.lr: "),
            ("optimiser", 'settings=[["sgd",0.1],["adamx",0.1]]', "settings=(['sgd', 0.1], ['adamx', 0.1]): "
                                                                  "['adamx', 0.1] is refused as a run's optim.optimizer"
                                                                  " and optim.lr: optim.optimizer='adamx': allowed"),
            ("mpp", "budgets=[0,-1]", "budgets=(0, -1): -1 is refused as a run's run.time_limit: ")):
        assert main(["experiment", name, "--quick", "--out", str(tmp_path / "x"), "--set", item]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: experiment {name}: {said}"), line
    assert trained == [] and not (tmp_path / "x").exists()
    # a value each run takes is taken, and a ViT the settings refuse is left to the runs to name: optimiser's
    # are a ResNet's
    assert experiments.settings("head", quick=True, lrs=[0.5, 0.01]).get("lrs") == [0.5, 0.01]
    assert experiments.settings("optimiser", quick=True, img_size=18).img_size == 18


def test_an_out_folder_that_cannot_be_is_refused_naming_the_flag_as_typed(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["experiment", "head", "--quick", "--out", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.strip() == (f"vitlab experiment: error: --out='{tmp_path / 'f'}' is a file; "
                                              "expected a folder (a new one, or a run's)")


def test_data_scale_refuses_sizes_the_data_does_not_hold_before_any_run(tmp_path, capsys, monkeypatch):
    # sizes=[1600, 3000] on the digits (1,797 examples, 300 held out) trained both on the 1,497 left and
    # labelled the rows 1600 and 3000: two identical rows at sizes that never trained
    trained = record_training(monkeypatch)
    args = ["experiment", "data-scale", "--quick", "--out", str(tmp_path / "x"), "--threads", "1"]
    assert main(args + ["--set", "sizes=[200,1600,3000]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("vitlab experiment: error: experiment data-scale: sizes [1600, 3000]: the data holds "
                           "1797 examples, 1497 after val_split=300"), line
    assert trained == [] and not (tmp_path / "x" / "results.json").exists()
    # every example left is a size it has: the run trains on all of them
    assert main(args + ["--set", "sizes=[1497]", "--set", "steps=1", "--set", "shots=[5]"]) == 0
    summary = json.loads((tmp_path / "x" / "runs" / "ViT-1497-s0" / "summary.json").read_text())
    assert summary["train_examples"] == 1497


def test_data_scale_tables_every_few_shot_count_it_evaluated(tmp_path):
    """The table's columns were fixed at fewshot_5 and fewshot_10: the default shots [5, 10, 25] left the
    25-shot accuracy in results.json's rows alone, and shots=[1, 2] gave a table with no few-shot column."""
    out = tmp_path / "x"
    assert main(["experiment", "data-scale", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=1",
                 "--set", "sizes=[200]", "--set", "shots=[1,2]"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert all(r["fewshot_1"] is not None and r["fewshot_2"] is not None for r in result["table"])
    header = (out / "results.md").read_text().splitlines()[0]
    assert header == "| model | examples | val_top1 | fewshot_1 | fewshot_2 | wall_s | train_eflops | n |"
    assert header in (out / "section.md").read_text()


def test_data_scale_refuses_a_size_that_can_evaluate_none_of_the_shots_before_any_run(tmp_path, capsys,
                                                                                       monkeypatch):
    """sizes=[30] (3 training examples of the smallest class) with shots=[5, 25] trained both runs and
    tabled a 1-shot accuracy (max(1, 3 // 3)) that nobody asked for."""
    trained = record_training(monkeypatch)
    assert main(["experiment", "data-scale", "--quick", "--out", str(tmp_path / "x"), "--threads", "1",
                 "--set", "batch_size=8", "--set", "sizes=[30,200]", "--set", "shots=[5,25]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("vitlab experiment: error: experiment data-scale: sizes [30] can evaluate none of shots [5, 25]: "
                    "the smallest class of their few-shot pool has 3 examples and a k-shot probe needs k + 2; "
                    "give smaller shots or larger sizes")
    assert trained == [] and not (tmp_path / "x" / "results.json").exists()


def test_data_scale_says_and_records_the_shots_a_size_could_not_evaluate(tmp_path, capsys):
    """A shot count too large for a size's pool was dropped from that row without a word."""
    out = tmp_path / "x"
    assert main(["experiment", "data-scale", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=1",
                 "--set", "batch_size=8", "--set", "sizes=[60,200]", "--set", "shots=[1,5,25]"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "not evaluated" in line]
    assert said == ["data-scale: not evaluated, a pool's smallest class having fewer than k + 2 examples: "
                    "shots [5, 25] at 60 examples; shots [25] at 200 examples"]
    result = json.loads((out / "results.json").read_text())
    assert result["shots_not_evaluated"] == {"60": [5, 25], "200": [25]}
    assert {tuple(sorted(k for k in r if k.startswith("fewshot_"))) for r in result["rows"] if r["examples"] == 60} \
        == {("fewshot_1",)}
    assert all(r["fewshot_5"] is not None for r in result["rows"] if r["examples"] == 200)


def test_attention_distance_probes_every_class_of_the_held_out_split():
    """A folder's images come class by class and the held-out indices are sorted: the first 512 of
    them, the default's probe, were CIFAR-10's 500 held-out airplanes and 12 automobiles."""
    import torch

    from vitlab.experiments import attention_distance
    from vitlab.experiments.common import split

    labels = torch.arange(10).repeat_interleave(100)  # an ImageFolder's order
    s = experiments.settings("attention-distance", quick=True, val_split=500, images=50)
    idx = attention_distance.probe_indices(s, labels)
    assert set(idx.tolist()) <= set(split(s, labels)[1].tolist())
    assert torch.bincount(labels[idx], minlength=10).tolist() == [5] * 10
    # asked for more than are held out: every held-out image
    assert attention_distance.probe_indices(experiments.settings("attention-distance", quick=True, val_split=500,
                                                                 images=600), labels).tolist() == \
        split(s, labels)[1].tolist()


def test_a_fine_tunes_training_flops_are_the_model_it_trains(tmp_path, monkeypatch):
    """train_vit counted every run's train_eflops for the recipe's model with a 10-class head: a fine-tune
    (the resolution, mpp and transfer experiments') was charged the FLOPs of a model it did not train, not
    those of its init's architecture at the fine-tuning size with a head for its data's classes (here 47 times
    as many), or None where the recipe's model could not take that size (24 px, for ViT-Ti/16's 16-px patches)."""
    import vitlab
    from vitlab.analysis.cost import model_flops
    from vitlab.experiments import common
    from vitlab.train.build import make_model

    init = tmp_path / "init"  # another width, depth and head than the settings' ViT, with a pre-logits layer
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=16, patch_size=4, width=24, depth=1, num_heads=2,
                                          mlp_dim=48, num_classes=3, representation_size=24), init)

    def trained(cfg, **kw):  # a run of 7 steps on data of five classes, as transfer's fine-tune is
        Path(cfg.run.out).mkdir(parents=True)
        (Path(cfg.run.out) / "classes.json").write_text(json.dumps(list("abcde")))
        return {"steps": 7, "classes": str(Path(cfg.run.out) / "classes.json")}

    monkeypatch.setattr(common, "train", trained)
    settings = common.Settings()
    changes = {"model.init": str(init), "model.overrides": {}, "model.img_size": 32}
    summary = common.train_vit(settings, tmp_path / "ft", 0, common.vit_overrides(settings), changes)
    # what the run's summary.json counts (train_flops_per_image) for the model its trainer builds
    model = make_model(common.train_config(settings, tmp_path / "ft", 0, common.vit_overrides(settings), changes),
                       5, (32, 32))
    assert (model.cfg.width, model.cfg.depth, model.cfg.num_classes, model.pre_logits) == (24, 1, 5, None)
    per_image = 3 * model_flops(model.cfg, (32, 32), training=True)
    assert summary["train_eflops"] == pytest.approx(per_image * 7 * settings.batch_size / 1e18, rel=1e-12)


def test_resume_takes_no_rows_measured_as_an_earlier_version_measured_them(tmp_path, monkeypatch):
    """results/attention-distance/results.json was measured on the split's first images: --resume on a
    fresh checkout took its seeds' rows beside new seeds' measured on every class.  A file without the
    experiment's VERSION (its measurement's) is an earlier version's."""
    import shutil

    out = tmp_path / "x"
    args = ["experiment", "attention-distance", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=1",
            "--set", "images=8", "--resume"]
    assert main(args) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["version"] == experiments.get("attention-distance").VERSION == 2
    trained = record_training(monkeypatch)
    for version, retrained in ((2, False), (None, True), (1, True)):
        (out / "results.json").write_text(json.dumps({k: v for k, v in dict(result, version=version).items()
                                                      if v is not None}))
        shutil.rmtree(out / "runs", ignore_errors=True)
        trained.clear()
        assert main(args) == 0
        assert bool(trained) == retrained
        assert json.loads((out / "results.json").read_text())["seeds_from_earlier_results"] == ([] if retrained
                                                                                               else [0])


def test_mpp_refuses_a_pretrain_share_that_leaves_the_fine_tuning_no_step_before_any_run(tmp_path, capsys,
                                                                                        monkeypatch):
    # pretrain_share=1.5 (or 1.0, or steps=1) pre-trained, then failed as "optim.steps=-2: must be a
    # positive integer", naming neither setting
    trained = record_training(monkeypatch)
    for items, said in ((["pretrain_share=1.5"], "pretrain_share=1.5: expected a number between 0 and 1"),
                        (["pretrain_share=1.0"], "pretrain_share=1.0: expected a number between 0 and 1"),
                        (["pretrain_share=0"], "pretrain_share=0.0: expected a number between 0 and 1"),
                        (["steps=1"], "steps=1: leaves the fine-tuning no step after 1 of pre-training")):
        sets = [a for item in items for a in ("--set", item)]
        assert main(["experiment", "mpp", "--quick", "--out", str(tmp_path / "x"), "--set", "targets=color",
                     *sets]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"vitlab experiment: error: experiment mpp: {said}"), line
    assert trained == [] and not (tmp_path / "x" / "runs").exists()


def record_training(monkeypatch) -> list[str]:
    """The output folders of the runs the experiments train (``vitlab.train.train``) from now on, in order."""
    from vitlab.experiments import common

    trained = []
    real_train = common.train
    monkeypatch.setattr(common, "train", lambda cfg, **kw: trained.append(cfg.run.out) or real_train(cfg, **kw))
    return trained


def test_resume_on_a_fresh_checkout_takes_earlier_seeds_from_results_json(tmp_path, monkeypatch):
    """Run folders are not kept in git: on a fresh checkout ``--resume`` with more seeds takes the
    finished seeds' rows from results.json and trains only the new seeds, unless the size changed."""
    import shutil

    out = tmp_path / "head"
    args = ["experiment", "head", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=3", "--resume"]
    trained = record_training(monkeypatch)
    assert main(args) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    per_seed = len(trained)
    shutil.rmtree(out / "runs")  # what a clone of the repository holds: results.json, no runs
    trained.clear()
    assert main(args + ["--seeds", "3"]) == 0
    assert len(trained) == 2 * per_seed and not any(run.endswith("-s0") for run in trained)
    again = json.loads((out / "results.json").read_text())
    assert [r for r in again["rows"] if r["seed"] == 0] == rows
    assert sorted({r["seed"] for r in again["rows"]}) == [0, 1, 2]
    assert again["seeds_from_earlier_results"] == [0]
    assert "seed 0 from the earlier results.json" in (out / "section.md").read_text()

    # seed 1's folders are there now (an interrupted invocation leaves them): the run-by-run
    # check decides for seed 1, results.json for seeds 0 and 2, whose folders are gone
    shutil.rmtree(out / "runs")
    (out / "runs" / (trained[0].rsplit("/", 1)[-1][:-3] + "-s1")).mkdir(parents=True)
    trained.clear()
    assert main(args + ["--seeds", "3"]) == 0
    assert len(trained) == per_seed and all(run.endswith("-s1") for run in trained)

    # another size (here the steps) is another experiment: every seed trains
    shutil.rmtree(out / "runs")
    trained.clear()
    assert main(args[:-2] + ["steps=4", "--resume"]) == 0
    assert len(trained) == per_seed and all(run.endswith("-s0") for run in trained)


def test_resume_takes_no_rows_from_another_experiments_results_json(tmp_path, monkeypatch):
    """head's and posemb's quick forms have the same settings: posemb --resume into a folder whose
    results.json head wrote (its runs not kept, as on a fresh checkout) trained nothing and wrote head's
    rows as posemb's table, every posemb and place None."""
    import shutil

    out = tmp_path / "x"
    common = ["--quick", "--out", str(out), "--threads", "1", "--set", "steps=1"]
    assert main(["experiment", "head", *common]) == 0
    shutil.rmtree(out / "runs")
    trained = record_training(monkeypatch)
    assert main(["experiment", "posemb", *common, "--resume"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["experiment"] == "posemb" and result["seeds_from_earlier_results"] == []
    assert len(trained) == 8 and all("classifier" not in r for r in result["rows"])
    assert {(r["posemb"], r["place"]) for r in result["table"]} == set(experiments.get("posemb").SETTINGS)


@pytest.mark.parametrize("name", ["results.json", "results.md", "section.md"])
def test_a_full_disk_at_an_experiments_record_keeps_the_earlier_one(name, tmp_path, monkeypatch, capsys):
    """Written in place, a full disk at results.json left it truncated: the earlier invocation's rows, which
    --resume takes on a fresh checkout (its runs are not kept in git), were lost; results.md and section.md
    (the findings' table and section) were cut short the same way."""
    from helpers.full_disk import fill_disk_at

    out = tmp_path / "head"
    args = ["experiment", "head", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=3", "--resume"]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    fill_disk_at(monkeypatch, name)
    assert main(args) != 0
    monkeypatch.undo()
    capsys.readouterr()
    assert (out / name).read_bytes() == before[name]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(before)  # no temporary file left


def test_resume_trains_only_what_is_missing(tmp_path, monkeypatch):
    out = tmp_path / "transfer"
    args = ["experiment", "transfer", "--quick", "--out", str(out), "--threads", "1", "--set", "steps=4", "--resume"]
    trained = record_training(monkeypatch)
    assert main(args) == 0
    first = sorted(trained)
    assert first and all(run.endswith("-s0") for run in first)
    rows = json.loads((out / "results.json").read_text())["rows"]

    # a run folder no setting of this experiment names is not counted as reused
    stale = out / "runs" / "stale-s0"
    stale.mkdir()
    (stale / "summary.json").write_text("{}")
    trained.clear()  # a second seed: seed 0's runs are reused, only seed 1's train
    assert main(args + ["--seeds", "2"]) == 0
    assert sorted(trained) == [run[:-1] + "1" for run in first]
    again = json.loads((out / "results.json").read_text())
    assert [r for r in again["rows"] if r.get("seed", 0) == 0] == rows
    assert again["runs_from_earlier_invocations"] == len(first)
    assert "resumed:" in (out / "section.md").read_text()

    # a config saved before a field existed (here model.posemb_init, model.attn_init) reads the
    # field at its default, the behaviour that run had: still the same run
    for saved in (out / "runs").glob("*/config.json"):
        d = json.loads(saved.read_text())
        for name in ("posemb_init", "attn_init"):
            d["model"].pop(name)
        saved.write_text(json.dumps(d))
    trained.clear()
    assert main(args + ["--seeds", "2"]) == 0
    assert trained == []

    # a pre-training run trained again invalidates the fine-tuning run made from its old weights
    # (scratch does not start from it); so does a changed config (the pre-training's steps)
    pretrain_and_finetune = [run for run in first if "scratch" not in run]
    for change in (lambda: (out / "runs" / "pretrain-s0" / "summary.json").unlink(),
                   lambda: args.__setitem__(-2, "steps=5")):
        change()
        trained.clear()
        assert main(args) == 0
        assert sorted(trained) == pretrain_and_finetune


def test_resume_trains_a_model_added_to_an_experiment_for_the_finished_seeds(tmp_path, monkeypatch):
    """results.json from before ``compute`` had ViT+Muon, on a fresh checkout: ``--resume`` keeps
    the other models' rows and trains only the new model's run."""
    import shutil

    out = tmp_path / "compute"
    args = ["experiment", "compute", "--quick", "--out", str(out), "--threads", "1", "--set", "budgets=[3]",
            "--resume"]
    trained = record_training(monkeypatch)
    assert main(args) == 0
    result = json.loads((out / "results.json").read_text())
    before = [r for r in result["rows"] if r["model"] != "ViT+Muon"]
    (out / "results.json").write_text(json.dumps(dict(result, rows=before)))
    shutil.rmtree(out / "runs")
    trained.clear()
    assert main(args) == 0
    assert trained == [str(out / "runs" / "ViT+Muon-3-s0")]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r for r in rows if r["model"] != "ViT+Muon"] == before
    assert sorted(r["model"] for r in rows) == ["R+ViT", "ResNet", "ViT", "ViT+Muon"]


@pytest.mark.parametrize("record", sorted(p.parent.name for p in (ROOT / "results").glob("*/results.json")))
def test_recorded_results_read_as_the_settings_their_command_gives_today(record):
    """Every results.json in results/ records the command of its experiment; that command still
    parses, and its settings are the recorded ones (former names and all; where it ran, the
    device and threads, aside: mpp-12k-steps-gpu ran through the script beside it), so
    ``--resume`` with it takes the recorded seeds instead of training them again."""
    import shlex

    from vitlab.cli import build_parser
    from vitlab.cli.experiment import parse_settings

    result = json.loads((ROOT / "results" / record / "results.json").read_text())
    words = shlex.split(result["command"])
    assert words[:2] == ["vitlab", "experiment"]
    args = build_parser().parse_args(words[1:])
    changes = dict(seeds=args.seeds, data=args.data, steps=args.steps, time_limit=args.time_limit,
                   device=result["settings"]["device"], threads=result["settings"]["threads"])
    changes.update(parse_settings(args.name, args.quick, args.set))
    s = experiments.settings(args.name, args.quick, **changes)
    assert experiments.same_size(args.name, args.quick, result["settings"], s)
    assert not experiments.same_size(args.name, args.quick, dict(result["settings"], steps=7), s)


@pytest.mark.parametrize("record", sorted(p.parent.name for p in (ROOT / "results").glob("*/results.json")))
def test_recorded_tables_and_sections_are_what_the_generator_writes_from_results_json(record):
    """Every results/*/results.md, section.md and docs/findings.md section is what the runner writes today
    from its stored results.json (nothing trained): the stored results.md files lacked the command,
    machine and date the runner has written below the table since ba62bc4, and the resolution section
    still named Figure 12's speed sweep, which moved to benchmarks/figure12.py and was never in its table."""
    folder = ROOT / "results" / record
    result = json.loads((folder / "results.json").read_text())
    assert (folder / "results.md").read_text() == experiments.results_markdown(result)
    name = result["experiment"]
    if not (folder / "section.md").exists():  # mpp-12k-steps-gpu: run by the script beside it, no section
        return
    section = experiments.section_markdown(result, figure=(folder / "figure.png").exists())
    assert (folder / "section.md").read_text() == section
    if record == name:  # the default-size run, the one docs/findings.md shows
        findings = (ROOT / "docs" / "findings.md").read_text()
        begin = f"<!-- experiment:{name} -->\n"
        block = findings[findings.index(begin) + len(begin):findings.index(f"<!-- /experiment:{name} -->")]
        shown = section.replace("](figure.png)", f"](../results/{name}/figure.png)")
        assert block.startswith(shown + "\n<!-- reading -->\n"), f"docs/findings.md's {name} section is not section.md"


def test_every_findings_section_has_its_record():
    findings = (ROOT / "docs" / "findings.md").read_text()
    names = re.findall(r"<!-- experiment:([\w-]+) -->", findings)
    assert sorted(names) == sorted(experiments.EXPERIMENTS)
    assert all((ROOT / "results" / name / "results.json").is_file() for name in names)
