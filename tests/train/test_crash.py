"""Crashes: a damaged checkpoint is passed over for the one before it, a full disk keeps the
last good checkpoint and stops with one line, SIGKILL at random moments (inside checkpoint
writes too) and a killed torchrun worker both end bit-equal to an uninterrupted run."""
import errno
import importlib.util
import logging
import os
import shutil
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import kill_resume
from vitlab.cli import main
from vitlab.train import checkpoint as ckpt
from vitlab.train import train
from vitlab.weights import load_model


def weights(path) -> dict:
    return load_model(path).state_dict()


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_weight_bit(path: Path) -> None:
    """Flip one bit in the middle of the largest tensor's bytes (not in zip padding)."""
    with zipfile.ZipFile(path) as z:
        entry = max(z.infolist(), key=lambda info: info.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26: entry.header_offset + 30])
    raw[entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [truncate, flip_a_weight_bit], ids=["truncated", "bit-flip"])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_previous_one(tiny, damage, caplog):
    cfg = tiny("run", steps=8, ckpt_every=2, keep_ckpts=2)
    full = weights(train(cfg, verbose=False)["weights"])
    folder = Path(cfg.run.out) / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(folder)] == ["ckpt-00000006.pt", "ckpt-00000008.pt"]
    newest = folder / "ckpt-00000008.pt"
    damage(newest)
    assert ckpt.damage(newest) is not None
    with pytest.raises(ckpt.CheckpointError, match="ckpt-00000008.pt is damaged"):
        ckpt.load_checkpoint(newest)

    with caplog.at_level(logging.WARNING, logger="vitlab.train.loop"):
        resumed = train(cfg, resume=True, verbose=False)
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert str(newest) in warnings[0] and str(folder / "ckpt-00000006.pt") in warnings[0]
    assert (folder / "ckpt-00000008.pt.damaged").is_file()  # kept for inspection, out of the rotation
    again = weights(resumed["weights"])
    assert resumed["steps"] == 8 and all(torch.equal(full[k], again[k]) for k in full)
    assert ckpt.damage(folder / "ckpt-00000008.pt") is None  # written again


def test_resume_refuses_when_no_checkpoint_is_intact(tiny):
    cfg = tiny("run", steps=4, ckpt_every=2, keep_ckpts=2)
    train(cfg, verbose=False)
    for path in ckpt.list_checkpoints(Path(cfg.run.out) / "checkpoints"):
        truncate(path)
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint.*ckpt-00000004.pt.*--overwrite"):
        train(cfg, resume=True, verbose=False)


TINY_CLI = ["--recipe", "demo", "--data", "digits", "--val-split", "0", "--steps", "6", "--batch-size", "32",
            "--quiet", "--set", "model.img_size=16", "--set", "model.patch_size=8", "--set", "model.width=16",
            "--set", "model.depth=1", "--set", "model.num_heads=2", "--set", "model.mlp_dim=32",
            "--set", "run.threads=1", "--set", "run.tensorboard=false", "--set", "run.ckpt_every=2"]


def test_a_full_disk_keeps_the_last_good_checkpoint_and_stops_with_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    real_save, calls = torch.save, []

    def disk_fills_up(obj, f):
        calls.append(1)
        if len(calls) == 2:  # the checkpoint of step 4, half written
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(ckpt.torch, "save", disk_fills_up)
    assert main(["train", *TINY_CLI, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    folder = out / "checkpoints"
    assert lines[0] == (f"vitlab train: error: could not write the checkpoint of step 4 to {folder / 'ckpt-00000004.pt'}:"
                        f" no space left on the device; the last good checkpoint, {folder / 'ckpt-00000002.pt'}, "
                        "is intact; free space and continue with --resume")
    assert os.listdir(folder) == ["ckpt-00000002.pt"]  # no temp file left, nothing else touched
    assert ckpt.load_checkpoint(folder / "ckpt-00000002.pt")["step"] == 2

    monkeypatch.setattr(ckpt.torch, "save", real_save)  # space freed: the run continues and ends as if never stopped
    assert main(["train", *TINY_CLI, "--out", str(out), "--resume"]) == 0
    assert main(["train", *TINY_CLI, "--out", str(tmp_path / "uninterrupted")]) == 0
    a, b = weights(out / "model.safetensors"), weights(tmp_path / "uninterrupted" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_partial_writes_are_removed_and_only_theirs(tmp_path):
    ckpt.save_checkpoint({"step": 1}, tmp_path, 1, keep=2)
    left = [tmp_path / ".ckpt-00000002.pt.x1y2.tmp", tmp_path / ".ckpt-00000003.pt.abc.tmp"]
    for path in left:
        path.write_bytes(b"half")
    (tmp_path / "notes.tmp").write_text("not ours")
    assert ckpt.remove_partial_writes(tmp_path) == sorted(left)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.pt", "notes.tmp"]


@pytest.mark.slow
def test_sigkill_at_random_moments_and_inside_a_write_resumes_bit_equal(tmp_path):
    # 3 kills of `python -m vitlab train` (one aimed inside a checkpoint write), a --resume
    # after each, against an uninterrupted run: every final tensor bit-equal
    report = kill_resume.kill_and_resume(tmp_path, kills=3, write_kills=1, seed=0, steps=30)
    assert report["aimed_at_writes"] == 1 and report["landed_in_writes"] >= 1
    assert report["kills"] >= 2  # a random kill may come after its launch has already finished
    assert report["bit_equal"] and report["tensors"] > 0 and report["final_steps"] == 30
    assert report["partial_files_left"] == []


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers through /proc (Linux)")
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_torchrun_restarts_a_killed_worker_and_the_group_resumes_bit_equal(tmp_path, fsdp):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if shutil.which("torchrun") is None and importlib.util.find_spec("torch.distributed.run") is None:
        pytest.skip("torchrun is not available")
    report = kill_resume.torchrun_worker_kill(tmp_path, steps=20, fsdp=fsdp)  # FSDP: its checkpoints gathered
    assert report["world_size"] == 2 and report["final_steps"] == 20
    assert report["checkpoints_at_kill"] == ["ckpt-00000005.pt"]  # killed while the second one was written
    # the restarted group resumed from the last complete checkpoint: step 5's, or step 10's if
    # rank 0 finished that write before torchrun stopped it
    assert len(report["restart_lines"]) == 1
    assert any(f"ckpt-{step:08d}.pt" in report["restart_lines"][0] for step in (5, 10))
    assert report["bit_equal"] and report["tensors"] > 0


def test_a_run_removes_the_temporaries_of_its_records_that_a_kill_left_and_no_other_file(tiny, caplog):
    """A run killed outright while it replaced its config, metrics, summary or weights (``atomic_write``)
    leaves the write's hidden temporary file in its folder: only the checkpoints' were removed as a run
    started, and these stayed beside the run's files for good (the weights' as large as the weights)."""
    from vitlab.files import new_temporary
    from vitlab.train.loop import RUN_RECORDS

    cfg = tiny("run", steps=4, ckpt_every=2)
    out = Path(cfg.run.out)
    out.mkdir()
    theirs = ["notes.tmp", ".summary.json.tmp", "summary.json.0123456789ab.tmp"]
    for name in theirs:
        (out / name).write_text("the user's")

    def killed_writes() -> list[str]:
        left = []
        for name in (*RUN_RECORDS, "notes.txt"):  # the writer's own temporaries, of the run's files and of another
            fd, tmp = new_temporary(out / name)
            os.write(fd, b"half")
            os.close(fd)
            left.append(os.path.basename(tmp))
        return left

    for run in (lambda: train(cfg, verbose=False), lambda: train(cfg, resume=True, verbose=False),
                lambda: train(cfg, overwrite=True, verbose=False)):
        left = killed_writes()
        theirs.append(left[-1])  # notes.txt is no file of the run's
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitlab.train.loop"):
            run()
        assert sorted(n for n in os.listdir(out) if n.endswith(".tmp")) == sorted(theirs)
        assert all(str(out / name) in caplog.text for name in left[:-1])
