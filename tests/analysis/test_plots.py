"""Every plot takes arrays and returns a figure that renders to PNG."""
import numpy as np
import pytest

pytest.importorskip("matplotlib")

from vitlab.analysis import plots  # noqa: E402


def png_ok(fig):
    data = plots.figure_png(fig, dpi=40)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_plot_renders():
    rng = np.random.default_rng(0)
    png_ok(plots.plot_filter_components(rng.normal(size=(10, 3, 4, 4)), np.linspace(0.3, 0.01, 10), cols=4))
    png_ok(plots.plot_position_similarity(rng.uniform(-1, 1, size=(3, 4, 3, 4))))
    png_ok(plots.plot_attention_distance(rng.uniform(0, 30, size=(4, 3)), image_size=32))
    imgs = rng.integers(0, 256, size=(2, 3, 8, 8)).astype(np.uint8)
    png_ok(plots.plot_attention_overlay(imgs, rng.uniform(size=(2, 8, 8))))
    png_ok(plots.plot_attention_heads(imgs[0], rng.uniform(size=(2, 3, 2, 2))))
    recs = [{"step": s, "loss": 1.0 / (s + 1), "lr": 0.1, "val_loss": 0.5, "note": "x"} for s in range(5)]
    png_ok(plots.plot_training_curves(recs))


def test_mosaic_layout():
    tiles = np.arange(3 * 2 * 2, dtype=float).reshape(3, 2, 2)
    m = plots.mosaic(tiles, rows=2, cols=2, gap=1)
    assert m.shape == (5, 5)
    np.testing.assert_array_equal(m[:2, 3:], tiles[1])
    assert np.isnan(m[3:, 3:]).all() and np.isnan(m[2]).all()


def test_non_rgb_filters_are_refused():
    with pytest.raises(ValueError, match="not images"):
        plots.plot_filter_components(np.zeros((4, 64, 1, 1)))
    with pytest.raises(ValueError, match="no numeric"):
        plots.plot_training_curves([{"step": 1, "tag": "a"}])
