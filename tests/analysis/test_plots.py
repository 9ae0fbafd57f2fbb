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
    png_ok(plots.plot_lines({"ViT": ([1, 10, 100], [0.3, 0.5, 0.6], [0.01, 0.02, 0.0]),
                             "ResNet": ([1, 10, 100], [0.4, 0.5, 0.55], None)}, "examples", "top-1", logx=True))
    png_ok(plots.plot_bars(["token/0.001", "gap/0.001"], [0.4, 0.38], [0.01, 0.02], ylabel="top-1"))
    png_ok(plots.plot_distance_by_layer({"ViT": ([1, 2, 3], [5.0, 7.0, 9.0], [2.0, 3.0, 6.0], [8.0, 9.0, 12.0], 10.2),
                                         "R+ViT": ([1, 2, 3], [6.0, 8.0, 9.0], [4.0, 6.0, 7.0], [8.0, 9.0, 11.0], None)}))


def test_experiment_figures_draw_what_the_table_holds():
    lines = plots.plot_lines({"a": ([1, 2], [0.5, 0.7], [0.1, 0.0]), "b": ([1, 2], [0.2, 0.3], None)}, "x", "y")
    drawn = [line for line in lines.axes[0].get_lines() if line.get_marker() == "o"]  # not the error bars' caps
    assert [list(line.get_ydata()) for line in drawn] == [[0.5, 0.7], [0.2, 0.3]]
    assert [t.get_text() for t in lines.axes[0].get_legend().get_texts()] == ["a", "b"]
    bars = plots.plot_bars(["x/1", "y/2", "z/3"], [0.1, 0.4, 0.2])
    assert [round(p.get_height(), 6) for p in bars.axes[0].patches] == [0.1, 0.4, 0.2]
    assert [t.get_text() for t in bars.axes[0].get_xticklabels()] == ["x/1", "y/2", "z/3"]
    layers = plots.plot_distance_by_layer({"ViT": ([1, 2], [3.0, 4.0], [1.0, 2.0], [5.0, 6.0], 7.5)})
    ax = layers.axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == [3.0, 4.0] and list(ax.get_lines()[1].get_ydata()) == [7.5, 7.5]


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


def test_a_dark_uint8_image_is_drawn_in_its_255_levels():
    # uint8 images whose brightest pixel is 1 (a 0/1 mask saved as an image, a nearly black photo) were
    # taken for [0, 1] floats: their 1s were drawn white beside the rollout, as the model sees near black
    dark = np.zeros((1, 3, 4, 4), dtype=np.uint8)
    dark[..., 0, 0] = 1
    fig = plots.plot_attention_overlay(dark, np.ones((1, 4, 4)))
    shown = fig.axes[0].get_images()[0].get_array()
    assert np.allclose(shown[0, 0], 1 / 255) and shown.max() <= 1 / 255
    # float images keep both scales: [0, 1] as given, [0, 255] divided
    for scale in (1.0, 255.0):
        floats = np.full((1, 3, 4, 4), 0.5 * scale)
        shown = plots.plot_attention_overlay(floats, np.ones((1, 4, 4))).axes[0].get_images()[0].get_array()
        assert np.allclose(shown, 0.5)
