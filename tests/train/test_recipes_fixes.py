"""Section 3 of the scale issue: sweep's final retrain, vtab1k's grid, EMA, sigmoid cross-entropy."""
import json
import math

import pytest
import torch
from torch import nn

from vitlab.cli import main
from vitlab.train.ema import EMA
from vitlab.train.step import loss_fn

TINY = ["--set", "model.img_size=8", "--set", "model.patch_size=4", "--set", "model.width=16",
        "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32", "--set", "run.threads=1",
        "--set", "run.eval_every=0", "--set", "run.tensorboard=false", "--set", "run.precision=fp32", "--quiet"]


def last_json_line(text):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def test_sigmoid_xent_against_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.0], [0.5, 3.0, -2.0]])
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])  # multi-label: two positives in the first row

    def bce(z, t):
        p = 1 / (1 + math.exp(-z))
        return -(t * math.log(p) + (1 - t) * math.log(1 - p))

    rows = [sum(bce(z, t) for z, t in zip(zr, tr)) for zr, tr in zip(logits.tolist(), targets.tolist())]
    assert loss_fn(logits, targets, "sigmoid_xent").item() == pytest.approx(sum(rows) / 2, rel=1e-6)
    # and softmax_xent: -sum t log softmax
    soft = [-sum(t * (z - math.log(sum(math.exp(v) for v in zr))) for z, t in zip(zr, tr))
            for zr, tr in zip(logits.tolist(), targets.tolist())]
    assert loss_fn(logits, targets, "softmax_xent").item() == pytest.approx(sum(soft) / 2, rel=1e-6)



@pytest.mark.parametrize("loss", ["sigmoid_xent", "softmax_xent"])
def test_train_top1_counts_a_top_prediction_among_a_multi_label_images_labels(tiny, loss):
    # JFT-style multi-hot targets: the top-1 prediction is right where it is any of the image's labels
    # (big_vision's prec@1); it was compared with the first label only (the targets' argmax)
    from vitlab.train.build import build
    from vitlab.train.step import train_step

    setup = build(tiny(loss=loss, batch_size=8, accum_steps=1))
    with torch.no_grad():  # every image's top prediction: class 3
        setup.model.head.weight.zero_()
        setup.model.head.bias.copy_(torch.arange(10.0) == 3)
    targets = torch.zeros(8, 10)
    for row, labels in enumerate([(1, 3), (3,), (0, 5), (3, 7, 9), (2,), (0, 1, 2), (3, 4), (8,)]):
        targets[row, list(labels)] = 1.0
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    result = train_step(setup, iter([(x, targets)]), 1e-3, tuple(setup.img_size))
    assert int(result.correct) == 4  # the rows holding class 3


def test_train_top1_of_soft_single_label_targets_is_their_largest_class(tiny):
    from vitlab.train.build import build
    from vitlab.train.step import train_step

    setup = build(tiny(batch_size=4, accum_steps=1))
    with torch.no_grad():
        setup.model.head.weight.zero_()
        setup.model.head.bias.copy_(torch.arange(10.0) == 3)
    smoothed = torch.full((4, 10), 0.01)  # label smoothing: every class above 0, the label highest
    smoothed[torch.arange(4), torch.tensor([3, 1, 3, 0])] = 0.91
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    result = train_step(setup, iter([(x, smoothed)]), 1e-3, tuple(setup.img_size))
    assert int(result.correct) == 2

def test_ema_matches_closed_form():
    d = 0.8
    model = nn.Linear(1, 1, bias=False)
    values = [1.0, 3.0, -2.0, 5.0, 0.5]
    with torch.no_grad():
        model.weight.fill_(values[0])
    ema = EMA(model, d)
    for v in values[1:]:
        with torch.no_grad():
            model.weight.fill_(v)
        ema.update(model)
    t = len(values) - 1
    closed = d ** t * values[0] + (1 - d) * sum(d ** (t - k) * values[k] for k in range(1, t + 1))
    assert ema.module.weight.item() == pytest.approx(closed, rel=1e-6)


def test_an_ema_update_weighted_on_the_device_reads_nothing_back_to_the_host():
    # the trainer weights a step's update by a device flag (0: the step was left out); reading it back
    # made a GPU run wait for the device at every step ("meta" tensors have no values to read)
    model = nn.Linear(4, 2, device="meta")
    ema = EMA(model, 0.9)
    ema.update(model, weight=1.0 - torch.zeros((), device="meta"))
    # and on values: weighted 1 the closed form, weighted 0 nothing moves
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, 0.75)
    with torch.no_grad():
        model.weight.fill_(5.0)
    ema.update(model, weight=torch.tensor(0.0))
    assert ema.module.weight.item() == 1.0
    ema.update(model, weight=torch.tensor(1.0))
    assert ema.module.weight.item() == 2.0


def test_ema_is_what_is_evaluated_and_saved(tiny):
    from vitlab.train import train
    from vitlab.train.build import build
    from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
    from vitlab.weights import load_model

    cfg = tiny("ema", ema_decay=0.9, steps=4)
    s = build(cfg)
    assert s.evaluated is s.ema.module
    summary = train(cfg, verbose=False)
    state = load_checkpoint(list_checkpoints(f"{cfg.run.out}/checkpoints")[-1])
    saved = load_model(summary["weights"]).state_dict()
    key = next(k for k in state["model"] if k.endswith("weight") and state["model"][k].ndim == 2)
    assert torch.equal(saved[key], state["ema"]["module"][key])
    assert not torch.equal(saved[key], state["model"][key])


def test_sweep_final_retrain_uses_the_full_training_set(tmp_path, capsys):
    # demo's recipe holds out 360 of the 1797 digits; the final retrain must not
    args = ["sweep", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--steps", "1", "--grid",
            "0.01,0.1", "--out", str(tmp_path / "sweep"), *TINY]
    assert main(args) == 0
    report = last_json_line(capsys.readouterr().out)
    assert report["final"]["train_examples"] == 1797 and report["final"]["val_examples"] == 0
    assert main(args[:-len(TINY)] + ["--val-split", "100", "--out", str(tmp_path / "s2"), "--overwrite", *TINY]) == 0
    report = last_json_line(capsys.readouterr().out)
    assert report["final"]["train_examples"] == 1697 and report["final"]["val_examples"] == 100


def test_sweep_resume_refuses_a_final_run_made_at_another_rate_than_the_best(tmp_path, capsys):
    """A grid changed on --resume moves the best rate; the final run of the earlier one, finished at
    its own rate (the rate may change on resume), was read back and reported as the new best's."""
    out = tmp_path / "sweep"
    args = ["sweep", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--steps", "1", "--out", str(out),
            *TINY]
    assert main([*args, "--grid", "0.01"]) == 0
    capsys.readouterr()
    assert main([*args, "--grid", "0.01", "--resume"]) == 0  # the same best: the finished run kept
    assert last_json_line(capsys.readouterr().out)["best_lr"] == 0.01
    weights = out / "final" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert main([*args, "--grid", "0.5", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"vitlab sweep: error: --resume: {str(out / 'final')!r} holds the final run at lr 0.01, but the grid's best "
        "is now 0.5; move that folder away to retrain it, or choose another --out")
    assert weights.stat().st_mtime_ns == stamp


def test_sweep_json_is_the_old_or_the_new_report_when_the_disk_fills_up(tmp_path, capsys, monkeypatch):
    # written in place, a full disk at sweep.json left it truncated: the finished sweep's report was lost
    from helpers.full_disk import fill_disk_at

    out = tmp_path / "sweep"
    args = ["sweep", "--recipe", "demo", "--data", "digits", "--batch-size", "16", "--steps", "1", "--grid", "0.01",
            "--out", str(out), *TINY]
    assert main(args) == 0
    report = (out / "sweep.json").read_text()
    fill_disk_at(monkeypatch, "sweep.json")
    assert main([*args, "--resume"]) != 0
    monkeypatch.undo()
    capsys.readouterr()
    assert (out / "sweep.json").read_text() == report
    # no temporary file left
    assert sorted(p.name for p in out.iterdir()) == ["final", "lr_0.01", "settings.json", "sweep.json"]


def test_sweep_compares_on_its_hold_out_and_scores_the_final_run_on_val_data(tmp_path, capsys):
    args = ["sweep", "--recipe", "demo", "--data", "digits", "--val-data", "digits", "--batch-size", "16", "--steps",
            "1", "--grid", "0.01,0.1", "--out", str(tmp_path / "sweep"), *TINY]
    assert main(args) == 0
    report = last_json_line(capsys.readouterr().out)
    assert set(report["holdout_top1"]) == {"0.01", "0.1"}  # each grid run scored on the 360 it held out
    assert report["final"]["train_examples"] == 1797 and report["final"]["val_examples"] == 1797


def test_a_sweep_of_masked_patch_prediction_is_refused_before_any_run(tmp_path, capsys):
    # MPP trains no classifier: the first rate's run trained, then the sweep ended in a TypeError traceback
    out = tmp_path / "sweep"
    args = ["sweep", "--recipe", "mpp", "--data", "digits", "--batch-size", "16", "--steps", "1", "--grid",
            "0.001,0.01", "--out", str(out), *TINY]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "vitlab sweep: error: model.mpp='color': a sweep compares its rates by their held-out top-1, and masked patch "
        "prediction trains no classifier to score; sweep the fine-tune of its weights (--init) instead")
    assert not out.exists()


def test_vtab1k_documented_sweep_runs(tmp_path, capsys):
    # the command of vitlab/configs/vtab1k.py's docstring, on digits with a tiny model
    args = ["sweep", "--recipe", "vtab1k:final=true", "--holdout", "200", "--data", "digits", "--model", "ViT-Ti/16",
            "--batch-size", "16", "--steps", "1", "--out", str(tmp_path / "vtab"),
            "--set", "optim.warmup=0", "--set", "run.ckpt_every=0", *TINY]
    assert main(args) == 0
    report = last_json_line(capsys.readouterr().out)
    assert set(report["holdout_top1"]) == {"0.001", "0.003", "0.01", "0.03"}
    assert report["final"]["train_examples"] == 1000 and report["final"]["val_examples"] == 0
