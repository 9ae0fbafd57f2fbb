import numpy as np
import torch

from vitlab.config import ViTConfig
import pytest

from vitlab.eval.features import FeatureCache, extract_features, predict_logits, tta_view_count, tta_views
from vitlab.models import create_model

TINY = ViTConfig(img_size=16, patch_size=4, width=32, depth=1, mlp_dim=64, num_heads=2, num_classes=5)


def images(n, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)


def test_features_are_the_representation_in_batches():
    torch.manual_seed(0)
    model = create_model(TINY, representation_size=24)
    x = images(5, size=20)  # resized to the model's 16 px
    f = extract_features(model, x, batch_size=2)
    assert f.shape == (5, 24) and f.dtype == np.float32
    with torch.no_grad():
        ref = model.forward_head(model.forward_features(torch.nn.functional.interpolate(
            x.float(), size=(16, 16), mode="bilinear", align_corners=False).round().clamp(0, 255) / 127.5 - 1),
            pre_logits=True)
    np.testing.assert_allclose(f, ref.numpy(), atol=1e-5)
    assert np.abs(f).max() <= 1.0  # pre-logits end in tanh
    assert predict_logits(model, x).shape == (5, 5)


def test_gap_model_without_pre_logits_gives_width():
    model = create_model(TINY, classifier="gap")
    assert extract_features(model, images(3)).shape == (3, 32)


def test_cache_computes_once(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return np.arange(6.0).reshape(2, 3)

    cache = FeatureCache(tmp_path)
    a = cache.get(("ckpt", "data", 16), compute)
    b = cache.get(("ckpt", "data", 16), compute)
    fresh = FeatureCache(tmp_path).get(("ckpt", "data", 16), compute)  # from the .npz
    assert len(calls) == 1 and (a == b).all() and (a == fresh).all()
    FeatureCache().get("other", compute)
    assert len(calls) == 2


def test_a_folders_key_changes_when_a_file_in_it_is_rewritten_in_place(tmp_path):
    """A run folder's weights copied over in place (cp new.safetensors run/model.safetensors) leave
    the folder's own size and mtime as they were: its key was those two, and `vitlab fewshot run/`
    read the features of the earlier weights back from the cache."""
    import os

    from vitlab.eval.features import file_key

    run = tmp_path / "run"
    run.mkdir()
    weights = run / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))
    folder_times = run.stat()
    before = file_key(run)
    assert before == file_key(run) and file_key(weights) == file_key(weights)
    with open(weights, "r+b") as f:  # other weights of the same size, in place
        f.write(b"b" * 64)
    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))
    os.utime(run, ns=(folder_times.st_atime_ns, folder_times.st_mtime_ns))
    assert run.stat().st_mtime_ns == folder_times.st_mtime_ns and run.stat().st_size == folder_times.st_size
    assert file_key(run) != before


def test_a_damaged_cache_file_is_computed_again_with_a_warning(tmp_path):
    """A truncated cache file (a full disk, a copy cut short) raised zipfile's BadZipFile as a
    traceback; a garbled one numpy's "contains pickled (object) data"."""
    features = np.arange(6.0).reshape(2, 3)
    FeatureCache(tmp_path).get("key", lambda: features)
    (path,) = tmp_path.glob("*.npz")
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"garbage"):
        path.write_bytes(damaged)
        with pytest.warns(UserWarning, match=f"feature cache {path} is damaged .*; computing the features again"):
            assert (FeatureCache(tmp_path).get("key", lambda: features) == features).all()
        assert (FeatureCache(tmp_path).get("key", lambda: 1 / 0) == features).all()  # written again, whole


def test_a_cache_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The features went to NAME.<pid>.tmp.npz, renamed into place: a write that failed (a full disk)
    left that file behind in the cache folder, and every such failure another."""
    features = np.arange(6.0).reshape(2, 3)
    real_savez = np.savez

    def half_then_full(file, **arrays):
        real_savez(file, **arrays)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        FeatureCache(tmp_path).get("key", lambda: features)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    assert (FeatureCache(tmp_path).get("key", lambda: features) == features).all()
    assert (FeatureCache(tmp_path).get("key", lambda: 1 / 0) == features).all()  # written whole, read back


def test_flip_averaging_is_the_mean_of_the_two_views_probabilities():
    torch.manual_seed(0)
    model = create_model(TINY).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # a zero head would predict uniformly
    x = images(6)
    averaged = predict_logits(model, x, flip=True)
    plain = predict_logits(model, x)
    mirrored = predict_logits(model, x.flip(-1))
    softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.exp(averaged), (softmax(plain) + softmax(mirrored)) / 2, atol=1e-6)
    assert not np.allclose(softmax(plain), softmax(mirrored), atol=1e-3)  # the two views do differ
    # an image equal to its mirror image gets its own single-view probabilities
    symmetric = torch.cat([x[..., :8], x[..., :8].flip(-1)], dim=-1)
    np.testing.assert_allclose(np.exp(predict_logits(model, symmetric, flip=True)),
                               softmax(predict_logits(model, symmetric)), atol=1e-6)


def test_the_public_view_averages_take_a_sigmoid_runs_per_class_probabilities():
    """A sigmoid_xent run (paper_pretrain's) gives each class a probability of its own: tta_averaged and
    predict_logits averaged its views by their mean softmax whatever the run's loss, which ranks the
    first image's classes the other way (class 0 by the mean softmax, 1 by the mean sigmoid, as the
    Evaluator scores it); loss= says what the views average, the softmax by default as before."""
    from vitlab.eval.features import class_probabilities, mean_probability, tta_averaged

    image = torch.tensor([[8.0, 0.0, -9.0], [2.0, -1.0, -9.0]])
    mirror = torch.tensor([[-1.0, 6.0, -9.0], [1.0, -3.0, -9.0]])

    x = torch.zeros(2, 3, 4, 4)
    x[..., -1] = 1  # a mirror image that differs from the image

    def model_of(view):  # what the model gives the image, and its mirror image
        return image if torch.equal(view, x) else mirror

    for loss, p, top in (("sigmoid_xent", torch.sigmoid, [1, 0]), ("softmax_xent", lambda z: z.softmax(-1), [0, 0])):
        scores = tta_averaged(model_of, flip=True, loss=loss)(x)
        assert scores.argmax(-1).tolist() == top, loss
        assert torch.allclose(class_probabilities(scores, loss=loss), (p(image) + p(mirror)) / 2, atol=1e-6), loss
        assert torch.allclose(class_probabilities(image, mirror, loss=loss), (p(image) + p(mirror)) / 2, atol=1e-6)
        assert torch.equal(scores, mean_probability(image, mirror, loss=loss))  # the Evaluator's rule, not another
    assert torch.equal(tta_averaged(model_of, flip=True)(x), mean_probability(image, mirror))  # softmax by default
    # the sigmoid's need not sum to 1; a single view's are its own sigmoid (softmax) probabilities
    assert not torch.allclose(class_probabilities(image, loss="sigmoid_xent").sum(-1), torch.ones(2))
    assert torch.allclose(class_probabilities(image, loss="sigmoid_xent"), image.sigmoid())
    assert torch.allclose(class_probabilities(image), image.softmax(-1))

    torch.manual_seed(0)
    model = create_model(TINY).eval()
    torch.nn.init.normal_(model.head.weight, std=2.0)
    pixels = images(6)
    floats = pixels.float() / 127.5 - 1  # the [-1, 1] scaling predict_logits applies
    with torch.no_grad():
        mean = torch.stack([model(v).sigmoid() for v in tta_views(floats, flip=True, shift=2)]).mean(0)
    scores = torch.from_numpy(predict_logits(model, pixels, flip=True, shift=2, loss="sigmoid_xent"))
    assert torch.allclose(class_probabilities(scores, loss="sigmoid_xent"), mean, atol=1e-5)
    with pytest.raises(ValueError, match=r"^loss='xent': allowed values are 'softmax_xent', 'sigmoid_xent'$"):
        predict_logits(model, pixels, loss="xent")  # refused by name, with one view as with several
    with pytest.raises(ValueError, match=r"^loss='xent'"):
        tta_averaged(model, flip=True, loss="xent")


def test_tta_views_are_reflect_filled_translations_and_mirrors():
    x = torch.randn(2, 3, 7, 9)
    views = tta_views(x, flip=True, shift=2)
    assert len(views) == 10 and all(v.shape == x.shape for v in views)
    # reference: NumPy's reflect padding (no edge repeat, as torch's), then every crop at offset +-2
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (2, 2), (2, 2)), mode="reflect")
    crops = {(dy, dx): padded[..., 2 + dy:9 + dy, 2 + dx:11 + dx] for dy, dx in
             [(0, 0), (0, -2), (0, 2), (-2, 0), (2, 0)]}
    got = [v.numpy() for v in views[::2]]
    for want in crops.values():  # each translation appears once
        assert sum(np.array_equal(g, want) for g in got) == 1
    np.testing.assert_array_equal(views[0].numpy(), x.numpy())  # the image itself comes first
    for plain, mirrored in zip(views[::2], views[1::2]):
        np.testing.assert_array_equal(mirrored.numpy(), plain.flip(-1).numpy())
    for flip in (False, True):  # the count the time limit budgets with is the count made
        for shift, expected in ((0, 1), (1, 5)):
            assert len(tta_views(x, flip, shift)) == tta_view_count(flip, shift) == expected * (1 + flip)
    with pytest.raises(ValueError, match="shift=7"):
        tta_views(x, shift=7)  # 7x9 images: reflection fills at most 6 pixels


def test_shifted_prediction_is_the_mean_over_the_ten_views():
    torch.manual_seed(0)
    model = create_model(TINY).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)
    x = images(4)
    averaged = np.exp(predict_logits(model, x, flip=True, shift=2))
    floats = x.float() / 127.5 - 1  # the [-1, 1] scaling predict_logits applies
    with torch.no_grad():
        probs = torch.stack([model(v).softmax(-1) for v in tta_views(floats, flip=True, shift=2)])
    np.testing.assert_allclose(averaged, probs.mean(0).numpy(), atol=1e-6)
    assert not np.allclose(averaged, np.exp(predict_logits(model, x, flip=True)), atol=1e-3)


def test_diagonal_and_several_shift_sizes_make_the_nested_grid_of_translations():
    from vitlab.config import ConfigError
    from vitlab.eval.features import check_tta_shift, tta_view_prefixes

    x = torch.randn(2, 3, 7, 9)
    padded = {s: np.pad(x.numpy(), ((0, 0), (0, 0), (s, s), (s, s)), mode="reflect") for s in (1, 2)}

    def crop(dy, dx):  # the image's content moved by (dy, dx), reflection filling the border
        s = max(abs(dy), abs(dx))
        return x.numpy() if s == 0 else padded[s][..., s - dy:s - dy + 7, s - dx:s - dx + 9]

    views = [v.numpy() for v in tta_views(x, flip=True, shift=(2, 1), diagonal=True)]
    assert len(views) == tta_view_count(True, (2, 1), True) == 34
    assert tta_view_prefixes(True, (2, 1), True) == [1, 2, 10, 18, 26, 34]
    assert tta_view_prefixes(False, 2, True) == [1, 5, 9] and tta_view_prefixes(True) == [1, 2]
    rings = [[(0, 0)], [(0, 2), (0, -2), (2, 0), (-2, 0)], [(2, 2), (2, -2), (-2, 2), (-2, -2)],
             [(0, 1), (0, -1), (1, 0), (-1, 0)], [(1, 1), (1, -1), (-1, 1), (-1, -1)]]
    start = 0
    for ring in rings:  # each prefix adds exactly its ring of positions, each once, each with its mirror
        plain = views[start:start + 2 * len(ring)][::2]
        for dy, dx in ring:
            assert sum(np.array_equal(v, crop(dy, dx)) for v in plain) == 1, (dy, dx)
        for a, b in zip(views[start::2][:len(ring)], views[start + 1::2][:len(ring)]):
            np.testing.assert_array_equal(b, a[..., ::-1])
        start += 2 * len(ring)
    # the first ten are the ten views of shift 2 alone, in their order: one pass scores both sets
    for a, b in zip(views[:10], tta_views(x, flip=True, shift=2)):
        np.testing.assert_array_equal(a, b.numpy())
    for bad in ((), (2, 2), (0, 1), (1, 7), 7, True, (1.5,), ([1],)):
        with pytest.raises(ConfigError, match="shift="):
            check_tta_shift(bad, (7, 9))
    check_tta_shift((6, 1), (7, 9))
