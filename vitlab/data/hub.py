"""Image data sets as Hugging Face holds them: ``datasets``' ``save_to_disk`` folders and
parquet files, read as streamed sources (needs pyarrow: ``pip install -e ".[hf]"``).

* ``Dataset.save_to_disk(folder)`` writes ``state.json``, ``dataset_info.json`` and
  ``data-0000i-of-0000n.arrow`` files (Arrow IPC streams); a ``DatasetDict`` writes one
  such folder per split beside ``dataset_dict.json``.
* The Hub stores data sets as parquet files (``data/train-00000-of-00004.parquet``)
  whose schema metadata carries the same description of the columns.

An image column is an ``Image`` feature: a struct of the encoded ``bytes`` (and a
``path``, read when the bytes are absent); the label column is a ``ClassLabel``
feature, whose names are the classes.  A unit (what one reader reads in one go) is a
record batch of an arrow file or a row group of a parquet file: a reader reads only its
units' two columns, memory-mapped, and decodes only the images it hands out, so nothing
is decoded or copied up front whatever the size of the set.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence

from vitlab.data.sources import DataError, StreamSource, classes_beside, files_key

__all__ = ["arrow_source", "is_hf_dataset", "parquet_source"]

log = logging.getLogger(__name__)

LABEL_NAMES = ("label", "labels", "fine_label")  # the label column when several could be


def _pyarrow(source: str):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - the submodules used below
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(f"{source}: reading Hugging Face datasets and parquet files needs pyarrow: "
                        'pip install -e ".[hf]"') from None
    return pyarrow


def is_hf_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _columns(features: dict, where: str, schema) -> tuple[str, str, Optional[list]]:
    """(image column, label column, class names or None) of a ``datasets`` features dict and
    the arrow ``schema`` of the data."""
    names = schema.names
    images = [k for k, v in features.items() if isinstance(v, dict) and v.get("_type") == "Image"]
    if not images:  # no description: a struct column with encoded bytes
        images = [k for k in names if k in ("image", "img")]
    if len(images) != 1:
        found = ", ".join(images) or "none"
        raise DataError(f"{where}: expected one image column (an Image feature), found {found}")
    labels = [k for k, v in features.items() if isinstance(v, dict) and v.get("_type") == "ClassLabel"]
    if len(labels) > 1:
        labels = [k for k in LABEL_NAMES if k in labels][:1] or labels
    if not labels:
        labels = [k for k in LABEL_NAMES if k in names][:1]
    if len(labels) != 1:
        found = ", ".join(labels) or "none"
        raise DataError(f"{where}: expected one label column (a ClassLabel feature, or one named "
                        f"{', '.join(LABEL_NAMES)}), found {found}")
    _check_types(schema, images[0], labels[0], where)
    label_feature = features.get(labels[0], {})
    classes = label_feature.get("names") if isinstance(label_feature, dict) else None
    return images[0], labels[0], list(classes) if classes else None


def _check_types(schema, image: str, label: str, where: str) -> None:
    """That the columns hold what a reader takes: an ``Image`` struct of bytes (and a path), and
    integer class ids; paths in a plain string column, or names as labels, failed in the reader."""
    pa = _pyarrow(where)
    image_type, label_type = schema.field(image).type, schema.field(label).type
    if not (pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0):
        raise DataError(f"{where}: the image column {image!r} holds {image_type}, not an Image feature (a struct of "
                        f"the encoded bytes and a path); cast it first: dataset.cast_column({image!r}, "
                        "datasets.Image())")
    if not pa.types.is_integer(label_type):
        raise DataError(f"{where}: the label column {label!r} holds {label_type}, not integer class ids; make them "
                        f"a ClassLabel first: dataset.class_encode_column({label!r})")


def _classes_beside(folder: Path, where: str) -> list[str]:
    """Class names written beside the data (``sources.classes_beside``), or a DataError."""
    classes = classes_beside(folder)
    if classes is None:
        raise DataError(f"{where}: the label column has no class names (not a ClassLabel feature); write them, one "
                        f"a line in label order, into {folder / 'classes.txt'}")
    return classes


def _rows(name: str, images, labels, skipped: Optional[list] = None) -> Iterator[tuple[str, object, int]]:
    """(key, bytes or path, label) of a batch's image struct column and label column; rows
    without either go to ``skipped`` as (key, reason), or to a warning where it is None."""
    data = images.field("bytes").to_pylist()
    paths = images.field("path").to_pylist() if images.type.get_field_index("path") >= 0 else [None] * len(data)
    for row, (blob, path, label) in enumerate(zip(data, paths, labels.to_pylist())):
        key = f"{name}:{row}"
        if label is None or label < 0 or (blob is None and not path):
            reason = "no label" if label is None or label < 0 else "no image"
            if skipped is None:
                log.warning("%s: skipped (%s)", key, reason)
            else:
                skipped.append((key, reason))
            continue
        yield key, blob if blob is not None else path, int(label)


# ----------------------------------------------------------------------------- save_to_disk


def read_arrow_batch(unit: tuple[str, int], skipped: Optional[list] = None, *, image_column: str,
                     label_column: str) -> Iterator[tuple[str, object, int]]:
    """The samples of record batch ``unit[1]`` of the arrow file ``unit[0]`` (``skipped``: as ``_rows``)."""
    path, index = unit
    pa = _pyarrow(path)
    with pa.memory_map(path) as mapped:
        for i, batch in enumerate(pa.ipc.open_stream(mapped)):
            if i == index:
                yield from _rows(f"{Path(path).name}:{index}", batch.column(image_column),
                                 batch.column(label_column), skipped)
                return


def arrow_source(folder: Path, name: str) -> StreamSource:
    """A ``save_to_disk`` folder: one unit per record batch of its arrow files."""
    pa = _pyarrow(name)
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{name}: a DatasetDict of the splits {', '.join(splits)}; name one split's folder, e.g. "
                        f"{folder / (splits[0] if splits else 'train')}")
    try:
        state = json.loads((folder / "state.json").read_text())
        info = json.loads((folder / "dataset_info.json").read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
        features = info["features"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{name}: not a folder written by datasets' save_to_disk (state.json, dataset_info.json): "
                        f"{type(e).__name__}: {e}") from e
    units, sizes, schema = [], [], None
    for path in files:
        try:
            with pa.memory_map(str(path)) as mapped:
                stream = pa.ipc.open_stream(mapped)
                schema = schema or stream.schema
                for i, batch in enumerate(stream):
                    units.append((str(path), i))
                    sizes.append(batch.num_rows)
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path}: not a readable arrow file: {type(e).__name__}: {e}") from e
    if schema is None:
        raise DataError(f"{name}: state.json lists no arrow files")
    image, label, classes = _columns(features, name, schema)
    classes = classes or _classes_beside(folder, name)
    read = functools.partial(read_arrow_batch, image_column=image, label_column=label)
    return StreamSource(units, read, classes, sizes, name=name, key=files_key(files, folder.name, classes))


# ----------------------------------------------------------------------------- parquet


def read_row_group(unit: tuple[str, int], skipped: Optional[list] = None, *, image_column: str,
                   label_column: str) -> Iterator[tuple[str, object, int]]:
    """The samples of row group ``unit[1]`` of the parquet file ``unit[0]`` (``skipped``: as ``_rows``)."""
    path, index = unit
    pa = _pyarrow(path)
    table = pa.parquet.ParquetFile(path).read_row_group(index, columns=[image_column, label_column])
    yield from _rows(f"{Path(path).name}:{index}", table.column(image_column).combine_chunks(),
                     table.column(label_column).combine_chunks(), skipped)


def parquet_source(paths: Sequence[Path], name: str) -> StreamSource:
    """Parquet files of image bytes and labels: one unit per row group."""
    pa = _pyarrow(name)
    units, sizes, features, schema = [], [], None, None
    for path in paths:
        try:
            meta = pa.parquet.ParquetFile(str(path))
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path}: not a readable parquet file: {type(e).__name__}: {e}") from e
        if features is None:
            schema = meta.schema_arrow
            described = (meta.schema_arrow.metadata or {}).get(b"huggingface")
            features = json.loads(described).get("info", {}).get("features", {}) if described else {}
        for i in range(meta.num_row_groups):
            units.append((str(path), i))
            sizes.append(meta.metadata.row_group(i).num_rows)
    image, label, classes = _columns(features, name, schema)
    classes = classes or _classes_beside(Path(paths[0]).parent, name)
    read = functools.partial(read_row_group, image_column=image, label_column=label)
    return StreamSource(units, read, classes, sizes, name=name, key=files_key(paths, "parquet", classes))
