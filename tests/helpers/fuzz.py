"""Fuzz vitlab's readers of untrusted bytes for a fixed time budget.

    python tests/helpers/fuzz.py                         # every target, 60 s each
    python tests/helpers/fuzz.py --seconds 10 --target image --target shard
    python tests/helpers/fuzz.py --save                  # keep failing inputs as regression tests

Targets (each gets mutations of small valid seed files: bit flips, byte overwrites,
insertions, deletions, truncation, splices of two seeds):

    image        vitlab.data.memory.decode_image           may raise DataError only
    archive      read_image_archive + resolve_data_path     may raise DataError only; nothing written
                                                            outside the cache folder, no partial left
    shard        read_shard + decode_crop over one shard    may raise nothing: damage is skipped and counted
    safetensors  vitlab.weights.load_model (vitlab file)    may raise WeightsError / ConfigError only
    npz          load_model (official vit_jax .npz)         likewise
    pt           load_model (torch.save state dict)         likewise

Any other exception is a failure: it is printed, and with ``--save`` the input is written
to the target's corpus folder (tests/data/fuzz_corpus/<target>/ or
tests/weights/fuzz_corpus/<target>/), where the tests replay it on every run.  The tests
run the same targets for a short budget with hypothesis (tests/test_fuzz.py).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CORPUS = {
    "image": ROOT / "tests" / "data" / "fuzz_corpus" / "image",
    "archive": ROOT / "tests" / "data" / "fuzz_corpus" / "archive",
    "shard": ROOT / "tests" / "data" / "fuzz_corpus" / "shard",
    "safetensors": ROOT / "tests" / "weights" / "fuzz_corpus" / "safetensors",
    "npz": ROOT / "tests" / "weights" / "fuzz_corpus" / "npz",
    "pt": ROOT / "tests" / "weights" / "fuzz_corpus" / "pt",
}
TARGETS = tuple(CORPUS)


class FuzzFailure(AssertionError):
    """A target broke its contract: an exception type other than vitlab's own, or a write outside the cache."""


# ----------------------------------------------------------------------------- seeds


def _encode(img, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kw)
    return buffer.getvalue()


@lru_cache(maxsize=None)
def image_seeds() -> tuple[bytes, ...]:
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    palette = rgb.convert("P")
    seeds = [
        _encode(rgb, "PNG"),
        _encode(rgb.convert("RGBA"), "PNG"),
        _encode(palette, "PNG", transparency=0),
        _encode(Image.fromarray(rng.integers(0, 65536, (8, 8), dtype=np.uint16)), "PNG"),
        _encode(rgb, "JPEG", quality=90),
        _encode(rgb.convert("L"), "JPEG"),
        _encode(rgb.convert("CMYK"), "JPEG"),
        _encode(palette, "GIF"),
        _encode(rgb, "BMP"),
        _encode(rgb.convert("CMYK"), "TIFF"),
        _encode(rgb, "PPM"),
    ]
    try:
        seeds.append(_encode(rgb, "WEBP"))
    except (OSError, KeyError):  # Pillow built without WebP
        pass
    return tuple(seeds)


def _tar(members: list[tuple[str, bytes]], gz: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@lru_cache(maxsize=None)
def archive_seeds() -> tuple[bytes, ...]:
    png, jpg = image_seeds()[0], image_seeds()[4]
    members = [("train/a/0.png", png), ("train/a/1.jpg", jpg), ("train/b/0.png", png), ("train/b/x.txt", b"hi")]
    return (_tar(members), _tar(members, gz=True))


@lru_cache(maxsize=None)
def shard_seeds() -> tuple[bytes, ...]:
    png, jpg = image_seeds()[0], image_seeds()[4]
    members = [("000.png", png), ("000.cls", b"0"), ("001.jpg", jpg), ("001.cls", b"1"), ("002.png", png),
               ("002.cls", b"2")]
    return (_tar(members), _tar(members, gz=True))


def _tiny_model():
    import torch

    from vitlab.config import ViTConfig
    from vitlab.models.registry import build_model

    torch.manual_seed(0)
    cfg = ViTConfig(img_size=8, patch_size=4, width=8, depth=1, mlp_dim=16, num_heads=2, num_classes=2)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@lru_cache(maxsize=None)
def weight_seeds(fmt: str) -> tuple[bytes, ...]:
    import torch

    from vitlab.weights import save_model, save_official_npz

    model = _tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"m.{fmt}"
        if fmt == "safetensors":
            save_model(model, path)
        elif fmt == "npz":
            save_official_npz(model, path)
        else:
            torch.save(model.state_dict(), path)
        return (path.read_bytes(),)


def seeds(target: str) -> tuple[bytes, ...]:
    if target == "image":
        return image_seeds()
    if target == "archive":
        return archive_seeds()
    if target == "shard":
        return shard_seeds()
    return weight_seeds(target)


# ----------------------------------------------------------------------------- mutation


def mutate(data: bytes, rng: random.Random, other: bytes | None = None) -> bytes:
    """1 to 8 random edits of ``data``: the kinds of damage files meet in the wild."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        n = len(out)
        if n == 0:
            out += bytes([rng.randrange(256)])
            continue
        at = rng.randrange(n)
        if kind < 0.35:
            out[at] ^= 1 << rng.randrange(8)                      # a flipped bit
        elif kind < 0.55:
            out[at] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))  # an overwritten byte
        elif kind < 0.65:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))  # inserted bytes
        elif kind < 0.75:
            del out[at : at + rng.randint(1, 64)]                   # deleted bytes
        elif kind < 0.85:
            del out[at:]                                            # truncation
        elif kind < 0.93 and n >= 8:
            width = rng.choice((2, 4, 8))                          # an interesting integer
            at = min(at, n - width)
            value = rng.choice((0, 1, 2**(8 * width - 1) - 1, 2**(8 * width) - 1, rng.randrange(2**(8 * width))))
            out[at : at + width] = value.to_bytes(width, rng.choice(("little", "big")))
        elif other:
            cut = rng.randrange(len(other))                         # a splice of two seeds
            out = out[:at] + bytearray(other[cut:])
    return bytes(out)


def mutate_from(target: str, rng: random.Random) -> bytes:
    pool = seeds(target)
    return mutate(rng.choice(pool), rng, rng.choice(pool))


# ----------------------------------------------------------------------------- targets


def _snapshot(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_image(data: bytes, workdir: Path) -> str:
    from vitlab.data.memory import decode_image
    from vitlab.data.sources import DataError

    try:
        array = decode_image(io.BytesIO(data), size=(4, 4) if data[:1] == b"\x89" else None)
    except DataError as e:
        _one_line(e)
        return "refused"
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise FuzzFailure(f"decode_image returned {array.dtype} {array.shape}, not (H, W, 3) uint8")
    return "decoded"


def run_archive(data: bytes, workdir: Path) -> str:
    from vitlab.data.sources import DataError, read_image_archive, resolve_data_path

    sandbox = workdir / "archive"
    shutil.rmtree(sandbox, ignore_errors=True)
    sandbox.mkdir()
    name = "data.tar.gz" if data[:2] == b"\x1f\x8b" else "data.tar"
    (sandbox / name).write_bytes(data)
    outcomes = []
    try:
        read_image_archive(sandbox / name)
        outcomes.append("read")
    except DataError as e:
        _one_line(e)
        outcomes.append("refused")
    try:
        folder = resolve_data_path(sandbox / name, sandbox / "cache")
        outcomes.append("extracted")
        if not folder.resolve().is_relative_to((sandbox / "cache").resolve()):
            raise FuzzFailure(f"extracted to {folder}, outside the cache")
    except DataError as e:
        _one_line(e)
        outcomes.append("refused")
        extracted = sandbox / "cache" / "extracted"
        if extracted.is_dir() and os.listdir(extracted):
            raise FuzzFailure(f"a refused archive left {os.listdir(extracted)} in the cache")
    outside = [p for p in _snapshot(sandbox) if not p.startswith("cache") and p != name]
    if outside:
        raise FuzzFailure(f"files written outside the cache folder: {outside}")
    return "/".join(outcomes)


def run_shard(data: bytes, workdir: Path) -> str:
    from vitlab.data.decode import SampleCrop, decode_crop
    from vitlab.data.shards import read_shard
    from vitlab.data.sources import DataError

    path = workdir / "shard-000000.tar"
    path.write_bytes(data)
    n, skipped = 0, []
    for key, image, label in read_shard(path, skipped):  # what a streaming reader does with a shard
        try:
            pixels = decode_crop(io.BytesIO(image), SampleCrop((4, 4)))
        except DataError:
            skipped.append(key)
            continue
        if pixels.shape != (4, 4, 3) or not isinstance(label, (int, tuple)):
            raise FuzzFailure(f"the shard reader yielded {pixels.shape}, {label!r}")
        n += 1
    return f"{n} samples, {len(skipped)} skipped"


def run_weights(fmt: str) -> Callable[[bytes, Path], str]:
    def run(data: bytes, workdir: Path) -> str:
        from vitlab.config import ConfigError
        from vitlab.weights import WeightsError, load_model

        path = workdir / f"m.{fmt}"
        path.write_bytes(data)
        try:
            load_model(path, num_heads=2)
        except (WeightsError, ConfigError) as e:
            _one_line(e)
            return "refused"
        return "loaded"

    return run


RUNNERS: dict[str, Callable[[bytes, Path], str]] = {
    "image": run_image,
    "archive": run_archive,
    "shard": run_shard,
    "safetensors": run_weights("safetensors"),
    "npz": run_weights("npz"),
    "pt": run_weights("pt"),
}


def _one_line(e: Exception) -> None:
    if not str(e).strip():
        raise FuzzFailure(f"{type(e).__name__} without a message")


def check(target: str, data: bytes, workdir: Path) -> str:
    """Run one input; return the outcome or raise (FuzzFailure or the unexpected exception)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RUNNERS[target](data, workdir)


def quiet() -> None:
    """Silence the warnings that skipped inputs log (they are the expected outcome here)."""
    logging.getLogger("vitlab").setLevel(logging.CRITICAL)


def corpus(target: str) -> list[Path]:
    folder = CORPUS[target]
    return sorted(folder.glob("*.bin")) if folder.is_dir() else []


def save(target: str, data: bytes) -> Path:
    folder = CORPUS[target]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(data).hexdigest()[:16]}.bin"
    path.write_bytes(data)
    return path


def fuzz(target: str, seconds: float, seed: int = 0, keep: bool = False) -> dict:
    """Mutate the target's seeds for ``seconds``; return counts of outcomes and failures."""
    rng = random.Random(f"{target}-{seed}")
    outcomes: dict[str, int] = {}
    failures: dict[str, int] = {}
    executions = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for path in corpus(target):  # the regression inputs first
            check(target, path.read_bytes(), workdir)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            data = mutate_from(target, rng)
            executions += 1
            try:
                outcome = check(target, data, workdir)
            except Exception as e:  # noqa: BLE001 - every other exception is what fuzzing looks for
                kind = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
                if kind not in failures:
                    print(f"[{target}] FAILURE {kind}", file=sys.stderr)
                    traceback.print_exc(limit=3)
                    if keep:
                        print(f"[{target}]   input saved to {save(target, data)}", file=sys.stderr)
                failures[kind] = failures.get(kind, 0) + 1
                continue
            outcome = outcome.split(",")[0] if target == "shard" else outcome
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        elapsed = time.perf_counter() - start
    return {"target": target, "seconds": round(elapsed, 1), "executions": executions,
            "per_second": round(executions / elapsed, 1), "outcomes": outcomes, "failures": failures,
            "corpus": len(corpus(target))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=TARGETS, help="repeatable; default: all")
    parser.add_argument("--seconds", type=float, default=60.0, help="budget per target (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", action="store_true", help="write failing inputs to the corpus folders")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    quiet()
    results = [fuzz(t, args.seconds, args.seed, args.save) for t in args.target or TARGETS]
    print("| target | seconds | executions | per second | outcomes | failures |")
    print("|---|---:|---:|---:|---|---:|")
    for r in results:
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"| {r['target']} | {r['seconds']} | {r['executions']} | {r['per_second']} | {outcomes} | "
              f"{sum(r['failures'].values())} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
