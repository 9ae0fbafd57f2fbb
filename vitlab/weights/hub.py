"""Weights by Hugging Face Hub name: ``load_model("google/vit-base-patch16-224")``.

Most users' ViT weights already sit in the local Hugging Face cache, where ``transformers``
put them.  A Hub name (``org/name``, optionally ``@revision``) is looked up there first,
with no network, in huggingface_hub's layout::

    $HF_HUB_CACHE/models--google--vit-base-patch16-224/refs/main          -> a commit hash
    $HF_HUB_CACHE/models--google--vit-base-patch16-224/snapshots/<hash>/   config.json, model.safetensors

The cache folder follows huggingface_hub's rule: ``HF_HUB_CACHE``, else the older
``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub`` (``HF_HOME`` defaulting to
``$XDG_CACHE_HOME/huggingface``, i.e. ``~/.cache/huggingface``).  A name that is not cached
is downloaded into that cache with ``huggingface_hub`` (the optional ``hub`` extra) unless
``HF_HUB_OFFLINE`` is set: ``config.json``, the image processor's ``preprocessor_config.json``
where the repository has one (its input scaling, which ``load_model`` takes into the weights),
and one weights file, safetensors when the repository has it.  The snapshot folder is then an ordinary Hugging Face folder, which
``load_model`` reads by its ``config.json``.

A cached transformers snapshot may lack the image processor's config (``from_pretrained`` of a
model caches its config and weights only): unless the cache notes that the repository has none,
it is downloaded for the snapshot's commit, one request once; offline, or where that fails, a
warning says that the model is taken to read ViTImageProcessor's default input (mean and std 0.5).

Before downloading, one request asks the Hub for ``config.json``'s metadata, with a short
timeout and no retries: with no network, huggingface_hub's own download retries a refused
connection for some 25 s, a warning line per try, before it fails.  Its log lines are
held back while vitlab downloads (its logger's level is restored afterwards).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

from .core import WeightsError
from .huggingface import PROCESSOR_NAME

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# seconds the Hub has to answer the first request before the name is refused (``HF_HUB_ETAG_TIMEOUT``
# when set): a live Hub answers a HEAD in well under a second
REACH_TIMEOUT_S = 3.0
# org/name with the Hub's characters, an optional @revision (branch, tag or commit)
# timm spells a Hub name with a prefix, "hf-hub:org/name" (formerly "hf_hub:"): taken as the name
_HUB_NAME = re.compile(r"^(?:hf[-_]hub:)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def parse_hub_name(text: str) -> tuple[str, str] | None:
    """``(repo_id, revision)`` of ``org/name[@revision]`` (or timm's ``hf-hub:org/name``), or None for anything else
    (a path that exists, a file name with a weights suffix, a path in a folder here (``local_folder``), a registry
    name such as ViT-B/16, or one mistyped: ViT-Ti/17 was downloaded from the Hub, which answered that it holds no
    such repository)."""
    text = str(text)
    match = _HUB_NAME.match(text)
    if match is None or Path(text).exists() or Path(text).suffix in (".npz", ".safetensors", ".pt", ".pth", ".bin"):
        return None
    if local_folder(text) is not None:
        return None
    from vitlab.models.registry import has_name_form

    if has_name_form(text):
        return None
    return match["repo"], match["revision"] or "main"


def local_folder(text: str) -> str | None:
    """The folder of the working folder that ``org/name`` names as its ``org``, where there is one: the name
    is then a path in it, and not a Hub name (``runs/dem``, mistyped for ``runs/demo``, was looked up on the
    Hub, a download attempted, and refused as no such repository); timm's ``hf-hub:org/name`` is the Hub's
    all the same, and a registry name (ViT-B/16, ``has_name_form``) the model.  None for any other text."""
    from vitlab.models.registry import has_name_form

    match = _HUB_NAME.match(str(text))
    if match is None or str(text).lower().startswith(("hf-hub:", "hf_hub:")) or has_name_form(str(text)):
        return None
    org = match["repo"].split("/")[0]
    return org if Path(org).is_dir() else None


def not_looked_up(text: str) -> str:
    """What a refusal of ``text`` as no such file or folder adds where ``text`` has a Hub name's form and
    is a path in a folder here (``local_folder``): that it was not looked up on the Hub, and how to name the
    Hub's; "" otherwise."""
    org = local_folder(text)
    if org is None:
        return ""
    return (f" (a path in the folder {org} here, not looked up on the Hugging Face Hub; a Hub model of that name "
            f"is hf-hub:{text})")


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as huggingface_hub reads it."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / name).is_file() for name in WEIGHT_FILES)


def cached_snapshot(repo_id: str, revision: str = "main", cache_dir: Path | None = None) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` in the local cache, if it holds
    a config and weights; None otherwise.  No network."""
    repo = (cache_dir or hub_cache_dir()) / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision  # a commit hash names its snapshot
    snapshot = repo / "snapshots" / commit
    return snapshot if _has_weights(snapshot) else None


@contextlib.contextmanager
def _hub_logs_held_back() -> Iterator[None]:
    """huggingface_hub's warnings (a line per retry) not printed; its logger as it was afterwards."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _reach(hub: Any, repo_id: str, revision: str, filename: str = "config.json") -> None:
    """One request for ``filename``'s metadata, no retries: raises at once when the Hub
    cannot be reached, or holds no such repository, revision or file."""
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or REACH_TIMEOUT_S)
    hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, filename, revision=revision), timeout=timeout)


def _missing(err: Exception) -> bool:
    """Whether ``err`` is the Hub's answer that the repository holds no such file."""
    return "EntryNotFound" in type(err).__name__


def download_snapshot(repo_id: str, revision: str = "main", cache_dir: Path | None = None) -> Path:
    """Download ``config.json``, the image processor's config where there is one, and one weights
    file of ``repo_id`` into the cache; the snapshot folder."""
    from vitlab.extras import require

    cache_dir = cache_dir or hub_cache_dir()
    # a mistyped local folder (runs/dem) reads as a Hub name too: what is not there comes first, as below
    hub = require("huggingface_hub", f"{repo_id}: no such file or folder, nor a model in the Hugging Face cache "
                                     f"{cache_dir}; downloading it")

    def fetch(filename: str) -> Path:
        return Path(hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=str(cache_dir)))

    try:
        with _hub_logs_held_back():
            _reach(hub, repo_id, revision)
            config = fetch("config.json")
            try:
                fetch(PROCESSOR_NAME)
            except Exception as err:  # none: the model reads what vitlab gives (ViTImageProcessor's defaults)
                if not _missing(err):
                    raise
            for i, name in enumerate(WEIGHT_FILES):
                try:
                    fetch(name)
                    break
                except Exception as err:  # the repository lacks this file: try the next format
                    if i == len(WEIGHT_FILES) - 1 or not _missing(err):
                        raise
    except Exception as err:  # no network, no such repository or revision, refused access
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
        raise WeightsError(f"{repo_id}@{revision}: no such file or folder, nor a model in the Hugging Face cache "
                           f"{cache_dir}; downloading it from the Hub failed: {reason}") from None
    return config.parent


# the snapshots whose unknown input scaling has been warned about in this process
_SCALING_UNKNOWN: set[Path] = set()


def processor_unknown(snapshot: Path) -> bool:
    """Whether the cache cannot tell a transformers snapshot's input scaling: it holds no image
    processor's config, nor huggingface_hub's note that the repository has none (an empty
    ``.no_exist/<commit>/preprocessor_config.json``, written when a download found none).
    ``ViTForImageClassification.from_pretrained`` caches the config and the weights only.
    (A timm repository states its mean and std in its config.json: never unknown.)"""
    if (snapshot / PROCESSOR_NAME).is_file() or (snapshot.parent.parent / ".no_exist" / snapshot.name
                                                 / PROCESSOR_NAME).exists():
        return False
    try:
        config = json.loads((snapshot / "config.json").read_text())
    except (OSError, ValueError):  # the loader reports it
        return False
    return isinstance(config, dict) and "model_type" in config


def fetch_processor(repo_id: str, snapshot: Path, cache_dir: Path) -> str | None:
    """Download the image processor's config of ``snapshot``'s commit into the cache (or have
    huggingface_hub note that there is none); None when the cache now knows, else why not."""
    if offline():
        return "HF_HUB_OFFLINE is set"
    try:
        import huggingface_hub as hub
    except ImportError:
        return 'huggingface_hub is not installed: pip install -e ".[hub]"'
    try:
        with _hub_logs_held_back():
            try:
                _reach(hub, repo_id, snapshot.name, PROCESSOR_NAME)
            except Exception as err:  # none there: the download below has huggingface_hub note so
                if not _missing(err):
                    raise
            hub.hf_hub_download(repo_id, PROCESSOR_NAME, revision=snapshot.name, cache_dir=str(cache_dir))
    except Exception as err:  # no network, refused access
        if not _missing(err):
            return f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
    return None


def resolve_hub_name(text: str) -> Path | None:
    """The local snapshot folder of a Hub name (from the cache, else downloaded), or None
    when ``text`` is not a Hub name."""
    parsed = parse_hub_name(text)
    if parsed is None:
        return None
    repo_id, revision = parsed
    cache_dir = hub_cache_dir()
    snapshot = cached_snapshot(repo_id, revision, cache_dir)
    if snapshot is not None:
        # without its image processor's config, weights trained on other inputs (ImageNet's mean and
        # std: DeiT) were scored on vitlab's without a word
        unknown = snapshot not in _SCALING_UNKNOWN and processor_unknown(snapshot)  # once: a command reads a name twice
        why = fetch_processor(repo_id, snapshot, cache_dir) if unknown else None
        if why is not None:
            _SCALING_UNKNOWN.add(snapshot)
            warnings.warn(f"{text}: the Hugging Face cache holds no {PROCESSOR_NAME} for it (transformers "
                          f"caches it with the image processor, not the model), and it was not downloaded ({why}): "
                          "its input scaling is taken to be ViTImageProcessor's default, mean and std 0.5")
        return snapshot
    if offline():
        raise WeightsError(f"{text}: no such file or folder, nor a model in the Hugging Face cache {cache_dir} "
                           "(HF_HUB_OFFLINE is set: nothing is downloaded)")
    return download_snapshot(repo_id, revision, cache_dir)
