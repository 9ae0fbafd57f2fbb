"""Model configurations as frozen dataclasses.

Every model vitlab builds is described completely by one of these objects, so a
config can be saved as JSON next to the weights and the model rebuilt from it
without pickle.  Field names are the paper's words (`width`, `depth`, `mlp_dim`,
`num_heads`, `patch_size`, `classifier`, `posemb`).

Validation happens in ``__post_init__`` so that an impossible configuration is
refused before any work starts, with a message naming the field, the value and
what is allowed.  The ``need*`` helpers are the one set of checks every config of
vitlab uses (these, the training config's sections, the augmentation).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

Pair = tuple[int, int]

# The arithmetic a run or an evaluation computes in: fp32, or bf16 / fp16 autocast.  Training's
# ``run.precision`` also takes "auto", which a run resolves to one of these when it is built.
PRECISIONS = ("fp32", "bf16", "fp16")

# A run's ``optim.loss``, and so what its outputs' probabilities are: a softmax over the classes, or each
# class's own sigmoid.  Training, evaluation and the weights' records all take these.
LOSSES = ("softmax_xent", "sigmoid_xent")


def check_loss(loss, name: str = "loss", error: type[ValueError] = ValueError) -> str:
    """``loss`` where it is one of ``LOSSES``, else ``error`` (a ValueError) naming ``name``."""
    if loss not in LOSSES:
        raise error(f"{name}={loss!r}: allowed values are {', '.join(map(repr, LOSSES))}")
    return loss


class ConfigError(ValueError):
    """A configuration field holds a value that cannot work."""


# ----------------------------------------------------------------------------- validation helpers


def need(ok: bool, name: str, value: Any, allowed: str) -> None:
    """The one way a value is refused: ``ConfigError("name=value: what is allowed")``."""
    if not ok:
        raise ConfigError(f"{name}={value!r}: {allowed}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_shift(value: Any, limit: int | None = None) -> bool:
    """Test-time translations: an integer >= 0 (0: none), or distinct integers > 0 (several
    sizes); each below ``limit`` when given (reflection fills at most size - 1 pixels)."""
    sizes = value if isinstance(value, (tuple, list)) else (value,)
    lowest = 1 if isinstance(value, (tuple, list)) else 0
    return (len(sizes) > 0 and all(is_int(s) and lowest <= s and (limit is None or s < limit) for s in sizes)
            and len(set(sizes)) == len(sizes))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def need_bool(name: str, value: Any) -> None:
    need(isinstance(value, bool), name, value, "must be True or False")  # a config file's "no" is truthy


def need_choice(name: str, value: Any, allowed: tuple) -> None:
    need(value in allowed, name, value, f"allowed values are {', '.join(map(repr, allowed))}")


def need_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    need(is_int(value) and value >= minimum, name, value,
         "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}")
    need(maximum is None or value <= maximum, name, value, f"must be at most {maximum}")


def need_number(name: str, value: Any, minimum: float = 0.0, below: float | None = None) -> None:
    """A finite number >= ``minimum`` (and < ``below``)."""
    if below is None:
        need(is_number(value) and value >= minimum, name, value, f"must be a number >= {minimum:g}")
    else:
        need(is_number(value) and minimum <= value < below, name, value,
             f"must be a number in [{minimum:g}, {below:g})")


def need_count_or_fraction(name: str, value: Any, allowed: str) -> None:
    """A count (an integer >= 1) or a fraction in [0, 1)."""
    need(is_number(value) and value >= 0 and (value < 1 or float(value).is_integer()), name, value, allowed)


def need_output_folder(name: str, path: str | os.PathLike) -> None:
    """That ``path`` can be a folder to write into: the nearest part of it that exists is a folder
    (not a file), and something can be made in it.  Checked before any work: an unwritable place
    failed only at the first write, with the OS's bare error naming neither the setting nor the
    work lost."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={str(path)!r} is a file; expected a folder (a new one, or a run's)")
    _need_writable_under(name, path, path, "a folder (a new one, or a run's)")


def need_output_file(name: str, path: str | os.PathLike) -> None:
    """That ``path`` can be a file to write: not a folder, and in a folder something can be made in."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{name}={str(path)!r} is a folder; expected a file to write")
    _need_writable_under(name, path, path.parent, "a file in a folder")


def _need_writable_under(name: str, path: Path, start: Path, expected: str) -> None:
    """The nearest existing part of ``start`` (``path`` or its folder) is a folder one can write in."""
    for part in (start, *start.parents):
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"{name}={str(path)!r} lies under {str(part)!r}, a file; expected {expected}")
            try:  # the one sure test of writing there (permissions, a read-only or virtual file system)
                os.rmdir(tempfile.mkdtemp(prefix=".vitlab-check-", dir=part))
            except OSError as err:
                raise ConfigError(f"{name}={str(path)!r}: nothing can be written in {str(part)!r} "
                                  f"({err.strerror}); expected a writable folder") from None
            return


# What every command's --img-size and --set model.img_size take, in the words of their refusals
SIZE_FORMS = "a positive size N or HxW, e.g. 384 or 384x512"


def parse_size(text: str) -> int | Pair | None:
    """A size in pixels written as text: "N" -> N (square); "HxW", "H,W" or "(H, W)" -> (H, W);
    None when it is none of these (the caller names the setting and ``SIZE_FORMS``)."""
    parts = [part.strip() for part in text.strip().lower().strip("()[]").replace(",", "x").split("x")]
    if len(parts) in (1, 2) and all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    return None


def to_pair(value: Any, name: str) -> Pair:
    """Accept ``16`` or ``(16, 16)`` (or a list) and return a pair of positive ints."""
    if is_int(value):
        pair = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value):
        pair = (int(value[0]), int(value[1]))
    else:
        raise ConfigError(f"{name}={value!r}: expected an int or a pair of ints (height, width)")
    if pair[0] <= 0 or pair[1] <= 0:
        raise ConfigError(f"{name}={value!r}: sizes must be positive")
    if max(pair) > MAX_SIDE:
        raise ConfigError(f"{name}={value!r}: sizes must be at most {MAX_SIDE}")
    return pair


# Upper bounds that no real model comes near (ViT-22B: width 6144, depth 48, mlp_dim
# 24576), so that a config file naming an absurd size is refused before any allocation.
MAX_SIDE = 16384          # img_size, patch_size (pixels per side)
MAX_WIDTH = 65536         # width, representation_size, in_chans
MAX_MLP_DIM = 4 * 65536
MAX_DEPTH = 1024
MAX_CLASSES = 1 << 24
MAX_PARAMETERS = 10**11   # about 400 GB of float32: 4.5x ViT-22B
MAX_PATCHES = 1 << 20     # tokens of one image


def _need_width_factor(value: Any) -> None:
    """A positive int, or a float such as 0.5 whose root width int(64 * value) GroupNorm(32) can split.

    vit_jax builds its root with ``int(64 * width_factor)`` channels for any width factor;
    every stage is then a power-of-two multiple of the root.
    """
    need(is_number(value) and value > 0, "width_factor", value,
         "must be a positive number (root width int(64 * width_factor))")
    need(value <= 64, "width_factor", value, "must be at most 64")
    need(is_int(value) or (int(64 * value) > 0 and int(64 * value) % 32 == 0), "width_factor", value,
         f"the root width int(64 * width_factor) = {int(64 * value)} must be a positive multiple of 32 "
         "(GroupNorm with 32 groups)")


def _need_classes(value: Any) -> None:
    need(is_int(value) and value >= 0, "num_classes", value, "must be an integer >= 0 (0 means no head)")
    need(value <= MAX_CLASSES, "num_classes", value, f"must be at most {MAX_CLASSES}")


@dataclass(frozen=True)
class ResNetConfig:
    """A BiT ResNet (GroupNorm + weight-standardised convolutions), Kolesnikov et al. 2020.

    Used on its own as the paper's baseline classifier, and as the stem of the hybrid
    models, where ``num_classes`` is ignored and only the feature map is used.

    layers:       bottleneck units per stage, e.g. (3, 4, 6, 3) for R50; (3, 4, 9) is the
                  hybrid's "stage 4 removed, its blocks moved to stage 3" (paper Sec. 4.1);
                  () is the root alone (vit_jax's R+ViT-Ti_16 stem).
    width_factor: channel multiplier ("x1", "x2", ...); root width is int(64 * width_factor),
                  as vit_jax computes it, so 0.5 (a 32-channel root) is allowed too.
    padding:      "same" reproduces TensorFlow/Flax SAME padding (asymmetric for even sizes)
                  as the official checkpoints were trained with; "symmetric" is PyTorch's.
    ws_eps:       epsilon of weight standardisation; vit_jax adds it to the std: (w - mean) / (std + eps).
    ws_eps_inside_sqrt: True standardises as (w - mean) / sqrt(var + ws_eps), BiT's own form
                  (big_transfer bit_pytorch, eps 1e-10); False is vit_jax's form (hybrid stem).
    gn_eps:       epsilon of GroupNorm (32 groups); 1e-6 is flax.linen.GroupNorm's default,
                  used by vit_jax; BiT's PyTorch code uses torch's 1e-5.
    norm:         "group": GroupNorm(32) after weight-standardised convolutions, BiT's and
                  the paper's.  "batch": BatchNorm after plain convolutions, an ablation
                  (not in the paper) that trains a small stem faster on a short budget.
    root_kernel, root_stride, root_pool: the root, BiT's 7x7/2 conv + 3x3/2 max-pool by
                  default (every official checkpoint).  Small images want a gentler root:
                  3, 1 and True keep 32x32 CIFAR images at 16x16 after the root instead of 8x8.
    """

    layers: tuple[int, ...] = (3, 4, 6, 3)
    width_factor: int | float = 1
    in_chans: int = 3
    num_classes: int = 1000
    img_size: Pair = (224, 224)
    padding: str = "same"
    ws_eps: float = 1e-5
    ws_eps_inside_sqrt: bool = False
    gn_eps: float = 1e-6
    norm: str = "group"
    root_kernel: int = 7
    root_stride: int = 2
    root_pool: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        # () is the root alone, no stages: vit_jax's R+ViT-Ti_16 / AugReg R_Ti_16 hybrid stem
        need(len(layers) <= 4 and all(is_int(n) and 0 < n <= MAX_DEPTH for n in layers), "layers", self.layers,
             f"expected 0 to 4 unit counts per stage, each in 1..{MAX_DEPTH}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "img_size", to_pair(self.img_size, "img_size"))
        _need_width_factor(self.width_factor)
        need_int("in_chans", self.in_chans, 1, MAX_WIDTH)
        _need_classes(self.num_classes)
        need_number("ws_eps", self.ws_eps, 0.0, below=1.0)
        need_number("gn_eps", self.gn_eps, 0.0, below=1.0)
        need_bool("ws_eps_inside_sqrt", self.ws_eps_inside_sqrt)
        need(self.name is None or isinstance(self.name, str), "name", self.name, "must be a string or None")
        need_choice("padding", self.padding, ("same", "symmetric"))
        need_choice("norm", self.norm, ("group", "batch"))
        need_int("root_kernel", self.root_kernel, 1)
        need(self.root_kernel % 2 == 1, "root_kernel", self.root_kernel,
             "must be odd (the root keeps ceil(size / stride) positions)")
        need_choice("root_stride", self.root_stride, (1, 2))
        need_bool("root_pool", self.root_pool)

    @property
    def root_width(self) -> int:
        """Channels of the root conv: ``int(64 * width_factor)``, as vit_jax computes it."""
        return int(64 * self.width_factor)

    @property
    def out_channels(self) -> int:
        """Channels of the last stage's output (bottleneck expansion 4); the root's without stages."""
        if not self.layers:
            return self.root_width
        return self.root_width * 4 * 2 ** (len(self.layers) - 1)

    @property
    def reduction(self) -> int:
        """Total downsampling: the root conv's stride, the max-pool's 2, then /2 per later stage."""
        return self.root_stride * (2 if self.root_pool else 1) * 2 ** max(len(self.layers) - 1, 0)


POSEMB_KINDS = ("none", "learned_1d", "learned_2d", "relative")
POSEMB_PLACES = ("stem", "every_layer", "every_layer_shared")
ATTN_BIASES = ("none", "distance", "distance_no_self")
CLASSIFIERS = ("token", "gap")
GELU_KINDS = ("tanh", "exact")
RESAMPLE_MODES = ("bilinear", "bicubic")


@dataclass(frozen=True)
class ViTConfig:
    """A Vision Transformer, optionally with a ResNet stem (hybrid) or axial blocks.

    img_size, patch_size: (height, width); an int means square.  For a hybrid the patch
        size applies to the ResNet feature map (the paper uses 1x1).
    classifier: "token" reads the [class] token, "gap" averages the patch tokens
        (paper Appendix D.3).
    representation_size: width of the pre-logits layer (dense + tanh) used in
        pre-training; None means the head reads the encoder output directly (fine-tuning).
    posemb: "none", "learned_1d" (default), "learned_2d" (X and Y tables of width D/2,
        concatenated) or "relative" (1D relative attention bias); paper Appendix D.4.
    posemb_place: "stem" adds the embedding once after the patch embedding;
        "every_layer" adds a separate embedding before each block; "every_layer_shared"
        adds one embedding before each block.  Relative embeddings live inside every
        attention layer and only accept "stem" (the paper's "default" column).
    attn_bias: "distance" adds a learned 2D locality prior to every attention layer: each
        head's logits get -slope x the distance between the two patches on the grid, its
        slope learned (``posemb.DistanceBias``); "distance_no_self" also keeps each patch from
        attending to itself (the diagonal masking of Lee et al. 2021's locality self-attention:
        the residual already carries a token's own value).  Not in the paper; "none" (default).
    attn_offsets: with a distance penalty, each head also adds a learned value for every 2D
        offset (dy, dx) between two patches, starting at zero (Swin's relative position bias,
        Liu et al. 2021): the penalty is the same in every direction, the offsets let a head
        prefer one.  Offsets beyond the model's grid (a larger input) take the table's edge.
    posemb_resample: how the patch grid of position embeddings is resized to a new
        grid: "bilinear" with aligned corners is what the official code does
        (scipy.ndimage.zoom, order 1); "bicubic" is what Hugging Face does on the fly.
    dynamic_img_size: if True, inputs of any size divisible by the patch size are accepted
        and the position embeddings are resampled on the fly in forward.
    gelu, ln_eps: numerical conventions of the source of the weights: the official Flax
        code uses the tanh approximation of GELU and eps 1e-6; timm uses exact GELU and
        eps 1e-6; Hugging Face exact GELU and eps 1e-12.
    dropout: after every dense layer except qkv, and after adding position embeddings.
    attention_dropout: on the attention probabilities.
    drop_path: stochastic depth rate, increasing linearly over depth to this value
        (not in the paper; off by default).
    patch_dropout: fraction of patch tokens removed at random from each training image
        after the position embeddings are added (PatchDropout, Liu et al. 2022; FLIP):
        the encoder then runs on fewer tokens, so training is faster by about that
        fraction; evaluation always sees every patch.  With ``attn_bias`` the kept patches
        keep their places' bias.  Not in the paper; off by default.
    axial: Axial-ViT (paper Appendix D.6): each block is row attention + MLP, then
        column attention + MLP.  Needs the "gap" classifier (a [class] token has no row
        or column) and position embeddings added at the stem ("none", "learned_1d" or
        "learned_2d"); the registered ``Axial-ViT-B/{16,32}`` use "learned_1d", the
        ViT's learned table of one embedding per patch.
    """

    img_size: Pair = (224, 224)
    patch_size: Pair = (16, 16)
    in_chans: int = 3
    width: int = 768
    depth: int = 12
    mlp_dim: int = 3072
    num_heads: int = 12
    num_classes: int = 1000
    classifier: str = "token"
    representation_size: int | None = None
    posemb: str = "learned_1d"
    posemb_place: str = "stem"
    posemb_resample: str = "bilinear"
    attn_bias: str = "none"
    attn_offsets: bool = False
    dynamic_img_size: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path: float = 0.0
    patch_dropout: float = 0.0
    gelu: str = "tanh"
    ln_eps: float = 1e-6
    qkv_bias: bool = True
    resnet: ResNetConfig | None = None
    axial: bool = False
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", to_pair(self.img_size, "img_size"))
        object.__setattr__(self, "patch_size", to_pair(self.patch_size, "patch_size"))
        if isinstance(self.resnet, dict):
            object.__setattr__(self, "resnet", _resnet_from_dict(self.resnet))
        need(self.resnet is None or isinstance(self.resnet, ResNetConfig), "resnet", self.resnet,
             "must be a ResNetConfig, a dict of its fields, or None")
        limits = {"in_chans": MAX_WIDTH, "width": MAX_WIDTH, "depth": MAX_DEPTH, "mlp_dim": MAX_MLP_DIM,
                  "num_heads": MAX_WIDTH}
        for name, limit in limits.items():
            need_int(name, getattr(self, name), 1, limit)
        _need_classes(self.num_classes)
        need_number("ln_eps", self.ln_eps, 0.0, below=1.0)
        for name in ("dynamic_img_size", "qkv_bias", "axial", "attn_offsets"):
            need_bool(name, getattr(self, name))
        need(self.name is None or isinstance(self.name, str), "name", self.name, "must be a string or None")
        # the stem reads the images: a hybrid whose stem takes another channel count failed in its first convolution
        need(self.resnet is None or self.resnet.in_chans == self.in_chans, "resnet.in_chans",
             getattr(self.resnet, "in_chans", None), f"the hybrid's stem reads the images: must equal in_chans="
             f"{self.in_chans}")
        if self.width % self.num_heads:
            near = sorted((d for d in range(1, min(self.width, 4 * self.num_heads) + 1) if self.width % d == 0),
                          key=lambda d: (abs(d - self.num_heads), d))[:2]
            raise ConfigError(
                f"width={self.width} is not divisible by num_heads={self.num_heads}: each head needs width/num_heads "
                f"channels; num_heads must divide {self.width} (nearest: {', '.join(map(str, sorted(near)))})"
            )
        need_choice("classifier", self.classifier, CLASSIFIERS)
        need_choice("posemb", self.posemb, POSEMB_KINDS)
        need_choice("posemb_place", self.posemb_place, POSEMB_PLACES)
        need_choice("posemb_resample", self.posemb_resample, RESAMPLE_MODES)
        need_choice("attn_bias", self.attn_bias, ATTN_BIASES)
        need_choice("gelu", self.gelu, GELU_KINDS)
        for name in ("dropout", "attention_dropout", "drop_path", "patch_dropout"):
            need(is_number(getattr(self, name)) and 0 <= getattr(self, name) < 1, name, getattr(self, name),
                 "must be a probability in [0, 1)")
        if self.representation_size is not None:
            need_int("representation_size", self.representation_size, 1, MAX_WIDTH)
        if self.posemb == "relative" and self.posemb_place != "stem":
            raise ConfigError(
                f"posemb_place={self.posemb_place!r} with posemb='relative': relative embeddings are a bias "
                "inside every attention layer; only the default 'stem' setting exists (paper Table 8)"
            )
        if self.attn_bias != "none" and (self.posemb == "relative" or self.axial):
            raise ConfigError(
                f"attn_bias={self.attn_bias!r}: needs the patches' places on the grid and no other attention bias: "
                "posemb other than 'relative' and axial=False"
            )
        if self.attn_offsets and self.attn_bias == "none":
            raise ConfigError("attn_offsets=True: the offsets' bias is part of the distance penalty; "
                              "needs attn_bias 'distance' or 'distance_no_self'")
        if self.posemb == "learned_2d" and self.width % 2:
            raise ConfigError(f"width={self.width} must be even for posemb='learned_2d' (two tables of width/2)")
        if self.patch_dropout and (self.axial or self.posemb == "relative" or self.posemb_place != "stem"):
            raise ConfigError(
                f"patch_dropout={self.patch_dropout}: needs absolute position embeddings added once at the stem "
                "(posemb 'none', 'learned_1d' or 'learned_2d', posemb_place='stem') and no axial blocks, which "
                "need the whole patch grid in every block"
            )
        if self.axial:
            if self.classifier != "gap":
                raise ConfigError("axial=True needs classifier='gap': a [class] token has no row or column")
            if self.posemb not in ("none", "learned_2d", "learned_1d") or self.posemb_place != "stem":
                raise ConfigError("axial=True supports posemb 'none', 'learned_1d' or 'learned_2d' at the stem only")
        grid = self.feature_size
        for axis, (size, patch) in enumerate(zip(grid, self.patch_size)):
            if size % patch:
                what = "ResNet feature map" if self.resnet else "image"
                side = self.img_size[axis]
                if self.resnet is None:
                    lower, upper = side - side % patch, side - side % patch + patch
                    allowed = f"a multiple of {patch}, such as {', '.join(str(v) for v in (lower, upper) if v > 0)}"
                else:
                    allowed = f"a size whose feature map (size / {self.resnet.reduction}, rounded up) is a multiple of {patch}"
                raise ConfigError(
                    f"img_size={self.img_size}: the {what} ({grid[0]}x{grid[1]}) is not divisible by "
                    f"patch_size={self.patch_size} along {'height' if axis == 0 else 'width'}; allowed: {allowed}"
                )
        if self.num_patches > MAX_PATCHES:
            raise ConfigError(
                f"img_size={self.img_size} with patch_size={self.patch_size}: {self.num_patches} patches per image; "
                f"at most {MAX_PATCHES} are allowed"
            )
        estimate = self.estimated_parameters()
        if estimate > MAX_PARAMETERS:
            raise ConfigError(
                f"width={self.width}, depth={self.depth}, mlp_dim={self.mlp_dim}, num_classes={self.num_classes}: "
                f"about {estimate:.3g} parameters; at most {MAX_PARAMETERS:.0e} are allowed"
            )

    def estimated_parameters(self) -> int:
        """A quick upper-bound-ish count of parameters (no allocation), for the size check."""
        w, tokens = self.width, self.num_patches + 1
        per_block = 4 * w * w + 2 * w * self.mlp_dim + 10 * w + self.mlp_dim
        patch_dim = self.patch_size[0] * self.patch_size[1] * (self.resnet.out_channels if self.resnet else self.in_chans)
        head_in = self.representation_size or w
        return (self.depth * per_block * (2 if self.axial else 1) + tokens * w * (self.depth if self.posemb_place
                == "every_layer" else 1) + patch_dim * w + head_in * (self.num_classes + w) + 4 * w)

    @property
    def feature_size(self) -> Pair:
        """Spatial size of what the patch embedding sees: the image, or the ResNet feature map."""
        return self.feature_size_of(self.img_size)

    def feature_size_of(self, img_size: Pair) -> Pair:
        """``feature_size`` for an input of ``img_size`` (models with dynamic_img_size see many)."""
        if self.resnet is None:
            return tuple(img_size)
        r = self.resnet.reduction
        return (-(-img_size[0] // r), -(-img_size[1] // r))  # SAME padding rounds up

    def divides_into_patches(self, img_size: Pair) -> bool:
        """Whether an input of ``img_size`` (its feature map, for a hybrid) cuts into whole patches."""
        (h, w), (ph, pw) = self.feature_size_of(img_size), self.patch_size
        return h % ph == 0 and w % pw == 0

    @property
    def grid_size(self) -> Pair:
        """Number of patches along height and width."""
        (h, w), (ph, pw) = self.feature_size, self.patch_size
        return (h // ph, w // pw)

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.classifier == "token" else 0

    def kept_patches(self, patches: int) -> int:
        """How many of an image's ``patches`` patch tokens a training step keeps: all, or
        ``1 - patch_dropout`` of them, rounded, at least one."""
        return max(1, round(patches * (1.0 - self.patch_dropout))) if self.patch_dropout > 0 else patches


Architecture = Union[ViTConfig, ResNetConfig]  # what a model is built from


def need_architecture(value: Any, name: str = "cfg", also: str = "") -> None:
    """That ``value`` is a ViTConfig or ResNetConfig (``also``: what else the caller accepts): anything
    else failed far inside, as "'str' object has no attribute 'axial'"."""
    if not isinstance(value, (ViTConfig, ResNetConfig)):
        raise ConfigError(f"{name}={value!r:.80}: expected {also}a ViTConfig or a ResNetConfig "
                          f"(vitlab.get_config('ViT-B/16') gives one), got a {type(value).__name__}")


def replace(config: Architecture, **overrides: Any) -> Architecture:
    """Return a copy of ``config`` with fields overridden; unknown fields are an error."""
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(
            f"unknown field(s) {', '.join(unknown)} for {type(config).__name__}; "
            f"known fields: {', '.join(sorted(names))}"
        )
    return dataclasses.replace(config, **overrides)


def _tuples(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _resnet_from_dict(d: dict, saved: bool = False) -> ResNetConfig:
    """A hybrid's ``resnet`` given as a dict of fields (``saved``: read from a saved config): another
    key was a TypeError from the constructor."""
    names = {f.name for f in dataclasses.fields(ResNetConfig)}
    unknown = sorted(map(str, set(d) - names))
    if unknown and saved:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)} in a saved ResNetConfig (resnet=...)")
    if unknown:
        raise ConfigError(f"resnet: unknown field(s) {', '.join(unknown)}; ResNetConfig's fields: "
                          f"{', '.join(sorted(names))}")
    return ResNetConfig(**_tuples(d))


def config_to_dict(config: Architecture) -> dict:
    """A JSON-serialisable dict that records the config's type."""
    d = dataclasses.asdict(config)
    d["type"] = type(config).__name__
    return d


def config_from_dict(d: dict) -> Architecture:
    if not isinstance(d, dict):
        raise ConfigError(f"a saved config must be a JSON object of fields, not {type(d).__name__}")
    d = dict(d)
    kind = d.pop("type", "ViTConfig")
    classes = {"ViTConfig": ViTConfig, "ResNetConfig": ResNetConfig}
    if kind not in classes:
        raise ConfigError(f"type={kind!r}: allowed values are {', '.join(classes)}")
    cls = classes[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)} in a saved {kind}")
    if kind == "ViTConfig" and isinstance(d.get("resnet"), dict):
        d["resnet"] = _resnet_from_dict(d["resnet"], saved=True)
    return cls(**_tuples(d))


def config_to_json(config: Architecture) -> str:
    return json.dumps(config_to_dict(config), indent=2, sort_keys=True)


def config_from_json(text: str) -> Architecture:
    return config_from_dict(json.loads(text))
