"""An evaluator: a labelled set and a protocol, ``run(model) -> dict``.

The one interface of every classification evaluation (big_vision's evaluators share one
small interface too): the trainer's periodic and final evaluations and `vitlab eval` build
an ``Evaluator`` and call ``run``.

    result = Evaluator(images, labels, batch_size=256, flip=True).run(model)
    result["top1"], result["top5"], result["loss"], result["n"]

A multi-label set (JFT-style: several labels per image) is scored as big_vision's
classification evaluator scores it, by precision@1, ``result["prec1"]``: the share of images
whose top-1 class is one of their labels (named so, not top-1: no image has one label to match).

Images are uint8 (N, 3, H, W); each batch is resized to the model's input size and
scaled to [-1, 1] (``vitlab.data.transforms``), as training and ``predict_logits`` do.
"""
from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitlab.config import PRECISIONS
from vitlab.data.transforms import resize, to_float
from vitlab.fast.kernels import autocast
from vitlab.modes import evaluating

from .features import Shift, check_loss, check_tta_shift, mean_probability, mean_sigmoid, tta_view_prefixes, tta_views
from .metrics import check_num_bins, classification_report, label_rank


class Evaluator:
    """Loss, top-1 and top-5 of a model on one labelled set (equal scores go to the lower class index).

    labels: (N,) each image's class index; or (N, L) each image's labels of a multi-label set,
        -1 filling a row of fewer than L: scored by precision@1, ``prec1`` (the top-1 class is
        one of the image's labels; with views ``prec1_single``, ``prec1_flip``, ``prec1_views``)
        in place of top-1 and top-5, and the loss against every label (multi-hot targets, as
        such a set trains), not against its first label alone.
    flip, shift, diagonal: score the mean of the predicted probabilities of each image's
        test-time views (``vitlab.eval.features.tta_views``: its mirror image; its
        translations by ``shift`` pixels, one size or several, along the axes and with
        ``diagonal`` along both at once), the probabilities ``loss`` trained (``mean_probability``:
        the softmax, or under sigmoid_xent each class's own sigmoid).  With more than one view ``top1_single`` keeps the
        top-1 of the image alone, with both ``top1_flip`` that of image + mirror, and
        ``top1_views`` the top-1 of every smaller set the views nest
        (``tta_view_prefixes``: {1: ..., 2: ..., 10: ..., 18: ...}), scored in the same pass.
    report_bins: also the full ``classification_report`` (per-class accuracy, confusion
        matrix, ECE with this many bins, of the probabilities ``loss`` gives), as `vitlab eval`
        prints it; one process only.
    precision: "fp32", "bf16" or "fp16" (autocast), as the caller resolved it.
    loss: the ``loss`` reported: "softmax_xent", or "sigmoid_xent" (per-class binary
        cross-entropy summed over classes, ``sigmoid_losses``), a run's ``optim.loss``; it
        also says what the model's probabilities are, which views average and ECE bins.
    world: the processes sharing the evaluation (rank, size, and ``all_reduce_sum(values)``,
        as ``vitlab.train.distributed.World`` has them); rank r takes examples r, r + W, ...;
        all ranks run the same number of batches (the short ones padded and masked), so a
        sharded (FSDP) model works too, and the sums are all-reduced.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int = 128,
                 device: str | torch.device = "cpu", precision: str = "fp32", flip: bool = False, shift: Shift = 0,
                 diagonal: bool = False, loss: str = "softmax_xent",
                 image_size: tuple[int, int] | None = None, report_bins: int | None = None, world=None) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        # refused here, by name: cross-entropy's IndexError or a division by a count of 0 came from the scoring
        if (not isinstance(labels, torch.Tensor) or labels.ndim not in (1, 2) or labels.is_floating_point()
                or labels.is_complex() or labels.dtype == torch.bool or len(labels) != len(images)
                or 0 in labels.shape[1:]):
            got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(f"labels: expected an integer tensor (N,), one class index per image of the "
                             f"{len(images)}, or (N, L), each image's labels of a multi-label set, got {got}")
        if len(labels) == 0:
            raise ValueError("images: no images to evaluate")
        self.multi_label = labels.ndim == 2
        low, high = (int(v) for v in torch.aminmax(labels))  # read once: the scoring checks the top against the head
        if low < (-1 if self.multi_label else 0):
            fill = " (-1 fills a multi-label row)" if self.multi_label else ""
            raise ValueError(f"labels: class indices must be >= 0{fill}, got {low}")
        if self.multi_label and not bool((labels >= 0).any(1).all()):
            row = int((labels < 0).all(1).nonzero()[0])
            raise ValueError(f"labels: image {row} has no label (-1 only fills a row of fewer labels)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
        check_loss(loss)
        if report_bins is not None:
            check_num_bins(report_bins, "report_bins")  # before the model is scored, not after
        if report_bins is not None and world is not None and world.size > 1:
            raise ValueError("report_bins: the full report is computed in one process only")
        if report_bins is not None and self.multi_label:
            raise ValueError("report_bins: the full report's per-class accuracy, confusion matrix and calibration "
                             "score one label per image, and these labels (N, L) are a multi-label set's")
        self.images, self.labels, self.top_label = images, labels, high
        self.batch_size, self.device, self.precision = batch_size, torch.device(device), precision
        self.flip, self.shift, self.diagonal, self.loss = flip, shift, diagonal, loss
        self.view_sets = tta_view_prefixes(flip, shift, diagonal)
        self.image_size, self.report_bins, self.world = image_size, report_bins, world
        if shift:
            check_tta_shift(shift, image_size or tuple(images.shape[-2:]), "shift")

    def _my_examples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, valid): this rank's share, padded with example 0 to the longest share."""
        rank, size = (self.world.rank, self.world.size) if self.world is not None else (0, 1)
        n = self.labels.shape[0]
        mine = torch.arange(rank, n, size)
        per_rank = -(-n // size)
        valid = torch.ones(per_rank, dtype=torch.bool)
        if len(mine) < per_rank:
            valid[len(mine):] = False
            mine = torch.cat([mine, mine.new_zeros(per_rank - len(mine))])
        return mine, valid

    @torch.no_grad()
    def run(self, model: nn.Module, forward=None) -> dict:
        """The metrics of ``model`` (left in the train/eval modes it came in, module by module).

        forward: what scores a batch in its place, the same function of the same weights
            (``vitlab.fast.compile_for_inference(model)``, say); None: ``model`` itself.
        """
        if getattr(getattr(model, "cfg", None), "num_classes", None) == 0:  # its features would be scored as classes
            raise ValueError("the model has no head (num_classes=0): it gives features, not class scores to evaluate")
        forward = model if forward is None else forward
        size = self.image_size or tuple(model.cfg.img_size)
        mine, valid = self._my_examples()
        names = ("loss", "top1", "top5", "top1_single", "top1_flip", *(f"views_{k}" for k in self.view_sets))
        # a multi-label set's "top1" sums count its precision@1, and it has no top-5
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)  # read once, at the end
        all_logits = []
        with evaluating(model):
            for start in range(0, len(mine), self.batch_size):
                idx, ok = mine[start:start + self.batch_size], valid[start:start + self.batch_size].to(self.device)
                x = to_float(resize(self.images[idx].to(self.device), size))
                y = self.labels[idx].to(self.device)
                with autocast(self.device, self.precision):
                    views = [forward(view).float() for view in tta_views(x, self.flip, self.shift, self.diagonal)]
                logits = views[0]
                if start == 0 and self.top_label >= logits.shape[-1]:
                    raise ValueError(f"labels: class index {self.top_label} is beyond the model's "
                                     f"{logits.shape[-1]} classes")
                single = flip_pair = torch.zeros((), device=self.device)
                positive = (label_targets(y, logits.shape[-1]) if self.multi_label or self.loss == "sigmoid_xent"
                            else None)
                several = positive if self.multi_label else None
                # each nested set's ensemble; the last set is all the views
                ensembles = [mean_probability(*views[:k], loss=self.loss) for k in self.view_sets]
                nested = [(top1_hits(ensemble, y, several) & ok).sum() for ensemble in ensembles]
                if len(views) > 1:
                    single = nested[0]
                    if self.flip and self.shift:  # views[1] is the mirror image
                        flip_pair = nested[1]
                    logits = ensembles[-1]
                if self.multi_label:
                    top1, top5 = (top1_hits(logits, y, several) & ok).sum(), torch.zeros((), device=self.device)
                else:
                    rank = label_rank(logits, y)
                    top1, top5 = ((rank == 0) & ok).sum(), ((rank < 5) & ok).sum()
                if self.loss == "sigmoid_xent":
                    losses = sigmoid_losses(views, positive)
                elif self.multi_label:  # the training loss's multi-hot targets
                    losses = -(positive * logits.log_softmax(-1)).sum(-1)
                else:
                    losses = F.cross_entropy(logits, y, reduction="none")
                loss = (losses * ok).sum()
                sums += torch.stack([loss, top1, top5, single, flip_pair, *nested]).double()
                if self.report_bins is not None:
                    all_logits.append(logits.cpu().numpy())
        sums = dict(zip(names, sums.tolist()))
        if self.world is not None:
            sums = dict(zip(sums, self.world.all_reduce_sum(list(sums.values()))))
        n = int(self.labels.shape[0])
        score = "prec1" if self.multi_label else "top1"  # what the share of hits is: named as it is
        result = {"n": n, "loss": sums["loss"] / n, score: sums["top1"] / n}
        if not self.multi_label:
            result["top5"] = sums["top5"] / n
        if self.flip or self.shift:
            result[f"{score}_single"] = sums["top1_single"] / n
        if self.flip and self.shift:
            result[f"{score}_flip"] = sums["top1_flip"] / n
        if len(self.view_sets) > 2:  # sets beyond the image and its mirror
            result[f"{score}_views"] = {k: sums[f"views_{k}"] / n for k in self.view_sets}
        if self.report_bins is not None:
            report = classification_report(np.concatenate(all_logits), self.labels.numpy(), num_bins=self.report_bins,
                                           loss=self.loss)
            result.update({k: report[k] for k in ("ece", "per_class_accuracy", "confusion_matrix")})
        return result


def check_trained_classifier(model_section: dict, checkpoint) -> None:
    """That the checkpoint's run trained its classifier: a run of masked patch prediction
    (``model.mpp`` of its recorded ``model`` section) trains none and saves its ViT with the head
    it was built with, zero, so every image would get the same scores (top-1 the share of class
    0).  ValueError naming the run's setting and what scores it instead."""
    mpp = model_section.get("mpp")
    if mpp is not None:
        raise ValueError(f"{checkpoint}: pre-trained by masked patch prediction (model.mpp={mpp!r}), which trains no "
                         "classifier: its head is as it was built, so every image would get the same scores; fine-tune "
                         f"it (vitlab finetune --init {checkpoint}) for a classifier, or probe its features "
                         "(vitlab fewshot)")


def top1_hits(scores: torch.Tensor, labels: torch.Tensor, several: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool: each image's top-1 class (argmax: of equal scores the lower class) is its label,
    or, ``several`` a multi-label set's (B, K) ``label_targets``, one of its labels (precision@1)."""
    top = scores.argmax(-1)
    return top == labels if several is None else several.gather(1, top[:, None]).squeeze(1)


def label_targets(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(B, K) bool: each image's label, or of (B, L) labels each of a multi-label image's (-1 fills a row)."""
    if labels.ndim == 1:
        return F.one_hot(labels.long(), num_classes).bool()  # any integer type the evaluator takes
    counts = torch.zeros(len(labels), num_classes, device=labels.device)
    return counts.scatter_add_(1, labels.long().clamp(min=0), (labels >= 0).float()) > 0


def sigmoid_losses(views: list[torch.Tensor], positive: torch.Tensor) -> torch.Tensor:
    """(B,) the sigmoid cross-entropy, summed over the K classes, of each image's views' (B, K)
    logits against its (B, K) ``positive`` classes (``label_targets``: a one-hot label, or a
    multi-label image's labels): of the views' mean probability of each class (one view: its
    own logits', as the training loss has it), in log space."""
    log_p, log_not_p = mean_sigmoid(torch.stack(views))
    return -torch.where(positive, log_p, log_not_p).sum(-1)
