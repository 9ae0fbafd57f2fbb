"""vitlab.train.sweep: the paper's learning-rate sweep (Appendix B.1.1) as a library call, and its
edges (the command's own tests are in test_recipes_fixes.py and test_cli.py)."""
import json
from pathlib import Path

import pytest

from vitlab.config import ConfigError
from vitlab.train.sweep import run_sweep, sweep_plan


def test_run_sweep_is_the_commands_sweep_from_python(tiny, tmp_path):
    """The grid on the config's own data.val_split, the final run on all of the training set,
    the report returned and written beside the runs: what `vitlab sweep` prints, without the CLI."""
    cfg = tiny("sweep", steps=1, batch_size=16, val_split=360, tensorboard=False)
    lines = []
    report = run_sweep(cfg, grid=[0.01, 0.1], verbose=False, say=lines.append)
    assert report == json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert report["holdout"] == 360 and set(report["holdout_top1"]) == {"0.01", "0.1"}
    assert report["best_lr"] == max((0.01, 0.1), key=lambda lr: report["holdout_top1"][f"{lr:g}"])
    for lr in ("0.01", "0.1"):
        summary = json.loads((tmp_path / "sweep" / f"lr_{lr}" / "summary.json").read_text())
        assert summary["val_examples"] == 360 and summary["val_top1"] == report["holdout_top1"][lr]
    assert (report["final"]["train_examples"], report["final"]["val_examples"]) == (1797, 0)
    assert lines == [f"lr {lr}: held-out top-1 {report['holdout_top1'][lr]:.4f}" for lr in ("0.01", "0.1")]
    # an explicit hold-out, and a final run that keeps some out
    grid, runs, final, holdout = sweep_plan(cfg, (0.01,), holdout=100, final_val_split=50)
    assert (grid, holdout, [r.data.val_split for r in runs], final.data.val_split) == ((0.01,), 100, [100], 50)
    assert sweep_plan(with_split(cfg, 0), (0.01,))[3] == 0.1  # a config holding none out: 10%


def with_split(cfg, split):
    from vitlab.train.overrides import with_changes

    return with_changes(cfg, {"data.val_split": split})


@pytest.mark.parametrize("given, message", [
    ({"grid": "0.01,0.1"}, r"^grid='0.01,0.1': expected positive learning rates"),
    ({"grid": (0.01, -1)}, r"^grid=\(0.01, -1\): expected positive learning rates"),
    ({"holdout": "10%"}, r"^holdout='10%': expected a count \(500\) or a fraction \(0.1\)"),
    ({"final_val_split": "none"}, r"^final_val_split='none': expected a count"),
    ({"resume": True, "overwrite": True}, r"^resume=True and overwrite=True"),
    ({"say": "stdout"}, r"^say='stdout': expected None or a function"),
])
def test_run_sweep_refuses_bad_arguments_before_any_run(tiny, tmp_path, given, message):
    cfg = tiny("sweep", steps=1)
    with pytest.raises(ConfigError, match=message):
        run_sweep(cfg, **{"grid": (0.01,), **given})
    assert not (tmp_path / "sweep").exists()
    with pytest.raises(ConfigError, match=r"^cfg='demo': expected a TrainConfig"):
        run_sweep("demo")


def test_a_diverging_rate_loses_and_the_sweep_goes_on(tiny, tmp_path, capsys):
    """A rate whose run stops on a non-finite loss counts as lost; the sweep stopped on it with the
    grid's other rates unrun and no final run.  Every rate diverging is one line."""
    from vitlab.cli import main
    from vitlab.train.numerics import NonFiniteError

    cfg = tiny("sweep", steps=3, batch_size=16, tensorboard=False)
    lines = []
    report = run_sweep(cfg, grid=(1e30, 0.01), verbose=False, say=lines.append)
    assert report["holdout_top1"]["1e+30"] is None and report["holdout_top1"]["0.01"] is not None
    assert report["best_lr"] == 0.01 and report["final"]["steps"] == 3
    assert list(report["diverged"]) == ["1e+30"] and "not finite" in report["diverged"]["1e+30"]
    assert lines[0] == "lr 1e+30: diverged (a loss or gradients not finite), counted as lost"
    with pytest.raises(NonFiniteError, match=r"^every learning rate of the grid diverged \(1e\+30, 1e\+31\)"):
        run_sweep(cfg, grid=(1e30, 1e31), verbose=False, overwrite=True)
    out = tmp_path / "cli"
    args = ["sweep", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--steps", "3", "--grid",
            "1e30", "--out", str(out), "--quiet", "--set", "model.img_size=8", "--set", "model.patch_size=4",
            "--set", "model.width=16", "--set", "model.depth=1", "--set", "model.num_heads=2",
            "--set", "model.mlp_dim=32", "--set", "run.threads=1", "--set", "run.tensorboard=false"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "lr 1e+30: diverged (a loss or gradients not finite), counted as lost\n"
    assert captured.err.startswith("vitlab sweep: error: every learning rate of the grid diverged (1e+30)")
    assert len(captured.err.strip().splitlines()) == 1 and not (out / "final").exists()


def test_a_rate_that_diverged_is_not_trained_again_on_resume(tiny, tmp_path, monkeypatch):
    """sweep --resume trained a rate whose run had diverged again, from its last checkpoint or from
    scratch, to the same end; its record keeps it lost, unless its config changed (or --overwrite)."""
    from vitlab.train import sweep
    from vitlab.train.overrides import with_changes

    trained = []
    real_train = sweep.train

    def counting_train(cfg, **kw):
        trained.append(f"{cfg.optim.lr:g}")
        return real_train(cfg, **kw)

    monkeypatch.setattr(sweep, "train", counting_train)
    cfg = tiny("sweep", steps=3, batch_size=16, tensorboard=False, ckpt_every=1)
    first = run_sweep(cfg, grid=(1e30, 0.01), verbose=False)
    assert trained == ["1e+30", "0.01", "0.01"] and (tmp_path / "sweep" / "lr_1e+30" / "diverged.json").is_file()
    trained.clear()
    lines = []
    again = run_sweep(cfg, grid=(1e30, 0.01), resume=True, verbose=False, say=lines.append)
    assert trained == ["0.01", "0.01"]  # the finished rate and the final run resumed at their end; 1e30 untrained
    assert again["diverged"] == first["diverged"] and again["holdout_top1"] == first["holdout_top1"]
    assert lines[0] == f"lr 1e+30: diverged before ({tmp_path / 'sweep' / 'lr_1e+30' / 'diverged.json'}), counted as lost"
    trained.clear()  # a setting changed: trained (on from its last good checkpoint), its record of the new config
    skipping = with_changes(cfg, {"run.on_nonfinite": "skip", "run.max_skipped_steps": 0})
    assert list(run_sweep(skipping, grid=(1e30, 0.01), resume=True, verbose=False)["diverged"]) == ["1e+30"]
    assert trained == ["1e+30", "0.01", "0.01"]
    record = json.loads((tmp_path / "sweep" / "lr_1e+30" / "diverged.json").read_text())
    assert record["config"]["run"]["on_nonfinite"] == "skip" and "run.max_skipped_steps=0" in record["error"]


def test_a_final_run_that_diverged_is_not_trained_again_on_resume(tiny, tmp_path, monkeypatch):
    """The final run kept no record of its divergence as the grid's rates do: sweep --resume trained it again,
    from its last checkpoint or from scratch, to the same end.  It stops the sweep naming it, and --resume
    stops on its record untrained, unless its config changed."""
    from vitlab.train import sweep
    from vitlab.train.numerics import NonFiniteError
    from vitlab.train.overrides import with_changes

    trained = []
    real_train = sweep.train

    def train(cfg, **kw):
        trained.append(Path(cfg.run.out).name)
        if Path(cfg.run.out).name == "final" and cfg.run.on_nonfinite == "stop":  # made certain
            raise NonFiniteError("step 2: the training loss is not finite")
        return real_train(cfg, **kw)

    monkeypatch.setattr(sweep, "train", train)
    cfg = tiny("sweep", steps=2, batch_size=16, tensorboard=False)
    lines = []
    with pytest.raises(NonFiniteError, match=r"^the final run at lr 0.01 diverged, so the sweep has no result: "
                                             r"step 2: the training loss is not finite$"):
        run_sweep(cfg, grid=(0.01,), verbose=False, say=lines.append)
    record = tmp_path / "sweep" / "final" / "diverged.json"
    assert trained == ["lr_0.01", "final"] and record.is_file()
    assert lines[-1] == "final run at lr 0.01: diverged (a loss or gradients not finite), counted as lost"
    trained.clear()
    lines.clear()
    with pytest.raises(NonFiniteError, match=r"^the final run at lr 0.01 diverged, so the sweep has no result: "
                                             r"step 2: the training loss is not finite$"):
        run_sweep(cfg, grid=(0.01,), resume=True, verbose=False, say=lines.append)
    assert trained == ["lr_0.01"]  # the finished rate resumed at its end; the final run untrained
    assert lines[-1] == f"final run at lr 0.01: diverged before ({record}), counted as lost"
    trained.clear()  # a setting changed: trained, and the record goes
    skipping = with_changes(cfg, {"run.on_nonfinite": "skip"})
    assert run_sweep(skipping, grid=(0.01,), resume=True, verbose=False)["final"]["steps"] == 2
    assert trained == ["lr_0.01", "final"] and not record.exists()


def test_resume_refuses_runs_trained_with_other_settings(tiny, tmp_path):
    """sweep --resume with the clipping, schedule or augmentation changed (train --resume takes them as
    changed on purpose) read a finished rate's run back, scored it as the new settings' and rewrote its
    config.json to say so; an init written again at its path likewise.  Refused before any run, the runs
    as they were; the same settings, or a change of how the runs are carried out, resume."""
    from vitlab.train import train
    from vitlab.train.overrides import with_changes

    pre = tiny("pre", steps=1, batch_size=16, tensorboard=False)
    train(pre, verbose=False)
    cfg = tiny("sweep", steps=2, batch_size=16, tensorboard=False, init=str(tmp_path / "pre"))
    first = run_sweep(cfg, grid=(0.01, 0.03), verbose=False)
    records = {p: p.read_bytes() for p in (tmp_path / "sweep").rglob("*.json")}
    changed = with_changes(cfg, {"optim.clip_norm": 0.5, "augment.label_smoothing": 0.1})
    with pytest.raises(ConfigError, match=r"^--resume: the runs in '.*sweep' were trained with other settings: "
                                          r"augment.label_smoothing=0.1 \(its runs: 0.0\), optim.clip_norm=0.5 "
                                          r"\(its runs: 1.0\); resume with the same ones, or train again with "
                                          r"--overwrite or into another --out$"):
        run_sweep(changed, grid=(0.01, 0.03), resume=True, verbose=False)
    assert {p: p.read_bytes() for p in (tmp_path / "sweep").rglob("*.json")} == records
    carried_out = with_changes(cfg, {"run.log_every": 1})
    again = run_sweep(carried_out, grid=(0.01, 0.03), resume=True, verbose=False)
    assert again["holdout_top1"] == first["holdout_top1"]
    train(pre, verbose=False, overwrite=True)  # the init's weights written again
    with pytest.raises(ConfigError, match=r"^--resume: the runs in .* other settings: model.init="):
        run_sweep(cfg, grid=(0.01, 0.03), resume=True, verbose=False)
    assert run_sweep(changed, grid=(0.01, 0.03), overwrite=True, verbose=False)["final"]["steps"] == 2


def test_of_rates_scoring_alike_the_lowest_is_chosen_whatever_the_grids_order(tiny, monkeypatch):
    """Ties went to the first rate in the grid's order: 0.03,0.01 and 0.01,0.03 chose differently on
    the same scores (a few hundred held-out examples tie often)."""
    from vitlab.train import sweep
    from vitlab.train.vtab import chosen_lrs

    assert sweep.best_lr((0.03, 0.01, 0.003), {"0.03": 0.5, "0.01": 0.5, "0.003": 0.4}) == 0.01
    assert sweep.best_lr((0.01, 0.03), {"0.03": 0.5, "0.01": None}) == 0.03  # a diverged rate loses all the same
    trained = []

    def fake_train(cfg, **_):
        trained.append(cfg.optim.lr)
        return {"val_top1": 0.5 if cfg.optim.lr in (0.03, 0.01) else 0.4, "weights": None}

    monkeypatch.setattr(sweep, "train", fake_train)
    for grid in ((0.03, 0.01, 0.003), (0.003, 0.01, 0.03)):
        assert sweep.run_sweep(tiny("sweep"), grid=grid, verbose=False)["best_lr"] == 0.01
        assert trained[-1] == 0.01  # the final run's
    val = {"a": {"0.03": 0.5, "0.01": 0.5}, "b": {"0.03": 0.25, "0.01": 0.5}, "c": {"0.03": 0.75, "0.01": 0.5}}
    for grid in ((0.03, 0.01), (0.01, 0.03)):
        assert chosen_lrs(grid, val, "per-task") == {"a": 0.01, "b": 0.01, "c": 0.03}
        assert chosen_lrs(grid, val, "shared") == {"a": 0.01, "b": 0.01, "c": 0.01}  # 1.5 each


def test_a_sweeps_time_limit_is_each_runs_budget_and_says_so(tiny, monkeypatch, capsys):
    """--time-limit 5 budgets every run of the sweep (the grid's and the final one), each from its own start,
    so the command takes about (rates + 1) x 5 minutes; neither the help nor the docs said so."""
    from vitlab.cli import main
    from vitlab.train import sweep

    budgets = []

    def fake_train(cfg, **kw):
        budgets.append((cfg.optim.lr, cfg.run.time_limit, kw.get("started_at")))
        return {"val_top1": cfg.optim.lr, "weights": None}

    monkeypatch.setattr(sweep, "train", fake_train)
    sweep.run_sweep(with_limit(tiny("sweep"), 5), grid=(0.01, 0.03), verbose=False)
    assert budgets == [(0.01, 5, None), (0.03, 5, None), (0.03, 5, None)]  # None: counted from the run's start
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--time-limit MINUTES fit each run's warm-up, decay and final evaluation into this wall-clock budget, " \
           "the final run's too: the sweep takes about (rates + 1) x MINUTES" in text
    assert "each run's own budget" in sweep.__doc__


def with_limit(cfg, minutes):
    from vitlab.train.overrides import with_changes

    return with_changes(cfg, {"run.time_limit": minutes})


def test_a_learning_rate_given_to_a_sweep_is_refused(capsys):
    """--lr 0.5 was accepted, shown by --show-config as the final run's rate, and never used: every run's
    rate is the grid's."""
    from vitlab.cli import main

    base = ["sweep", "--recipe", "demo", "--data", "digits", "--grid", "0.01,0.02", "--show-config"]
    for given, named in ((["--lr", "0.5"], "--lr 0.5"), (["--set", "optim.lr=0.5"], "--set optim.lr"),
                         (["--set", "lr=0.5"], "--set optim.lr")):
        assert main([*base, *given]) == 2
        assert capsys.readouterr().err.strip() == (f"vitlab sweep: error: {named}: a sweep trains every rate of its "
                                                   "grid and retrains at the best; give the rates with --grid")
    assert main(base) == 0 and json.loads(capsys.readouterr().out)["grid"] == [0.01, 0.02]


def test_an_evaluation_setting_of_a_recipe_that_holds_nothing_out_is_read_by_the_grids_runs(capsys):
    """The grid's runs score their hold-out (10%, or --holdout) with run.eval_flip: a sweep of a recipe with
    data.val_split=0 was refused it, as a run that holds nothing out to score is (which train still is)."""
    from vitlab.cli import main

    base = ["--recipe", "demo", "--data", "digits", "--set", "data.val_split=0", "--set", "run.eval_flip=true",
            "--show-config"]
    for holdout, given in ((0.1, []), (100, ["--holdout", "100"])):
        assert main(["sweep", "--grid", "0.01,0.02", *base, *given]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["holdout"] == holdout and plan["final"]["run"]["eval_flip"] is True
        assert plan["final"]["data"]["val_split"] == 0  # the final run holds none out, as before
    assert main(["train", *base]) == 2
    assert capsys.readouterr().err.startswith("vitlab train: error: run.eval_flip=True: read by the evaluations of "
                                              "the held-out images, and this run holds no images out to score")


def test_a_hold_out_beyond_the_data_is_refused_before_any_run(tiny, tmp_path, capsys):
    """--val-split 5000 on the 1,797 digits was found by the final run, once every rate of the grid had
    trained; --holdout's refusals named data.val_split, a field the command line had not given."""
    from vitlab.cli import main

    out = tmp_path / "cli"
    base = ["sweep", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--steps", "1", "--grid",
            "0.01,0.02", "--out", str(out), "--quiet", "--set", "model.img_size=8", "--set", "model.patch_size=4",
            "--set", "model.width=16", "--set", "model.depth=1", "--set", "model.num_heads=2",
            "--set", "model.mlp_dim=32", "--set", "run.threads=1", "--set", "run.tensorboard=false"]
    for given, line in ((["--val-split", "5000"], "--val-split 5000: takes 5000 of the 1797 examples; it must leave "
                                                  "some to train on (1 to 1796, or a fraction in (0, 1))"),
                        (["--holdout", "1797"], "--holdout 1797: takes 1797 of the 1797 examples; it must leave "
                                                "some to train on (1 to 1796, or a fraction in (0, 1))"),
                        (["--holdout", "-3"], "--holdout -3: give a count (500) or a fraction in (0, 1) (0.1)"),
                        (["--holdout", "1.5"], "--holdout 1.5: give a count (500) or a fraction in (0, 1) (0.1)")):
        assert main([*base, *given]) == 2
        assert capsys.readouterr().err.strip() == f"vitlab sweep: error: {line}", given
        assert not out.exists()
    # a pool of data.train_examples counts as the data
    with pytest.raises(ConfigError, match=r"^--val-split 1000: takes 1000 of the 1000 examples"):
        run_sweep(tiny("sweep", train_examples=1000), grid=(0.01,), final_val_split=1000)
    assert not (tmp_path / "sweep").exists()


def test_an_earlier_sweeps_runs_are_refused_before_any_run(tiny, tmp_path):
    """Another grid into the folder of an earlier sweep, without --resume or --overwrite: every new rate
    trained, and then the final run's folder (the earlier final run) was refused."""
    from vitlab.train.loop import held_by_earlier_run

    run_sweep(tiny("sweep", steps=1, batch_size=16), grid=(0.01,), verbose=False)
    with pytest.raises(ConfigError, match=r"^run.out='.*final' holds the checkpoints of an earlier run; continue it "
                                          r"with --resume, start afresh there with --overwrite, or choose another"):
        run_sweep(tiny("sweep", steps=1, batch_size=16), grid=(0.003, 0.03), verbose=False)
    assert held_by_earlier_run(tmp_path / "sweep" / "lr_0.003") is None
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["final", "lr_0.01", "settings.json",
                                                                       "sweep.json"]


def test_a_sweep_removes_the_temporaries_of_its_report_that_a_kill_left_and_no_other_file(tiny, tmp_path, caplog):
    """A sweep killed outright while it replaced sweep.json (``atomic_write``) leaves the write's hidden
    temporary file beside its runs' folders: a run's own records' were removed as it started, the
    sweep's stayed there for good."""
    import logging
    import os

    from vitlab.files import new_temporary

    cfg = tiny("sweep", steps=1, batch_size=16, val_split=360, tensorboard=False)
    folder = tmp_path / "sweep"
    folder.mkdir()
    left = []
    for name in ("sweep.json", "notes.txt"):  # the writer's own temporaries, of the report and of another file
        fd, tmp = new_temporary(folder / name)
        os.close(fd)
        left.append(os.path.basename(tmp))
    with caplog.at_level(logging.WARNING, logger="vitlab.train.sweep"):
        run_sweep(cfg, grid=[0.01], verbose=False)
    assert sorted(n for n in os.listdir(folder) if n.endswith(".tmp")) == [left[1]]
    assert str(folder / left[0]) in caplog.text


def test_a_sweep_on_a_multi_label_set_compares_its_rates_by_precision_at_1(tiny):
    # a multi-label set's runs report val_prec1, not val_top1 (which the sweep read: a KeyError after the first run)
    from helpers.multi_label import multi_label_shard

    shards = multi_label_shard(Path(tiny().run.out).parent / "jft", ["0,2", "1", "3,1,0", "2", "1,3", "0"] * 4,
                               per_shard=6)
    cfg = tiny("sweep", data=str(shards), val_split=6, steps=1, batch_size=6, loss="sigmoid_xent", tensorboard=False,
               **{"data.stream_workers": 1})
    lines = []
    report = run_sweep(cfg, grid=[0.01, 0.1], verbose=False, say=lines.append)
    assert set(report["holdout_prec1"]) == {"0.01", "0.1"} and "holdout_top1" not in report
    assert lines == [f"lr {lr}: held-out prec@1 {report['holdout_prec1'][lr]:.4f}" for lr in ("0.01", "0.1")]
