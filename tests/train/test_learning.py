"""Every way a run can be set up trains what its config says.

A short deterministic run on the digits (``tiny``: a ViT of ~5k parameters, a step in
milliseconds) learns as the fp32 eager run does, or computes the same numbers where the
arithmetic is the same (fast path on or off, compiled or eager, resumed or straight);
the parameters that should move do (a fine-tune's too, from its init and a new zero head)
and those a run does not read do not; the saved model is the one the config describes, and
an EMA is what is evaluated and saved.  A setting under which a run silently trains nothing (bf16's loss
stayed ln 10 for a day: torch kept its casts of the weights of step 0) fails here.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from vitlab.fast.kernels import PLAIN, RULES, why_unavailable
from vitlab.train import train
from vitlab.train.checkpoint import list_checkpoints, load_checkpoint
from vitlab.train.metrics import read_jsonl
from vitlab.train.overrides import with_changes
from vitlab.weights import load_model

STEPS = 30
# progressive resizing's phase: 4 px images are one 4x4 patch each, which the tiny model learns fast and
# whose model scores the 8 px images at chance (a patch of half the image against the whole image), so
# the phase is short: what is checked is that the steps at full size after it learn
PHASES = ((4, 0.1),)

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="inductor needs a C++ compiler on a CPU")


def losses(summary: dict) -> list[float]:
    return [r["loss"] for r in read_jsonl(Path(summary["weights"]).parent / "metrics.jsonl") if "loss" in r]


def raw_weights(summary: dict) -> dict:
    """The trained model's own weights (not an EMA's), from the run's last checkpoint."""
    return load_checkpoint(list_checkpoints(Path(summary["weights"]).parent / "checkpoints")[-1])["model"]


@pytest.fixture
def initial(monkeypatch) -> list[dict]:
    """The parameters each run built by ``train`` starts from, in the order the runs were built."""
    import vitlab.train.loop as loop

    states, build = [], loop.build

    def recording(*args, **kwargs):
        setup = build(*args, **kwargs)
        states.append({k: v.detach().clone() for k, v in setup.model.named_parameters()})
        return setup

    monkeypatch.setattr(loop, "build", recording)
    return states


def learned(summary: dict) -> bool:
    """Whether a run of ``STEPS`` steps learned as the fp32 run does (val top-1 0.43, its loss from ln 10 = 2.30
    to 2.06): its validation top-1 three times chance, its training loss down (a smoothed or mixed target's stays
    higher)."""
    curve = losses(summary)
    assert summary["val_top1"] > 0.3 and min(curve[-3:]) < curve[0] - 0.05, (summary["val_top1"], curve)
    return True


def trains_its_model_fields(summary: dict, changes: dict) -> bool:
    """Whether the saved model has the architecture and regularisation ``changes`` asked for (``model.<field>``)."""
    from vitlab.train.overrides import MODEL_FIELDS

    cfg = load_model(summary["weights"]).cfg
    asked = {k[len("model."):]: v for k, v in changes.items() if k.startswith("model.")}
    asked = {k: (v, v) if k == "patch_size" else v for k, v in asked.items() if k not in MODEL_FIELDS | {"resnet"}}
    assert {k: getattr(cfg, k) for k in asked} == asked
    return True


def unmoved(before: dict, after: dict) -> list[str]:
    return [k for k, v in before.items() if k in after and torch.equal(v, after[k])]


# changes of the reference run (fp32, eager, fast path on) that must learn as it does
SETTINGS = {
    "fp32": {},
    "fp32 plain": {"run.fast": False},
    "bf16": {"precision": "bf16"},
    "bf16 plain": {"precision": "bf16", "run.fast": False},
    "fp16": {"precision": "fp16"},
    "fp16 plain": {"precision": "fp16", "run.fast": False},
    "auto": {"precision": "auto"},
    "accumulated": {"accum_steps": 2},
    "bf16 accumulated": {"precision": "bf16", "accum_steps": 4},
    "ema": {"ema_decay": 0.9},
    "progressive": {"progressive_sizes": PHASES},
    "bf16 progressive": {"precision": "bf16", "progressive_sizes": PHASES},
    "mixup": {"mixup_alpha": 0.2},
    "cutmix": {"cutmix_alpha": 1.0},
    "label smoothing": {"label_smoothing": 0.1},
    "patch dropout": {"model.patch_dropout": 0.25},
    "bf16 patch dropout": {"precision": "bf16", "model.patch_dropout": 0.25},
    "dropout": {"model.dropout": 0.1, "model.drop_path": 0.1},
    "bf16 dropout": {"precision": "bf16", "model.dropout": 0.1, "model.drop_path": 0.1},
    "sgd": {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0},
    "bf16 sgd": {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0, "precision": "bf16"},
    "muon": {"optimizer": "muon"},
    "bf16 muon": {"optimizer": "muon", "precision": "bf16"},
    "fp16 muon": {"optimizer": "muon", "precision": "fp16"},
    "sigmoid": {"loss": "sigmoid_xent"},
    "bf16 sigmoid": {"loss": "sigmoid_xent", "precision": "bf16"},
    "pre-logits": {"pre_logits": True},
    "gap": {"model.classifier": "gap"},
    "relative": {"model.posemb": "relative"},
    "axial": {"model.axial": True, "model.classifier": "gap"},
    # the CIFAR recipe's plain ViT, small: a distance penalty without self-attention, offsets, GAP, whitened
    # patches, sin-cos positions, Muon, label smoothing, smaller images first
    "cifar vit": {"model.attn_bias": "distance_no_self", "model.attn_offsets": True, "model.classifier": "gap",
                  "model.patch_init": "whiten", "model.posemb_init": "sincos", "optimizer": "muon",
                  "label_smoothing": 0.1, "progressive_sizes": PHASES},
    # a hybrid: a ResNet root with BatchNorm (the CIFAR recipe's stem) read as 1x1 patches
    "hybrid": {"model.resnet": {"layers": (), "width_factor": 0.5, "img_size": 8, "norm": "batch",
                                "root_kernel": 3, "root_stride": 1}, "model.patch_size": 1},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_learns_as_the_fp32_run_does_and_moves_every_weight(tiny, initial, name):
    summary = train(tiny("run", steps=STEPS, **SETTINGS[name]), verbose=False)
    assert learned(summary) and trains_its_model_fields(summary, SETTINGS[name])
    assert unmoved(initial[0], raw_weights(summary)) == []


# the same arithmetic by another route: the fast path's blocks and layers against the plain ones (no dropout:
# the fused GELU -> dropout -> dense draws its mask otherwise), a resumed run against a straight one
SAME_ARITHMETIC = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "progressive": {"progressive_sizes": PHASES},
    "patch dropout": {"model.patch_dropout": 0.25},
    "muon": {"optimizer": "muon"},
}


@pytest.mark.parametrize("name", SAME_ARITHMETIC)
def test_the_fast_path_trains_as_the_plain_model(tiny, name):
    curves = {fast: losses(train(tiny(f"fast_{fast}", steps=STEPS, **SAME_ARITHMETIC[name], **{"run.fast": fast}),
                                 verbose=False)) for fast in (True, False)}
    assert curves[True] == pytest.approx(curves[False], abs=0.02)


def rule_name(cls: str, vendor: str, family: int | None) -> str:
    return " ".join(map(str, (cls, vendor or "any vendor", family or "any family")))


@pytest.mark.parametrize("rule", ["plain", *(rule_name(*key) for key in RULES)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_cpu_classs_kernels_train_as_the_plain_model(tiny, monkeypatch, rule, precision):
    """The fast path's kernels of every CPU class (a run takes its own CPU's), here where they can run."""
    import vitlab.fast as fast

    kernels = PLAIN.kernels if rule == "plain" else next(r.kernels for key, r in RULES.items() if rule_name(*key) == rule)
    if why_unavailable(kernels) is not None:
        pytest.skip(why_unavailable(kernels))
    plain = losses(train(tiny("plain", steps=STEPS, precision=precision, **{"run.fast": False}), verbose=False))
    monkeypatch.setattr(fast, "choose", lambda *args, **kwargs: kernels)
    summary = train(tiny("fast", steps=STEPS, precision=precision), verbose=False)
    assert summary["val_top1"] > 0.3 and losses(summary) == pytest.approx(plain, abs=0.02)


@pytest.mark.parametrize("name", [*SAME_ARITHMETIC, "ema", "sgd", "mixup", "dropout"])
def test_a_run_resumed_mid_way_ends_where_the_straight_run_ends(tiny, name):
    changes = {"ema": {"ema_decay": 0.9}, "sgd": {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0},
               "mixup": {"mixup_alpha": 0.2}, "dropout": {"model.dropout": 0.1, "model.drop_path": 0.1},
               **SAME_ARITHMETIC}[name]
    straight = train(tiny("straight", steps=12, **changes), verbose=False)
    cfg = tiny("resumed", steps=12, ckpt_every=5, keep_ckpts=5, **changes)
    train(cfg, verbose=False)
    run = Path(cfg.run.out)
    for later in list_checkpoints(run / "checkpoints")[1:]:  # back to step 5
        later.unlink()
    (run / "summary.json").unlink()
    resumed = train(cfg, resume=True, verbose=False)
    a, b = load_model(straight["weights"]).state_dict(), load_model(resumed["weights"]).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(straight) == losses(resumed)


def test_the_ema_is_what_a_run_evaluates_and_saves_and_is_not_the_trained_weights(tiny):
    from vitlab.train.build import build

    cfg = tiny("ema", steps=STEPS, ema_decay=0.9)
    summary = train(cfg, verbose=False)
    saved = load_model(summary["weights"])
    last = load_checkpoint(list_checkpoints(Path(cfg.run.out) / "checkpoints")[-1])
    assert all(torch.equal(v, last["ema"]["module"][k]) for k, v in saved.state_dict().items())
    assert [k for k, v in saved.state_dict().items() if torch.equal(v, last["model"][k])] == []
    setup = build(cfg)  # the run's validation split
    raw = load_model(summary["weights"])
    raw.load_state_dict(last["model"])
    assert setup.evaluator.run(saved)["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert setup.evaluator.run(raw)["loss"] != pytest.approx(summary["val_loss"], rel=1e-3)


@pytest.mark.parametrize("changes", [{}, {"precision": "bf16"}, {"model.patch_dropout": 0.25},
                                     {"progressive_sizes": PHASES}, {"model.dropout": 0.1}])
def test_a_fine_tune_trains_every_weight_of_its_init_and_a_new_head(tiny, initial, changes):
    pre = train(tiny("pre", steps=STEPS), verbose=False)
    run = {k: v for k, v in changes.items() if not k.startswith("model.")}
    cfg = with_changes(tiny("fine", steps=STEPS, class_subset=("0", "1", "2", "3", "4"), **run),
                       {"model.init": pre["weights"], "model.overrides": {}} | changes)
    summary = train(cfg, verbose=False)
    start, init = initial[1], load_model(pre["weights"]).state_dict()
    assert start["head.weight"].shape == (5, 16) and not start["head.weight"].any() and not start["head.bias"].any()
    assert all(torch.equal(v, init[k]) for k, v in start.items() if not k.startswith("head."))
    assert unmoved(start, raw_weights(summary)) == []
    assert learned(summary) and trains_its_model_fields(summary, changes)


def test_masked_patch_prediction_trains_its_vit_but_the_head_it_does_not_read(tiny, initial):
    cfg = with_changes(tiny("mpp", steps=STEPS), {"model.mpp": "color4x4"})
    summary = train(cfg, verbose=False)
    curve = losses(summary)
    assert curve[-1] < curve[0] - 0.2, curve
    trained = raw_weights(summary)
    assert sorted(unmoved(initial[0], trained)) == ["vit.head.bias", "vit.head.weight"]
    saved = load_model(summary["weights"]).state_dict()
    assert all(torch.equal(v, trained[f"vit.{k}"]) for k, v in saved.items())


@pytest.mark.parametrize("target", ["pixels", "color"])
def test_masked_patch_prediction_logs_a_training_accuracy_of_colour_classes_only(tiny, target):
    # a regression of the pixels has no right or wrong prediction: its steps counted none right, and the run
    # logged (and drew) a training top-1 of 0.0; the colour targets log the share of corrupted patches right
    summary = train(with_changes(tiny("mpp", steps=2, log_every=1), {"model.mpp": target}), verbose=False)
    records = read_jsonl(Path(summary["weights"]).parent / "metrics.jsonl")
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)
    tops = [r["train_top1"] for r in records]
    assert tops == [None, None] if target == "pixels" else all(0 <= t <= 1 for t in tops), tops


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow  # compiles
@needs_compiler
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_compiled_run_trains_as_the_eager_run(tiny, fresh_dynamo, precision):
    curves = {on: losses(train(tiny(f"compile_{on}", steps=STEPS, precision=precision, compile=on), verbose=False))
              for on in (False, True)}
    assert curves[True][-1] < curves[True][0] - 0.2
    assert curves[True] == pytest.approx(curves[False], abs=0.02)


def multi_label_shards(out: Path, samples: int = 256) -> tuple[Path, float]:
    """A JFT-style shard set of 8x8 images of four classes, each sample of one and maybe more, which every patch
    shows (classes a, b and c light the red, green and blue channels, class d every other column); and the
    sigmoid loss of the labels' frequencies alone, what a run that reads no image comes down to."""
    import io
    import tarfile

    from PIL import Image

    out.mkdir()
    (out / "classes.txt").write_text("a\nb\nc\nd\n")
    g = torch.Generator().manual_seed(0)
    hot = torch.zeros(samples, 4)
    with tarfile.open(out / "0000.tar", "w") as tar:
        for i in range(samples):
            labels = [k for k in range(4) if k == i % 4 or torch.rand((), generator=g) < 0.2]
            hot[i, labels] = 1
            pixels = torch.zeros(8, 8, 3, dtype=torch.uint8)
            for k in labels:
                if k < 3:
                    pixels[..., k] += 200
                else:
                    pixels[:, ::2] += 55
            buf = io.BytesIO()
            Image.fromarray(pixels.numpy()).save(buf, format="PNG")
            for name, data in ((f"{i:04d}.png", buf.getvalue()), (f"{i:04d}.cls", ",".join(map(str, labels)).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    p = hot.mean(0)
    return out, float(-(p * p.log() + (1 - p) * (1 - p).log()).sum())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_multi_label_stream_trains_every_label(tiny, tmp_path, initial, precision):
    shards, frequencies_loss = multi_label_shards(tmp_path / "jft")
    cfg = tiny("multi", steps=2 * STEPS, data=str(shards), val_split=0, loss="sigmoid_xent", precision=precision,
               **{"data.stream": "stream", "data.stream_workers": 0})
    summary = train(cfg, verbose=False)
    curve = losses(summary)
    assert min(curve[-3:]) < frequencies_loss - 0.6, (frequencies_loss, curve)  # the images are read
    assert unmoved(initial[0], raw_weights(summary)) == []


def test_a_time_limited_run_learns_on_its_fitted_schedule(tiny, run_clock):
    run_clock(2 ** -6, 2 ** -4)  # 0.1 minutes hold 53 steps of 1/64 s (test_loop.fitted_total)
    summary = train(tiny("timed", steps=1000, time_limit=0.1, time_measure_steps=3), verbose=False)
    assert summary["steps"] == 53
    assert learned(summary)
