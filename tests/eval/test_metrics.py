"""Metrics against cases computed by hand."""
import numpy as np
import pytest

from vitlab.eval.metrics import (
    classification_report,
    confusion_matrix,
    expected_calibration_error,
    per_class_accuracy,
    softmax,
    topk_accuracy,
)

# 4 examples, 6 classes.  Rankings (best first):
#   ex0: 0 > 1 > ...          label 0 -> rank 0
#   ex1: 2 > 1 > 0 ...        label 1 -> rank 1
#   ex2: 5 > 4 > 3 > 2 > 1 > 0, label 0 -> rank 5
#   ex3: 3 > 4 > 5 > 0 > 1 > 2, label 2 -> rank 5
SCORES = np.array([
    [9, 8, 1, 1, 1, 1],
    [1, 5, 6, 0, 0, 0],
    [0, 1, 2, 3, 4, 5],
    [3, 2, 1, 6, 5, 4],
], dtype=float)
LABELS = np.array([0, 1, 0, 2])


def test_topk_hand_computed():
    acc = topk_accuracy(SCORES, LABELS, ks=(1, 2, 5, 6))
    assert acc == {1: 0.25, 2: 0.5, 5: 0.5, 6: 1.0}


def test_topk_ties_break_towards_lower_index():
    assert topk_accuracy(np.zeros((2, 3)), np.array([0, 1]), ks=(1,)) == {1: 0.5}


def test_confusion_and_per_class():
    preds = SCORES.argmax(axis=1)  # [0, 2, 5, 3]
    cm = confusion_matrix(LABELS, preds, 6)
    expected = np.zeros((6, 6), int)
    expected[0, 0] = expected[1, 2] = expected[0, 5] = expected[2, 3] = 1
    np.testing.assert_array_equal(cm, expected)
    pc = per_class_accuracy(cm)
    np.testing.assert_allclose(pc[:3], [0.5, 0.0, 0.0])
    assert np.isnan(pc[3:]).all()  # classes without examples


@pytest.mark.parametrize("labels, predictions, named", [([0, 1], [3, 0], "predictions"), ([0, 3], [0, 0], "labels"),
                                                       ([-1, 0], [0, 0], "labels")])
def test_confusion_refuses_a_class_index_outside_its_classes(labels, predictions, named):
    # a prediction of class 3 of 3 was counted in the next row's first cell: (0, 3) -> flat 3 -> (1, 0)
    with pytest.raises(ValueError, match=rf"^{named} must lie in \[0, 3\)"):
        confusion_matrix(np.array(labels), np.array(predictions), 3)


def test_ece_hand_computed():
    # confidences and correctness, 15 bins of width 1/15 (right-closed):
    #   0.9 right, 0.9 wrong -> bin (0.8667, 0.9333]: acc 0.5, conf 0.9  -> 2/4 * 0.4  = 0.2
    #   0.6 right            -> bin (0.5333, 0.6]:    acc 1,   conf 0.6  -> 1/4 * 0.4  = 0.1
    #   0.34 right           -> bin (0.3333, 0.4]:    acc 1,   conf 0.34 -> 1/4 * 0.66 = 0.165
    probs = np.array([
        [0.9, 0.1, 0.0],
        [0.9, 0.1, 0.0],
        [0.2, 0.6, 0.2],
        [0.34, 0.33, 0.33],
    ])
    labels = np.array([0, 1, 1, 0])
    assert expected_calibration_error(probs, labels, num_bins=15) == pytest.approx(0.2 + 0.1 + 0.165)


def test_ece_perfectly_calibrated_and_one_bin():
    probs = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert expected_calibration_error(probs, np.array([0, 1])) == 0.0
    # one bin: |mean acc - mean conf| = |0.5 - 0.75|
    probs = np.array([[0.75, 0.25], [0.75, 0.25]])
    assert expected_calibration_error(probs, np.array([0, 1]), num_bins=1) == pytest.approx(0.25)


def test_softmax_and_report():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    np.testing.assert_allclose(softmax(logits), [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    rep = classification_report(logits, np.array([0, 1]))
    assert rep["top1"] == 0.5 and rep["top5"] == 1.0 and rep["n"] == 2
    # ECE: bin (0.6667, 0.7333]: acc 1, conf 0.7 -> 0.5*0.3; bin (0.7333, 0.8]: acc 0, conf 0.8 -> 0.5*0.8
    assert rep["ece"] == pytest.approx(0.15 + 0.4)
    assert rep["confusion_matrix"] == [[1, 0, 0], [0, 0, 1], [0, 0, 0]]
    assert rep["per_class_accuracy"] == [1.0, 0.0, None]


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="labels"):
        topk_accuracy(np.zeros((2, 3)), np.array([0, 3]))


def test_bins_are_a_positive_integer_refused_before_any_scoring():
    # numpy's bincount said "'list' argument must have no negative elements" for 0 bins, and
    # `vitlab eval --bins 0` said it only after the whole set had been scored
    import torch

    from vitlab.eval import Evaluator

    probs = np.array([[0.75, 0.25], [0.75, 0.25]])
    for bins in (0, -3, 2.5):
        with pytest.raises(ValueError, match=rf"^num_bins={bins}: must be a positive integer"):
            expected_calibration_error(probs, np.array([0, 1]), num_bins=bins)
    images, labels = torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"^report_bins=0: must be a positive integer \(confidence bins"):
        Evaluator(images, labels, report_bins=0)


def test_evaluator_refuses_labels_that_do_not_fit_by_name():
    """Labels are checked against the images and the model's classes: they were cross-entropy's
    "IndexError: Target 5 is out of bounds", a ZeroDivisionError for an empty set, and, for fewer
    labels than images or a model without a head (its features taken for class scores), a result."""
    import torch

    from vitlab.config import ViTConfig
    from vitlab.eval import Evaluator
    from vitlab.models import create_model

    cfg = ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=3)
    model = create_model(cfg)
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    for labels in (torch.tensor([0, 1]), torch.zeros(4), torch.zeros(4, 1, 1, dtype=torch.long), [0, 1, 2, 0]):
        with pytest.raises(ValueError, match=r"^labels: expected an integer tensor \(N,\), one class index per image"):
            Evaluator(images, labels)
    with pytest.raises(ValueError, match=r"^labels: class indices must be >= 0, got -1"):
        Evaluator(images, torch.tensor([0, 1, -1, 0]))
    with pytest.raises(ValueError, match=r"^images: no images to evaluate"):
        Evaluator(images[:0], torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^labels: class index 5 is beyond the model's 3 classes"):
        Evaluator(images, torch.tensor([0, 1, 5, 0]), batch_size=2).run(model)
    with pytest.raises(ValueError, match=r"^the model has no head \(num_classes=0\)"):
        Evaluator(images, torch.tensor([0, 1, 2, 0])).run(create_model(cfg, num_classes=0))
    assert Evaluator(images, torch.tensor([0, 1, 2, 0], dtype=torch.uint8)).run(model)["n"] == 4


def test_evaluator_breaks_ties_towards_the_lower_class_as_its_report_does():
    """Equal scores (a head still all zeros, as every head starts; bf16 logits) go to the lower class
    index in top-1 and top-5, as argmax (the confusion matrix, ``top1_views``) and ``topk_accuracy``
    break them: torch's topk put class 8 first among ten equal logits, so top-1 was the share of
    class 8 while the confusion matrix of the same report counted every image as class 0."""
    import torch

    from vitlab.config import ViTConfig
    from vitlab.eval import Evaluator
    from vitlab.models import create_model

    cfg = ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=10)
    model = create_model(cfg)  # the head starts at zero: every image scores all ten classes alike
    assert not model.head.weight.any() and not model.head.bias.any()
    labels = torch.tensor([0, 0, 0, 1, 4, 5, 8, 8, 9, 9])
    images = torch.randint(0, 256, (len(labels), 3, 8, 8), dtype=torch.uint8)
    for views in ({}, {"flip": True}):
        result = Evaluator(images, labels, batch_size=4, report_bins=15, **views).run(model)
        trace = np.trace(np.array(result["confusion_matrix"]))
        assert result["top1"] == trace / len(labels) == 0.3  # the three of class 0
        assert result["top5"] == 0.5  # classes 0 to 4
        assert result.get("top1_single", 0.3) == 0.3


def test_the_evaluator_counts_each_labels_place_as_a_stable_sort_does_without_sorting(monkeypatch):
    """top-1 and top-5 came from a stable sort of every class's logit (an ImageNet-21k head: 21,843
    per image); they are counted now, with the same answer: equal logits go to the lower class (many
    ties here: logits of four values), NaN above every number as torch's sort puts it, -0.0 equal to 0.0."""
    import torch

    from vitlab.config import ViTConfig
    from vitlab.eval import Evaluator
    from vitlab.models import create_model

    g = torch.Generator().manual_seed(0)
    n, k = 64, 1000
    logits = torch.randint(0, 4, (n, k), generator=g).float()
    logits[0, :] = 0.0
    logits[0, 1::2] = -0.0
    logits[1, [3, 7]] = float("nan")
    logits[2, [5, 900]] = float("inf")
    logits[3, :] = float("nan")
    logits[4, 10] = float("-inf")
    labels = torch.randint(0, k, (n,), generator=g)
    labels[:5] = torch.tensor([7, 7, 900, 6, 10])
    sorted_place = (logits.sort(dim=-1, descending=True, stable=True).indices == labels[:, None]).int().argmax(-1)
    assert sorted_place[:5].tolist() == [7, 1, 1, 6, k - 1]

    rows = iter(logits.split(16))
    model = create_model(ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=k))
    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "sort", lambda *a, **kw: pytest.fail("the evaluator sorted the logits"))
        result = Evaluator(torch.zeros(n, 3, 8, 8, dtype=torch.uint8), labels, batch_size=16).run(
            model, forward=lambda x: next(rows))
    assert result["top1"] == (sorted_place == 0).float().mean().item()
    assert result["top5"] == (sorted_place < 5).float().mean().item()
    assert 0 < result["top5"] < 1

    from vitlab.eval.evaluator import label_rank

    assert torch.equal(label_rank(logits, labels), sorted_place)
    assert torch.equal(label_rank(logits, labels.to(torch.uint8 if k <= 256 else torch.int32)), sorted_place)


def test_topk_counts_nan_above_every_number_as_the_confusion_matrix_and_the_evaluator_do():
    """numpy's sort put NaN below every number, so a label scored 0.3 beside a NaN was a top-1 hit
    in classification_report's top1 (0.5 here) while its confusion matrix, from argmax, counted it
    an error (0.25), and the evaluator ranks NaN above too."""
    import torch

    from vitlab.eval.evaluator import label_rank

    nan = np.nan
    scores = np.array([[0.1, nan, 0.3], [nan, nan, 0.0], [1.0, 1.0, 1.0], [0.5, 0.2, np.inf]], np.float32)
    labels = np.array([2, 1, 1, 2])
    with np.errstate(invalid="ignore"):  # the calibration error of NaN scores is NaN
        report = classification_report(scores, labels)
    assert report["top1"] == np.trace(np.array(report["confusion_matrix"])) / len(labels) == 0.25
    rank = label_rank(torch.from_numpy(scores), torch.from_numpy(labels)).numpy()
    assert rank.tolist() == [1, 1, 1, 0]
    assert topk_accuracy(scores, labels, (1, 2, 3)) == {k: float(np.mean(rank < k)) for k in (1, 2, 3)}


@pytest.mark.parametrize("loss", ["sigmoid_xent", "softmax_xent"])
def test_a_multi_label_set_is_scored_by_precision_at_1_against_every_label(loss):
    """A multi-label set (JFT-style shards) was scored against each image's first label: a top-1 class
    that was another of its labels counted as an error (top-1 0.25 here), where big_vision's evaluator
    counts it right (prec@1: 0.75); and the loss was taken against the first label alone."""
    import torch
    import torch.nn.functional as F

    from vitlab.config import ViTConfig
    from vitlab.eval import Evaluator
    from vitlab.models import create_model

    logits = torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.0],   # top-1 2: one of its labels, not its first
                           [4.0, 1.0, 0.0, 0.0, 0.0],   # top-1 0: not its label
                           [0.0, 2.0, 0.0, 1.0, 0.0],   # top-1 1: its second label
                           [0.0, 0.0, 0.0, 0.0, 5.0]])  # top-1 4: its one label
    labels = torch.tensor([[0, 2, -1], [1, -1, -1], [3, 1, 0], [4, -1, -1]])  # -1 fills a row
    hot = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 0, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.float)
    model = create_model(ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=5))
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    rows = iter(logits.split(3))  # two batches
    result = Evaluator(images, labels, batch_size=3, loss=loss).run(model, forward=lambda x: next(rows))
    assert result["prec1"] == 0.75 and "top1" not in result and "top5" not in result  # named as what it counts
    expected = (F.binary_cross_entropy_with_logits(logits, hot, reduction="none").sum(1) if loss == "sigmoid_xent"
                else -(hot * logits.log_softmax(-1)).sum(1))  # the training loss's multi-hot targets
    assert result["loss"] == pytest.approx(expected.mean().item(), rel=1e-6)
    # with test-time views each one's share is named so too
    flipped = Evaluator(images, labels, flip=True, loss=loss).run(model, forward=lambda x: logits)
    assert flipped["prec1"] == flipped["prec1_single"] == 0.75 and "top1_single" not in flipped
    assert flipped["loss"] == pytest.approx(result["loss"], rel=1e-6)  # two views alike: one view's loss
    # a row of no label is refused by name, and so is the report of one label per image
    with pytest.raises(ValueError, match=r"^labels: image 1 has no label \(-1 only fills a row of fewer labels\)"):
        Evaluator(images, torch.tensor([[0, 2], [-1, -1], [3, 1], [4, -1]]))
    with pytest.raises(ValueError, match=r"^labels: class indices must be >= 0 \(-1 fills a multi-label row\), got -2"):
        Evaluator(images, torch.tensor([[0, 2], [-2, 1], [3, 1], [4, -1]]))
    with pytest.raises(ValueError, match=r"^report_bins: the full report's per-class accuracy"):
        Evaluator(images, labels, report_bins=15)


def test_a_sigmoid_runs_views_and_calibration_take_its_per_class_sigmoid_probabilities():
    """A sigmoid_xent run (paper_pretrain's) gives each class a probability of its own, sigmoid(z_k): its
    test-time views were ensembled by their mean softmax probability, which ranks the first image's
    classes the other way (top-1 0.5 here, 1.0 by the mean of the sigmoid probabilities), and the
    calibration error was of softmax probabilities, not those the model was trained to give.  A softmax
    run's, and a sigmoid run's single-view top-1, are as they were."""
    import torch

    from vitlab.config import ViTConfig
    from vitlab.eval import Evaluator
    from vitlab.models import create_model

    model = create_model(ViTConfig(img_size=8, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=3))
    images, labels = torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([1, 0])
    image = torch.tensor([[8.0, 0.0, -9.0], [2.0, -1.0, -9.0]])
    mirror = torch.tensor([[-1.0, 6.0, -9.0], [1.0, -3.0, -9.0]])

    def views(*logits):  # what the model gives each view of the batch in turn: the image, then its mirror image
        calls = iter(logits)
        return lambda x: next(calls)

    probabilities = {"sigmoid_xent": torch.sigmoid, "softmax_xent": lambda z: z.softmax(-1)}
    for loss, top1 in (("sigmoid_xent", 1.0), ("softmax_xent", 0.5)):
        p = probabilities[loss]
        flipped = Evaluator(images, labels, flip=True, loss=loss, report_bins=4).run(model, forward=views(image, mirror))
        assert (flipped["top1"], flipped["top1_single"]) == (top1, 0.5), loss
        mean = ((p(image) + p(mirror)) / 2).double().numpy()
        assert flipped["ece"] == pytest.approx(expected_calibration_error(mean, labels.numpy(), 4), abs=1e-6), loss
        single = Evaluator(images, labels, loss=loss, report_bins=4).run(model, forward=views(image))
        assert single["top1"] == 0.5
        assert single["ece"] == pytest.approx(expected_calibration_error(p(image).double().numpy(), labels.numpy(), 4),
                                              abs=1e-6), loss


def test_evaluator_refuses_a_loss_it_cannot_report_before_any_work():
    import torch

    from vitlab.eval import Evaluator

    images, labels = torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"loss='xent': allowed values are 'softmax_xent', 'sigmoid_xent'"):
        Evaluator(images, labels, loss="xent")
