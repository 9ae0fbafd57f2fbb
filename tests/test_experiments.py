"""Every experiment's --quick form runs on the digits and writes its table, JSON and section."""
import json

import pytest

from vitlab import experiments
from vitlab.cli import main
from vitlab.experiments.common import aggregate, markdown_table


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


def test_list(capsys):
    assert main(["experiment", "--list"]) == 0
    text = capsys.readouterr().out
    for name in experiments.EXPERIMENTS:
        assert name in text


def test_quick_settings_are_small():
    for name in experiments.EXPERIMENTS:
        s = experiments.settings(name, quick=True)
        assert s.data == "digits" and s.seeds == 1 and s.minutes == 0
        full = experiments.settings(name)
        assert full.seeds >= 2  # a spread over seeds in every default-size table


@pytest.mark.parametrize("name", list(experiments.EXPERIMENTS))
def test_quick_form(name, tmp_path):
    out = tmp_path / name
    # posemb-similarity and shape train models of 64 tokens: fewer steps keep the file fast
    assert main(["experiment", name, "--quick", "--out", str(out), "--threads", "1", "--set", "steps=6"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["experiment"] == name and result["rows"] and result["table"]
    assert (out / "results.md").read_text().startswith("|")
    section = (out / "section.md").read_text()
    assert f"vitlab experiment {name}" in section and "Machine:" in section
    assert any(r.get("val_top1") is not None for r in result["rows"])
    if name == "resolution":  # Figure 12: a speed and a largest batch per model and size, and how they were got
        timed = [r for r in result["rows"] if r["part"] == "speed"]
        assert [(r["model"], r["img_size"]) for r in timed] == [("tiny", 16), ("tiny", 32)]
        for r in timed:
            assert r["img_per_s"] > 0 and 0 <= r["largest_batch"] <= 64
            assert ("per core; largest batch extrapolated" if r["device"] == "cpu" else "runs under") in r["method"]
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


def test_set_values_parse_as_literals_and_booleans():
    from vitlab.experiments.common import parse_value

    assert parse_value("false") is False and parse_value("True") is True
    assert parse_value("(3.0, 9.0)") == (3.0, 9.0) and parse_value("2e-3") == 2e-3
    assert parse_value("color4x4") == "color4x4"


def record_training(monkeypatch) -> list[str]:
    """The output folders of the runs ``vitlab.train.train`` trains from now on, in order."""
    import vitlab.train

    trained = []
    real_train = vitlab.train.train
    monkeypatch.setattr(vitlab.train, "train", lambda cfg, **kw: trained.append(cfg.run.out) or real_train(cfg, **kw))
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
