"""What the run does about a step whose loss or gradients are not finite numbers.

``step.train_step`` never applies such a step: it tells the optimiser on the device, and
its result carries the flags, also on the device.  The loop hands ``NonFinite.check`` the
steps since its last log step; one read brings their flags back, and for each bad step,
per ``run.on_nonfinite``, it either stops the run with one line naming the step, the
examples of its batch (their indices in the decoded data set) and the last good
checkpoint, or counts the step as skipped and goes on, up to ``run.max_skipped_steps``.
Steps taken after a bad one and before the check were applied as usual: the bad update
never was, so the weights they started from are the good ones.  Under fp16 the gradient scaler's overflows (a step left out,
the loss scale halved) are its normal working: they are counted apart, as
``overflow_steps``, and never stop the run.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from .distributed import all_gather_objects
from .step import CheckedStep, StepResult

log = logging.getLogger(__name__)

LISTED = 64  # examples an error lists at most (a batch may hold thousands)


class NonFiniteError(FloatingPointError):
    """A training step's loss or gradients were NaN or infinite, and the run stopped."""


def make_scaler(precision: str, device: torch.device, loss_scale: float) -> torch.amp.GradScaler | None:
    """fp16's gradient scaler (None for other precisions: bf16 has fp32's exponent range)."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=loss_scale)


class NonFinite:
    """The policy of ``run.on_nonfinite`` and the run's counts (saved in checkpoints)."""

    def __init__(self, on_nonfinite: str, max_skipped: int) -> None:
        self.on_nonfinite, self.max_skipped = on_nonfinite, max_skipped
        self.skipped_steps = 0   # steps left out for a non-finite loss or gradients
        self.overflow_steps = 0  # fp16 steps the gradient scaler left out

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.overflow_steps = int(state.get("overflow_steps", 0))

    def record(self, scaler: torch.amp.GradScaler | None) -> dict:
        """The counts for a metrics record (and the loss scale under fp16)."""
        counts = {"skipped_steps": self.skipped_steps}
        if scaler is not None:
            counts |= {"overflow_steps": self.overflow_steps, "loss_scale": float(scaler.get_scale())}
        return counts

    def check(self, setup, pending: list[tuple[int, StepResult]], last_checkpoint: Path | None) -> None:
        """Read the flags of the ``(step, result)`` pairs since the last check (one read) and
        apply the policy to each step that was left out; empties ``pending``.  Raises
        ``NonFiniteError`` if the run must stop; a collective call when a step was bad
        (every process reads the same flags and takes the same branch)."""
        if not pending:
            return
        flags = torch.stack([result.flags() for _, result in pending]).tolist()
        bad = [(step, result) for (step, result), (skipped, _) in zip(pending, flags) if skipped]
        self.overflow_steps += sum(1 for _, overflow in flags if overflow)
        pending.clear()
        for step, result in bad:
            self.check_step(setup, result.read(), step, last_checkpoint)

    def check_step(self, setup, result: CheckedStep, step: int, last_checkpoint: Path | None) -> None:
        """Count one step that was not applied; raise ``NonFiniteError`` if the run must stop."""
        if result.overflow or result.nonfinite is None:
            return
        what = (f"the training loss is not finite ({result.loss})" if result.nonfinite == "loss"
                else f"the gradients are not finite (norm {result.grad_norm})")
        where = f"step {step}: {what} on {describe_examples(setup, result)}"
        saved = (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint is not None
                 else "no checkpoint was written before it (run.ckpt_every)")
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{where}; the step was not applied; {saved}. Check those images, or continue "
                                 "with --resume and a lower optim.lr, or --set run.on_nonfinite=skip to leave such "
                                 "steps out")
        self.skipped_steps += 1
        if self.skipped_steps > self.max_skipped:
            raise NonFiniteError(f"{where}; {self.skipped_steps} steps skipped, more than "
                                 f"run.max_skipped_steps={self.max_skipped}: the run has diverged; {saved}")
        if setup.world.is_main:
            log.warning("%s; step skipped (%d so far, at most run.max_skipped_steps=%d)", where, self.skipped_steps,
                        self.max_skipped)


def describe_examples(setup, result: CheckedStep) -> str:
    """The examples of a bad step: those whose own loss is not finite when the loss is, or
    else the whole batch; in-memory data by their indices in the decoded data set,
    streamed data by the readers' positions.  A collective call (every process's share)."""
    mine = _examples(setup, result)
    if setup.world.size > 1:
        shares = all_gather_objects(mine, setup.world)
        bad = set(result.bad_ranks) if result.nonfinite == "loss" else set(range(setup.world.size))
        mine = [item for rank, share in enumerate(shares) if rank in bad for item in share]
    kind, values = _merge(mine)
    if kind == "stream":
        return f"a streamed batch (readers at (epoch, samples read) {values})"
    shown = ", ".join(map(str, values[:LISTED])) + (f", ... ({len(values)} in all)" if len(values) > LISTED else "")
    every = f"all {len(values)} " if len(values) == setup.cfg.optim.batch_size and len(values) > 1 else ""
    return (f"{every}examples [{shown}] of data.source={setup.cfg.data.source!r} (indices in the data set as loaded: "
            "classes, then files, sorted)")


def _examples(setup, result: CheckedStep) -> list:
    """This process's bad examples: [("memory", index), ...] or [("stream", positions)]."""
    if result.nonfinite == "loss" and setup.world.rank not in result.bad_ranks:
        return []
    rows_known = result.nonfinite == "loss" and any(rows for _, rows in result.origins)
    found = []
    for position, rows in result.origins:
        if position[0] != "memory":
            found.append(("stream", position[1]))
            continue
        _, epoch, batch = position
        indices = setup.stream.batch_indices(epoch, batch)
        if setup.splits.train_ids is not None:
            indices = setup.splits.train_ids[indices]
        if rows_known:
            indices = indices[rows or []]
        found += [("memory", int(i)) for i in indices.tolist()]
    return found


def _merge(items: list) -> tuple[str, list]:
    if any(kind == "stream" for kind, _ in items):
        return "stream", [value for kind, value in items if kind == "stream"]
    return "memory", sorted({value for _, value in items})
