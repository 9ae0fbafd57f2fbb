"""One self-contained HTML page about a model: its card, its training, and the paper's
inspection figures (Fig. 6, 7, 10, 11, 14) computed on a few images.

Everything is embedded: figures as base64 PNG, styles inline; the page makes no network
request and runs no script.  ``build_report`` returns the HTML; ``write_report`` writes it.

    write_report(model, images, "report.html", run_dir="runs/b16")   # images: uint8 (B, 3, H, W) or paths
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import safetensors
import torch
from PIL import Image
from torch import nn

from vitlab.analysis.cost import model_flops
from vitlab.config import Pair
from vitlab.data.memory import decode_image
from vitlab.data.transforms import resize, to_float
from vitlab.eval.features import check_loss, class_probabilities
from vitlab.files import atomic_write_text
from vitlab.weights.load import read_loss
from vitlab.modes import evaluating

from . import attention as att
from . import embeddings as emb
from . import plots  # matplotlib itself is imported where a figure is drawn: reading run metadata stays light

__all__ = ["read_run_log", "read_run_meta", "recorded_loss", "model_card", "build_report", "need_report_out", "write_report"]

Images = torch.Tensor | np.ndarray | Sequence[str | os.PathLike]

# ----------------------------------------------------------------------------- inputs


def read_run_log(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (one JSON object a line); unreadable lines are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log (the training loop writes metrics.jsonl in the run dir)")
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a half-written last line of a running job
        if isinstance(rec, dict):
            records.append(rec)
    return records


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# what a model folder's config.json holds, unlike a training run's: vitlab's "type", Hugging
# Face's "model_type" and "architectures", timm's "architecture"
MODEL_CONFIG_KEYS = {"type", "model_type", "architectures", "architecture"}


def read_run_meta(checkpoint: str | os.PathLike) -> dict:
    """What a checkpoint's training run left beside it, as a dict (empty if nothing).

    Keys, when found: ``recipe`` (the training config dict, ``config.json`` of the run),
    ``results`` (``summary.json``), ``classes`` (``classes.json``), ``metadata`` (extra
    safetensors metadata besides the model config), ``run_dir``, ``loss`` (the loss the weights
    record, ``vitlab.weights.read_loss``: a vitlab file's metadata, a Hugging Face ``problem_type``).
    """
    path = Path(checkpoint)
    meta: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".safetensors":
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                extra = {k: v for k, v in (f.metadata() or {}).items() if k != "vitlab_config"}
            for k, v in extra.items():
                try:
                    extra[k] = json.loads(v)
                except ValueError:
                    pass
            if extra:
                meta["metadata"] = extra
        except Exception:  # noqa: BLE001 - unreadable metadata only loses the card's extras
            pass
    run_dir = path if path.is_dir() else path.parent
    config = _read_json(run_dir / "config.json")
    if isinstance(config, dict) and not MODEL_CONFIG_KEYS & config.keys():
        meta["recipe"] = config
    for key, name in (("results", "summary.json"), ("classes", "classes.json")):
        value = _read_json(run_dir / name)
        if value is not None:
            meta[key] = value
    for key in ("recipe", "results", "classes"):
        if key not in meta and key in meta.get("metadata", {}):
            meta[key] = meta["metadata"][key]
    if (run_dir / "metrics.jsonl").is_file() or meta:
        meta["run_dir"] = str(run_dir)
    loss = read_loss(checkpoint)  # as the weights record it: converted ones have no run beside them
    if loss is not None:
        meta["loss"] = loss
    return meta


def recorded_loss(meta: Mapping[str, Any], default: str | None = "softmax_xent") -> str | None:
    """The loss a checkpoint's run trained with, ``read_run_meta``'s ``recipe``'s ``optim.loss``
    (either layout), else the one its weights record (``loss``: weights converted from such a run, a
    Hugging Face model's ``problem_type``): what the model's outputs are probabilities of,
    "sigmoid_xent" each class's own sigmoid, "softmax_xent" a softmax.  Weights that record none (a
    bare file, another library's) carry nothing that says, and their head's numbers cannot tell:
    ``default``."""
    recipe = meta.get("recipe")
    recipe = _dotted(recipe) if isinstance(recipe, Mapping) else {}
    loss = recipe.get("optim.loss", recipe.get("loss"))
    if loss is not None:
        check_loss(loss, f"{Path(meta.get('run_dir', '.')) / 'config.json'}: optim.loss")  # a file edited by hand
        return loss
    return meta.get("loss") or default


def _load_images(images: Images, size: Pair) -> torch.Tensor:
    """uint8 (B, 3, H, W) at ``size`` from a tensor/array or from image files.

    Each file is decoded at ``size`` as ``vitlab predict`` decodes it: resized first to the
    first file's size, an image after a small one was seen as that one's few pixels."""
    if isinstance(images, (torch.Tensor, np.ndarray)):
        x = torch.as_tensor(images)
        if x.ndim == 3:
            x = x[None]
        if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"expected uint8 images (B, 3, H, W), got {x.dtype} {tuple(x.shape)}")
        if len(x) == 0:  # as an empty list: the attention section said "need at least one array to stack"
            raise ValueError("no images given: the attention figures need at least one")
        return resize(x, size)
    decoded = [torch.from_numpy(decode_image(p, size)).permute(2, 0, 1) for p in images]
    if not decoded:
        raise ValueError("no images given: the attention figures need at least one")
    return torch.stack(decoded)


# ----------------------------------------------------------------------------- the model card


def model_card(model: nn.Module, meta: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """(label, value) rows describing the model: name, size, cost, architecture."""
    cfg = model.cfg
    rows = [("model", str(getattr(cfg, "name", None) or type(model).__name__))]
    if meta and meta.get("checkpoint"):
        rows.append(("checkpoint", str(meta["checkpoint"])))
    rows.append(("parameters", f"{sum(p.numel() for p in model.parameters()):,}"))
    try:
        rows.append(("forward GFLOPs / image", f"{model_flops(cfg) / 1e9:.3g}"))
    except Exception:  # noqa: BLE001 - the cost module is optional for the card
        rows.append(("forward GFLOPs / image", "n/a"))
    rows.append(("resolution", f"{cfg.img_size[0]}x{cfg.img_size[1]}"))
    if hasattr(cfg, "patch_size"):
        stem = (f"R{sum(cfg.resnet.layers) * 3 + 2}x{cfg.resnet.width_factor} stem (/{cfg.resnet.reduction}), "
                if cfg.resnet else "")
        rows += [
            ("patches", f"{stem}{cfg.patch_size[0]}x{cfg.patch_size[1]} -> grid {cfg.grid_size[0]}x{cfg.grid_size[1]}"),
            ("width / depth / heads / MLP", f"{cfg.width} / {cfg.depth} / {cfg.num_heads} / {cfg.mlp_dim}"),
            ("classifier", cfg.classifier
             + (f" + pre-logits {cfg.representation_size}" if cfg.representation_size else "")),
            ("position embedding", f"{cfg.posemb} ({cfg.posemb_place})"),
        ]
        if cfg.axial:
            rows.append(("blocks", "axial (row + column attention)"))
    rows.append(("classes", str(cfg.num_classes)))
    return rows


# ----------------------------------------------------------------------------- HTML pieces

CSS = """
:root { --ink:#1f2430; --muted:#5d6577; --line:#e3e6ee; --accent:#3b6fb6; --bg:#f5f6f9; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font: 15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { background:#1f2a44; color:#fff; padding:28px 0 22px; }
header .wrap h1 { margin:0 0 4px; font-size:26px; font-weight:600; letter-spacing:.2px; }
header .wrap p { margin:0; color:#c9d3ea; font-size:14px; }
.wrap { max-width:1100px; margin:0 auto; padding:0 24px; }
nav { margin-top:14px; display:flex; flex-wrap:wrap; gap:8px; }
nav a { color:#dfe7fb; text-decoration:none; font-size:13px; padding:3px 10px;
        border:1px solid #3e4c70; border-radius:999px; }
section.card { background:#fff; border:1px solid var(--line); border-radius:10px;
               margin:22px 0; padding:20px 24px; box-shadow:0 1px 2px rgba(20,30,60,.04); }
section.card h2 { margin:0 0 4px; font-size:19px; font-weight:600; }
section.card .paper { color:var(--accent); font-size:12.5px; font-weight:600; text-transform:uppercase;
                      letter-spacing:.6px; margin-bottom:12px; }
figure { margin:10px 0 0; text-align:center; }
figure img { max-width:100%; height:auto; border-radius:4px; }
figcaption { text-align:left; color:var(--muted); font-size:13.5px; margin-top:8px; max-width:900px; }
.cols { display:grid; grid-template-columns: 1fr 1fr; gap:22px; }
@media (max-width: 900px) { .cols { grid-template-columns: 1fr; } }
table.kv { border-collapse:collapse; width:100%; font-size:14px; }
table.kv td { padding:5px 10px; border-bottom:1px solid var(--line); vertical-align:top; }
table.kv td:first-child { color:var(--muted); width:38%; white-space:nowrap; }
.note { background:#fff8e6; border:1px solid #f0dca8; color:#6b5418; padding:10px 14px;
        border-radius:6px; font-size:13.5px; }
.preds { display:flex; flex-wrap:wrap; gap:14px; }
.pred { border:1px solid var(--line); border-radius:8px; padding:8px; width:176px; font-size:12.5px; }
.pred img { width:160px; height:160px; object-fit:contain; image-rendering:pixelated; background:#eee; }
.bar { height:6px; background:var(--accent); border-radius:3px; margin:1px 0 4px; }
footer { color:var(--muted); font-size:12.5px; text-align:center; padding:10px 0 30px; }
details summary { cursor:pointer; color:var(--accent); font-size:13px; margin:6px 0; }
code { background:#eef1f7; padding:1px 5px; border-radius:4px; font-size:12.5px; }
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _png_tag(png: bytes, alt: str, width: int | None = None) -> str:
    style = f' style="width:{width}px"' if width else ""
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}"{style}>'


def _figure(fig, alt: str, caption: str, width: int | None = None) -> str:
    return f"<figure>{_png_tag(plots.figure_png(fig), alt, width)}<figcaption>{caption}</figcaption></figure>"


def _card(anchor: str, title: str, paper: str, body: str) -> str:
    tag = f'<div class="paper">{_esc(paper)}</div>' if paper else ""
    return f'<section class="card" id="{anchor}"><h2>{_esc(title)}</h2>{tag}{body}</section>'


def _kv_table(rows: Sequence[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) if len(v) <= 12 else f"{len(v)} items"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items()) or "{}"
    return str(v)


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


def _image_png(image: torch.Tensor, size: int = 160) -> bytes:
    arr = image.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr)
    scale = max(1, size // max(arr.shape[:2]))
    if scale > 1:
        img = img.resize((arr.shape[1] * scale, arr.shape[0] * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- sections


# the fields of a training recipe worth a first look (vitlab.train.config.TrainConfig's names)
RECIPE_KEYS = ("recipe", "model.name", "model.overrides", "model.init", "data.source", "model.img_size",
               "data.val_split", "optim.optimizer", "optim.lr", "optim.weight_decay", "optim.batch_size",
               "optim.steps", "optim.warmup", "optim.decay", "optim.clip_norm", "augment.label_smoothing",
               "augment.mixup_alpha", "augment.randaug_ops", "optim.ema_decay", "run.precision", "run.seed")


def _dotted(config: Mapping[str, Any]) -> dict[str, Any]:
    """A training config.json's sections flattened to "section.field" keys (a flat, older one as it is)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and key in ("model", "data", "augment", "optim", "run"):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _section_card(model: nn.Module, meta: Mapping[str, Any]) -> str:
    parts = [f'<div class="cols"><div><h3>Model</h3>{_kv_table(model_card(model, meta))}</div>']
    right = []
    results = meta.get("results")
    if isinstance(results, dict):
        keep = [(k, _fmt(v)) for k, v in results.items()
                if isinstance(v, (int, float, str, dict)) and k not in ("weights", "classes", "curves")]
        right.append(f"<h3>Results</h3>{_kv_table(keep)}")
    recipe = meta.get("recipe")
    recipe = _dotted(recipe) if isinstance(recipe, Mapping) else recipe
    if isinstance(recipe, dict):
        main = [(k, _fmt(recipe[k])) for k in RECIPE_KEYS if k in recipe and recipe[k] not in (None, "", [], {})]
        others = [(k, _fmt(v)) for k, v in recipe.items() if k not in RECIPE_KEYS]
        more = (f"<details><summary>all {len(recipe)} fields</summary>{_kv_table(others)}</details>"
                if others else "")
        right.append(f"<h3>Training recipe</h3>{_kv_table(main or others)}{more if main else ''}")
    if not right:
        right.append("<h3>Training</h3>" + _note("The checkpoint carries no training recipe or results "
                                                  "(no <code>config.json</code>/<code>summary.json</code> beside it)."))
    parts.append(f"<div>{''.join(right)}</div></div>")
    return _card("card", "Model card", "", "".join(parts))


def _section_curves(run_dir: str | os.PathLike | None) -> str:
    if run_dir is None:
        return ""
    try:
        records = read_run_log(run_dir)
        fig = plots.plot_training_curves(records)
    except (FileNotFoundError, ValueError) as err:
        return _card("curves", "Training curves", "", _note(_esc(err)))
    caption = (f"Every numeric quantity logged in <code>{_esc(Path(run_dir) / 'metrics.jsonl')}</code> "
               f"({len(records)} records) against the optimiser step: training loss, learning rate "
               "schedule and validation metrics where the run evaluated.")
    return _card("curves", "Training curves", "", _figure(fig, "training curves", caption))


def _head_is_untrained(model: nn.Module) -> bool:
    """Every head starts at zero (paper Sec. 3.2, BiT): one still all zeros was never trained, as after
    masked-patch-prediction pre-training, and gives every class 1/K whatever the image."""
    head = getattr(model, "head", None)
    params = list(head.parameters()) if isinstance(head, nn.Module) else []
    return bool(params) and all(not p.detach().any() for p in params)


def _section_predictions(model: nn.Module, x: torch.Tensor, images: torch.Tensor, classes: Sequence[str] | None,
                         loss: str) -> str:
    # the images are shown in any case: the figures below refer to them
    why_none = ("the model has no classification head (num_classes 0)" if not model.cfg.num_classes else
                f"its classification head ({model.cfg.num_classes} classes) is all zeros, never trained (as after "
                "masked-patch-prediction pre-training, which trains a head of its own); fine-tune it "
                "(<code>vitlab finetune</code>) for a classifier" if _head_is_untrained(model) else None)
    probs = None
    if why_none is None:
        with torch.inference_mode():
            probs = class_probabilities(model(x).float(), loss=loss).cpu().numpy()  # as the run trained them
    items = []
    for b in range(len(x)):
        top = [] if probs is None else np.argsort(-probs[b])[:min(3, probs.shape[1])]
        lines = "".join(
            f"<div>{_esc(classes[c] if classes and c < len(classes) else f'class {c}')} "
            f"<span style='float:right'>{100 * probs[b, c]:.1f}%</span></div>"
            f"<div class='bar' style='width:{max(2, 100 * probs[b, c]):.0f}%'></div>" for c in top)
        items.append(f"<div class='pred'>{_png_tag(_image_png(images[b]), f'image {b + 1}')}"
                     f"<div><b>image {b + 1}</b></div>{lines}</div>")
    kind = ("per-class sigmoid probabilities, as the run trained them: each class's own, they need not sum to 1"
            if loss == "sigmoid_xent" else "softmax probabilities")
    said = (f" with its top predictions ({kind})." if why_none is None
            else f". No predictions: {why_none}.")
    return _card("predictions", "Inputs and predictions", "",
                 f"<div class='preds'>{''.join(items)}</div>"
                 "<figcaption>The images analysed below, as the model sees them (resized to its input "
                 f"resolution){said}</figcaption>")


def _attention_arrays(model: nn.Module, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One forward per image, each layer reduced as it runs (attention of big models is
    large): rollout maps (B, gh, gw), mean attention distance (layers, heads) over the
    images, and the raw attention of the output token of image 1 per layer and head
    (layers, heads, gh, gw)."""
    grid = tuple(model.patch_grid(tuple(x.shape[-2:])))
    prefix, patch = model.cfg.num_prefix_tokens, att.effective_patch_size(model)
    rollout, distance, heads = [], 0.0, None
    for b in range(len(x)):
        product = None

        def reduce(index: int, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            nonlocal product
            if product is None:
                product = np.broadcast_to(np.eye(layer.shape[-1]), layer.shape[:1] + layer.shape[2:]).copy()
            att.rollout_layer(product, layer)
            # a copy: a view would keep the layer's maps alive
            first = att.token_to_grid(layer[0], grid, prefix).copy() if b == 0 else None  # (heads, gh, gw)
            return att.layer_attention_distance(layer, grid, patch, prefix)[0], first

        per_layer = att.reduce_attention(model, x[b:b + 1], reduce)
        rollout.append(att.token_to_grid(product, grid, prefix)[0])
        distance = distance + np.stack([d for d, _ in per_layer]) / len(x)
        if heads is None:
            heads = np.stack([h for _, h in per_layer])
    return np.stack(rollout), distance, heads


def _section_rollout(model: nn.Module, maps: np.ndarray, images: torch.Tensor) -> str:
    up = att.upsample_maps(maps, tuple(images.shape[-2:]))
    out_tok = "[class] token" if model.cfg.num_prefix_tokens else "average of the patch tokens (GAP)"
    caption = ("Attention rollout (Abnar &amp; Zuidema, 2020): in every layer the heads' attention "
               "is averaged, the identity added for the residual connection and rows renormalised; the "
               "layers' matrices are multiplied. Shown is how much the output token "
               f"({out_tok}) draws from each input patch, upsampled to the image; the middle "
               "row multiplies the image by this map, as the paper's Figure 6 does.")
    return _card("rollout", "Attention rollout: where the output looks", "Paper Figures 6 and 14",
                 _figure(plots.plot_attention_overlay(images.numpy(), up), "attention rollout", caption))


def _section_heads(maps: np.ndarray, images: torch.Tensor) -> str:
    caption = ("Raw attention of every layer (rows) and head (columns) for image 1: the attention "
               "weights from the output token to each patch, before any rollout, each cell scaled "
               "to its own maximum: which parts of the image single heads read, layer by layer.")
    return _card("heads", "Raw attention per layer and head", "Inspection of single heads",
                 _figure(plots.plot_attention_heads(images[0].numpy(), maps), "attention per head", caption))


def _section_distance(model: nn.Module, distance: np.ndarray, num_images: int) -> str:
    patch = att.effective_patch_size(model)
    caption = (f"For every head: the mean distance in pixels between a query patch and the patches it "
               f"attends to, weighted by the attention (patch tokens only, patch centres "
               f"{patch[0]}x{patch[1]} px apart), averaged over the {num_images} image(s). The paper finds "
               "some heads attending globally already in the lowest layers, others locally, and the "
               "distance growing with depth.")
    return _card("distance", "Mean attention distance", "Paper Figure 7 (right) and Figure 11",
                 _figure(plots.plot_attention_distance(distance, model.cfg.img_size), "attention distance",
                         caption, width=520))


def _section_embeddings(model: nn.Module) -> str:
    cells = []
    try:
        comps, explained = emb.patch_embedding_pca(model, 28)
        fig = plots.plot_filter_components(comps, explained)
        cells.append(_figure(fig, "embedding filters", (
            "The top principal components of the learned linear patch embedding (its D filters, each "
            f"{comps.shape[1]}x{comps.shape[2]}x{comps.shape[3]}, as vectors), each tile scaled to [0, 1], "
            "with the share of variance explained. The paper's components resemble plausible basis "
            "functions for a low-dimensional representation of each patch.")))
    except ValueError as err:
        cells.append(_note(f"Embedding filters: {_esc(err)}"))
    # with a table per block (posemb_place every_layer) the figure is of the first block's, and says so
    which = (f"<code>{_esc(model.cfg.posemb)}</code>, the first of the {model.cfg.depth} blocks' tables"
             if model.cfg.posemb_place == "every_layer" else f"<code>{_esc(model.cfg.posemb)}</code>")
    try:
        fig = plots.plot_position_similarity(emb.position_similarity(model))
        cells.append(_figure(fig, "position embedding similarity", (
            "Cosine similarity between the position embedding of the patch at each row and column "
            f"(the small tile at that place) and the embeddings of all other patches "
            f"({which}). In the paper's models close patches have "
            "similar embeddings and a row/column structure appears: a 1D table learns the 2D "
            "topology of the image.")))
    except ValueError as err:
        cells.append(_note(f"Position embeddings: {_esc(err)}"))
    return _card("embeddings", "What the embeddings learned", "Paper Figure 7 (left, centre) and Figure 10",
                 f"<div class='cols'>{''.join(f'<div>{c}</div>' for c in cells)}</div>")


def _guarded(fn: Callable[[], str], anchor: str, title: str) -> str:
    """Sections that a model kind does not support say so instead of failing the report."""
    try:
        return fn()
    except ValueError as err:
        return _card(anchor, title, "", _note(_esc(err)))


# ----------------------------------------------------------------------------- the page


# the footer of every page build_report writes: what need_report_out knows an earlier report by
SIGNATURE = "Written by vitlab on"


def build_report(model: nn.Module, images: Images, run_dir: str | os.PathLike | None = None,
                 meta: Mapping[str, Any] | None = None, title: str | None = None) -> str:
    """The HTML page (a string) for ``model`` and ``images`` (uint8 (B, 3, H, W) or image paths)."""
    meta = dict(meta or {})
    classes = meta.get("classes") if isinstance(meta.get("classes"), list) else None
    if classes is not None and model.cfg.num_classes and len(classes) != model.cfg.num_classes:
        # names of other classes (a classes.json of another run beside the weights) labelled these outputs
        raise ValueError(f"meta['classes']: {len(classes)} class names for a model of {model.cfg.num_classes} "
                         "classes; expected one name per class")
    if run_dir is None and meta.get("run_dir") and (Path(meta["run_dir"]) / "metrics.jsonl").is_file():
        run_dir = meta["run_dir"]
    size = tuple(model.cfg.img_size)
    shown = _load_images(images, size)  # uint8 (B, 3, H, W) at the model's resolution
    # on the model's device and in its dtype: float32 on the CPU was refused by a bf16 or a CUDA
    # model, and the page held that refusal in place of every figure
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    x = to_float(shown.clone())
    x = x if weight is None else x.to(weight.device, weight.dtype)
    name = getattr(model.cfg, "name", None) or type(model).__name__
    is_vit = hasattr(model.cfg, "patch_size")
    # inspected in eval mode (no dropout); given back in the modes it came in, as the evaluators do:
    # a model inspected between training steps goes on training, its frozen parts still frozen
    with evaluating(model):
        sections = [_section_card(model, meta), _section_curves(run_dir)]
        sections.append(_guarded(lambda: _section_predictions(model, x, shown, classes, recorded_loss(meta)),
                                 "predictions",
                                 "Predictions"))
        if is_vit:
            try:
                rollout, distance, heads = _attention_arrays(model, x)
                sections += [_section_rollout(model, rollout, shown), _section_distance(model, distance, len(x)),
                             _section_heads(heads, shown)]
            except ValueError as err:  # e.g. Axial-ViT: no attention over the whole grid
                sections.append(_card("rollout", "Attention", "", _note(_esc(err))))
            sections.append(_guarded(lambda: _section_embeddings(model), "embeddings", "Embeddings"))
        else:
            sections.append(_card("vit", "Inspection", "", _note("This is not a Vision Transformer: "
                                                              "the attention and embedding figures do not apply.")))
    links = [("card", "Model card"), ("curves", "Training"), ("predictions", "Predictions"),
             ("rollout", "Rollout"), ("distance", "Attention distance"), ("heads", "Heads"),
             ("embeddings", "Embeddings")]
    body = "".join(sections)
    nav = "".join(f'<a href="#{a}">{_esc(t)}</a>' for a, t in links if f'id="{a}"' in body)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heading = title or f"{name}: inspection report"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_esc(heading)}</title><style>{CSS}</style></head>
<body><header><div class="wrap"><h1>{_esc(heading)}</h1>
<p>Vision Transformer inspection after Dosovitskiy et al., <i>An Image is Worth 16x16 Words</i>
(ICLR 2021), on {len(shown)} image(s) at {size[0]}x{size[1]} px.</p><nav>{nav}</nav></div></header>
<main class="wrap">{body}</main>
<footer>{SIGNATURE} {stamp}. Self-contained: every figure is embedded in this file.</footer>
</body></html>
"""


def need_report_out(out_path: str | os.PathLike, name: str = "out_path") -> None:
    """That writing the report at ``out_path`` loses nothing: no file there, or an earlier report
    (an HTML page that ends in the report's footer, which a second run replaces).  Anything else is
    refused, naming ``name``: the page was written over one of the images, the weights, an HTML page
    of one's own or any other file named by mistake.  A pipe, a device or a link (/dev/null,
    /dev/stdout) is written into, not replaced."""
    path = Path(out_path)
    if path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a folder; expected a file to write")
    if not path.is_file():
        return
    with open(path, "rb") as f:
        head = f.read(64).lstrip(b"\xef\xbb\xbf \t\r\n").lower()
        f.seek(max(0, path.stat().st_size - 1024))
        tail = f.read()
    report = head.startswith((b"<!doctype html", b"<html")) and SIGNATURE.encode() in tail
    if head and not report:  # an empty file holds nothing to lose
        raise ValueError(f"{name}={str(path)!r} is a file that is not an earlier report (a page vitlab inspect "
                         "wrote); the report replaces nothing else: name another file")


def write_report(model: nn.Module, images: Images, out_path: str | os.PathLike,
                 run_dir: str | os.PathLike | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    """Write ``build_report``'s page to ``out_path`` (parent folders created); returns the path.
    A file already there is replaced only if it is an earlier report (``need_report_out``)."""
    need_report_out(out_path)
    out = Path(out_path)
    page = build_report(model, images, run_dir=run_dir, meta=meta)
    # a pipe, a device or a link (/dev/null, /dev/stdout): renamed over, it was replaced by a file
    if out.is_symlink() or (out.exists() and not out.is_file()):
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
        return out
    # a full disk, Ctrl-C: the earlier page stays, and no half-written one beside it
    return atomic_write_text(out, page)
