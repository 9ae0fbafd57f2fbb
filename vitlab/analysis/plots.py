"""Figures from arrays: every function takes numpy arrays and returns a matplotlib
``Figure``; nothing here runs a model or writes a file (``figure_png`` renders bytes).

Figures are built on ``matplotlib.figure.Figure`` directly, not pyplot, so no global
state is touched and no display is needed.  Grids of many small panels (position
similarities, per-head attention) are drawn as one mosaic image, which is fast.

matplotlib is the optional ``plots`` extra: it is imported when a figure is drawn, so that
importing this module (and the report's metadata helpers) works without it, and a missing
matplotlib is one ``vitlab.extras.MissingPackage`` naming the extra.
"""
from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from vitlab.extras import require

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "mosaic",
    "plot_filter_components",
    "plot_position_similarity",
    "plot_attention_distance",
    "plot_attention_overlay",
    "plot_attention_heads",
    "plot_training_curves",
    "plot_lines",
    "plot_bars",
    "plot_distance_by_layer",
    "figure_png",
]


def _new_figure(**kwargs) -> Figure:
    """A ``matplotlib.figure.Figure`` (no pyplot, no global state)."""
    return require("matplotlib.figure", "drawing figures").Figure(**kwargs)


def _colormap(name: str):
    return require("matplotlib", "drawing figures").colormaps[name]


def figure_png(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _hwc(images: np.ndarray) -> np.ndarray:
    """uint8 (B, 3, H, W) or (B, H, W, 3) -> float (B, H, W, 3) in [0, 1]."""
    x = np.asarray(images)
    if x.ndim != 4:
        raise ValueError(f"expected a batch of images (B, 3, H, W), got shape {x.shape}")
    if x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.transpose(0, 2, 3, 1)
    # integers are 0..255 whatever their brightest pixel (a dark uint8 image's 1s were drawn white);
    # floats may be either scale
    levels = np.issubdtype(x.dtype, np.integer) or x.max() > 1.0
    x = x.astype(np.float64)
    return x / 255.0 if levels else x


def mosaic(tiles: np.ndarray, rows: int, cols: int, gap: int = 1, fill: float = np.nan) -> np.ndarray:
    """Tiles (n, h, w[, c]) -> one image (rows*(h+gap)-gap, cols*(w+gap)-gap[, c]), row-major,
    cells without a tile and the gaps filled with ``fill``."""
    n, h, w = tiles.shape[:3]
    extra = tiles.shape[3:]
    out = np.full((rows * (h + gap) - gap, cols * (w + gap) - gap, *extra), fill, dtype=np.float64)
    for i in range(min(n, rows * cols)):
        r, c = divmod(i, cols)
        out[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = tiles[i]
    return out


def plot_filter_components(components: np.ndarray, explained: np.ndarray | None = None, cols: int = 7) -> Figure:
    """Principal components (k, C, P, P) of the patch-embedding filters as RGB tiles,
    each tile min-max normalised to [0, 1] (paper Fig. 7 left: 28 components, 4 x 7)."""
    comps = np.asarray(components, dtype=np.float64)
    if comps.ndim != 4 or comps.shape[1] not in (1, 3):
        raise ValueError(
            f"components of shape {comps.shape} are not images (need 1 or 3 channels); "
            "a hybrid's patch embedding acts on ResNet features, not on pixels"
        )
    k = comps.shape[0]
    lo = comps.min(axis=(1, 2, 3), keepdims=True)
    hi = comps.max(axis=(1, 2, 3), keepdims=True)
    tiles = ((comps - lo) / np.clip(hi - lo, 1e-12, None)).transpose(0, 2, 3, 1)  # (k, P, P, C)
    if tiles.shape[-1] == 1:
        tiles = np.repeat(tiles, 3, axis=-1)
    cols = min(cols, k)
    rows = math.ceil(k / cols)
    fig = _new_figure(figsize=(1.1 * cols, 1.1 * rows + 0.5))
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i < k:
            ax.imshow(tiles[i], interpolation="nearest")
            if explained is not None:
                ax.set_title(f"{i + 1}: {100 * explained[i]:.1f}%", fontsize=7, pad=2)
        else:
            ax.axis("off")
    fig.suptitle("RGB embedding filters (first principal components)", fontsize=10)
    return fig


def plot_position_similarity(similarity: np.ndarray) -> Figure:
    """(gh, gw, gh, gw) cosine similarities as a grid of grids (paper Fig. 7 centre, Fig. 10):
    the tile at (row i, column j) shows the similarity of patch (i, j)'s embedding to all patches."""
    sim = np.asarray(similarity, dtype=np.float64)
    gh, gw = sim.shape[:2]
    image = mosaic(sim.reshape(gh * gw, gh, gw), gh, gw, gap=1)
    fig = _new_figure(figsize=(5.6, 5.2))
    ax = fig.subplots()
    cmap = _colormap("viridis").with_extremes(bad="white")
    im = ax.imshow(np.ma.masked_invalid(image), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    step_y, step_x = gh + 1, gw + 1
    ax.set_xticks(np.arange(gw) * step_x + (gw - 1) / 2, [str(i + 1) for i in range(gw)], fontsize=6)
    ax.set_yticks(np.arange(gh) * step_y + (gh - 1) / 2, [str(i + 1) for i in range(gh)], fontsize=6)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="cosine similarity")
    ax.set_title("Position embedding similarity", fontsize=10)
    return fig


def plot_attention_distance(distance: np.ndarray, image_size: int | Sequence[int] | None = None) -> Figure:
    """(layers, heads) mean attention distance in pixels, one dot per head over depth
    (paper Fig. 7 right, Fig. 11); the axis reaches the image's longer side (``image_size``: a side,
    or (height, width)), or the data where it goes further."""
    d = np.asarray(distance, dtype=np.float64)
    layers, heads = d.shape
    fig = _new_figure(figsize=(5.2, 3.8))
    ax = fig.subplots()
    colors = _colormap("tab20")(np.arange(heads) % 20)
    for h in range(heads):
        ax.scatter(np.arange(1, layers + 1), d[:, h], s=14, color=colors[h], label=f"head {h + 1}", alpha=0.9)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(np.arange(1, layers + 1))
    # the longer side: a 16x64 model's axis ended at its height, a head 15 px apart drawn as if at the image's size
    top = max(np.atleast_1d(image_size)) if image_size is not None else None
    ax.set_ylim(0, top if top and top > d.max() else d.max() * 1.1 + 1e-9)
    ax.grid(alpha=0.3)
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2, loc="lower right", frameon=False)
    ax.set_title("Mean attention distance per head", fontsize=10)
    return fig


def plot_attention_overlay(images: np.ndarray, maps: np.ndarray, titles: Sequence[str] | None = None) -> Figure:
    """Images (B, 3, H, W) uint8 and attention maps (B, H, W) (upsampled to the image):
    one column per image with the input, the input weighted by the map normalised to
    [0, 1] (as in paper Fig. 6) and the map as a heat overlay."""
    imgs = _hwc(images)
    m = np.asarray(maps, dtype=np.float64)
    if m.shape[0] != imgs.shape[0] or m.shape[1:] != imgs.shape[1:3]:
        raise ValueError(f"maps {m.shape} do not match images {imgs.shape[:3]}; upsample them first")
    m = m - m.min(axis=(1, 2), keepdims=True)
    m = m / np.clip(m.max(axis=(1, 2), keepdims=True), 1e-12, None)
    B = imgs.shape[0]
    labels = ("input", "attention-weighted", "rollout map")
    fig = _new_figure(figsize=(0.6 + 2.0 * B, 6.2))
    axes = fig.subplots(3, B, squeeze=False)
    for b in range(B):
        for r in range(3):
            ax = axes[r, b]
            ax.imshow(imgs[b] * m[b][..., None] if r == 1 else imgs[b], interpolation="bilinear")
            if r == 2:
                ax.imshow(m[b], cmap="inferno", alpha=0.6, interpolation="bilinear")
            ax.set_xticks([])
            ax.set_yticks([])
            if b == 0:
                ax.set_ylabel(labels[r], fontsize=9)
        axes[0, b].set_title(titles[b] if titles is not None else f"image {b + 1}", fontsize=9)
    fig.subplots_adjust(wspace=0.05, hspace=0.05)
    return fig


def plot_attention_heads(image: np.ndarray, maps: np.ndarray) -> Figure:
    """Raw attention from the output token for one image: maps (layers, heads, gh, gw),
    drawn as a layers x heads mosaic, each cell normalised to its own maximum."""
    m = np.asarray(maps, dtype=np.float64)
    layers, heads, gh, gw = m.shape
    m = m / np.clip(m.max(axis=(2, 3), keepdims=True), 1e-12, None)
    grid = mosaic(m.reshape(layers * heads, gh, gw), layers, heads, gap=1)
    height = min(0.6 * max(layers, 5), 9.0)
    width = height * grid.shape[1] / grid.shape[0]  # keep the mosaic's cells square
    side = min(2.6, height)
    fig = _new_figure(figsize=(side + width + 0.8, height + 0.8))
    gs = fig.add_gridspec(1, 2, width_ratios=[side, width], wspace=0.15)
    ax_img = fig.add_subplot(gs[0])
    ax_img.imshow(_hwc(np.asarray(image)[None])[0])
    ax_img.set_xticks([])
    ax_img.set_yticks([])
    ax_img.set_title("input", fontsize=8)
    ax = fig.add_subplot(gs[1])
    cmap = _colormap("magma").with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(np.arange(heads) * (gw + 1) + (gw - 1) / 2, [str(h + 1) for h in range(heads)], fontsize=6)
    ax.set_yticks(np.arange(layers) * (gh + 1) + (gh - 1) / 2, [str(l + 1) for l in range(layers)], fontsize=6)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title("attention of the output token, per layer and head", fontsize=9)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return fig


def _panel_of(key: str) -> str:
    """Training and validation versions of a metric share a panel: loss/val_loss, train_top1/val_top1."""
    for prefix in ("val_", "train_"):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def plot_training_curves(records: Sequence[Mapping[str, float]], x_key: str = "step") -> Figure:
    """One panel per numeric metric of a run's log (records: dicts with ``x_key`` and any
    numeric values); ``loss`` and ``val_loss``, ``train_top1`` and ``val_top1`` share a
    panel.  A metric missing from some records is drawn where present."""
    def numeric(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    panels: dict[str, list[str]] = {}
    for r in records:
        for k, v in r.items():
            if k != x_key and numeric(v) and k not in panels.get(_panel_of(k), []):
                panels.setdefault(_panel_of(k), []).append(k)
    if not panels:
        raise ValueError("the run log has no numeric metrics to plot")
    first = ("loss", "top1", "top5", "lr")  # what a reader looks for first; bookkeeping (epoch, timing) last
    last = ("epoch", "elapsed_s", "img_per_s")
    order = sorted(panels, key=lambda p: (first.index(p) if p in first else len(first) + (p in last)))
    panels = {p: panels[p] for p in order}
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = _new_figure(figsize=(3.6 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = {"val": "#d1603d", "train": "#3b6fb6"}
    for ax, (panel, keys) in zip(axes.flat, panels.items()):
        for key in keys:
            pts = [(r.get(x_key, i), r[key]) for i, r in enumerate(records) if numeric(r.get(key))]
            xs, ys = zip(*pts)
            kind = "val" if key.startswith("val_") else "train"
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, lw=1.4, color=colors[kind],
                    label="validation" if kind == "val" else "training")
            if panel.endswith("loss") and min(ys) > 0 and max(ys) / min(ys) > 20:
                ax.set_yscale("log")
        if len(keys) > 1:
            ax.legend(fontsize=7, frameon=False)
        ax.set_title(panel if len(keys) > 1 else keys[0], fontsize=9)
        ax.set_xlabel(x_key, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- experiment tables


def plot_lines(lines: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
               xlabel: str, ylabel: str, title: str = "", logx: bool = False) -> Figure:
    """One line per name: ``lines[name] = (x, y, yerr)``, the mean ``y`` at each ``x`` with
    +- ``yerr`` bars (None: no bars); a legend when there is more than one line."""
    fig = _new_figure(figsize=(5, 3.5))
    ax = fig.subplots()
    for name, (x, y, err) in lines.items():
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=str(name))
    if logx:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log")
        # within a decade matplotlib labels every minor tick and they overlap: label 2x and 5x only
        ax.xaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_bars(labels: Sequence[str], values: Sequence[float], errors: Sequence[float] | None = None,
              ylabel: str = "", title: str = "") -> Figure:
    """One bar per label, +- ``errors`` when given."""
    fig = _new_figure(figsize=(max(4, 0.6 * len(labels) + 1), 3.5))
    ax = fig.subplots()
    ax.bar(range(len(labels)), values, yerr=errors, capsize=3)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_distance_by_layer(models: Mapping[str, tuple[Sequence[int], Sequence[float], Sequence[float],
                                                      Sequence[float], float | None]]) -> Figure:
    """Mean attention distance against depth, one colour per model (paper Fig. 11 in
    summary): ``models[name] = (layers, mean, lowest, highest, uniform)``, the heads' mean
    distance per layer as a line, their range as a band, and the distance a head attending
    to every patch alike would have (``uniform``; None: not drawn) as a dashed level."""
    fig = _new_figure(figsize=(5, 3.5))
    ax = fig.subplots()
    for (name, (layers, mean, lowest, highest, uniform)), marker in zip(models.items(), "os^vD*"):
        line, = ax.plot(layers, mean, marker=marker, label=f"{name} mean")
        ax.fill_between(layers, lowest, highest, alpha=0.2, color=line.get_color())
        if uniform:
            ax.axhline(uniform, color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"{name}: uniform attention")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
