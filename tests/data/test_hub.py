"""Image sets as Hugging Face holds them: ``datasets``' save_to_disk folders and parquet
files, streamed without decoding them first, and the one-line error without pyarrow."""
import io
import sys

import numpy as np
import pytest
from PIL import Image

from vitlab.data.memory import load_in_memory
from vitlab.data.sources import DataError
from vitlab.data.stream import StreamLoader, is_stream_source, open_source

datasets = pytest.importorskip("datasets", reason='the hf extra: pip install -e ".[hf]"')
pq = pytest.importorskip("pyarrow.parquet")
datasets.disable_progress_bars()

CLASSES = ["ant", "bee", "cat"]


@pytest.fixture
def hf_set(fakes):
    """A datasets.Dataset of 12 PNG images whose first pixel holds their id; label = id % 3."""
    images = [Image.fromarray(fakes.image_with_id(i)) for i in range(12)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    return datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(12)]}, features=features)


def ids_and_labels(source, fakes, workers=0):
    """Every sample of ``source`` once: (id, label) pairs read by a StreamLoader, sorted."""
    loader = StreamLoader(source, source.num_samples, image_size=8, shuffle_buffer=0, workers=workers)
    x, y = next(iter(loader))
    return sorted((fakes.id_of(image), int(label)) for image, label in zip(x, y))


def test_save_to_disk_folder_streams_by_record_batch(hf_set, tmp_path, fakes):
    hf_set.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    assert is_stream_source(str(tmp_path / "ds"))
    source = open_source(str(tmp_path / "ds"))
    assert source.classes == CLASSES and source.num_samples == 12 and len(source.units) == 2
    assert ids_and_labels(source, fakes, workers=2) == [(i, i % 3) for i in range(12)]
    # decoded into memory, the same pixels as the images themselves
    data = load_in_memory(str(tmp_path / "ds"), cache_dir=tmp_path / "cache", workers=1)
    order = np.argsort([fakes.id_of(image) for image in data.images])
    expected = np.stack([fakes.image_with_id(i).transpose(2, 0, 1) for i in range(12)])
    assert np.array_equal(data.images.numpy()[order], expected) and data.classes == CLASSES


def test_a_dataset_dict_names_its_splits(hf_set, tmp_path):
    datasets.DatasetDict({"train": hf_set, "test": hf_set}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="DatasetDict of the splits train, test; name one split's folder"):
        open_source(str(tmp_path / "dd"))
    assert open_source(str(tmp_path / "dd" / "test")).num_samples == 12


def test_parquet_files_stream_by_row_group(hf_set, tmp_path, fakes):
    folder = tmp_path / "parquet"
    folder.mkdir()
    for part in range(2):
        hf_set.shard(2, part, contiguous=True).to_parquet(str(folder / f"train-{part:05d}-of-00002.parquet"),
                                                           batch_size=3)
    for named in (str(folder), str(folder / "train-*.parquet"), str(folder / "train-{00000..00001}-of-00002.parquet")):
        source = open_source(named)
        assert source.classes == CLASSES and source.num_samples == 12 and len(source.units) == 4  # 3 rows a group
    assert ids_and_labels(source, fakes) == [(i, i % 3) for i in range(12)]
    single = open_source(str(folder / "train-00001-of-00002.parquet"))
    assert ids_and_labels(single, fakes) == [(i, i % 3) for i in range(6, 12)]


def test_parquet_without_class_names_needs_classes_txt(tmp_path, fakes):
    import pyarrow as pa

    blobs = []
    for i in range(4):
        buffer = io.BytesIO()
        Image.fromarray(fakes.image_with_id(i)).save(buffer, format="PNG")
        blobs.append({"bytes": buffer.getvalue(), "path": None})
    table = pa.table({"image": blobs, "label": [0, 1, 0, 1]})
    pq.write_table(table, tmp_path / "plain.parquet")
    with pytest.raises(DataError, match="classes.txt"):
        open_source(str(tmp_path / "plain.parquet"))
    (tmp_path / "classes.txt").write_text("even\nodd\n")
    source = open_source(str(tmp_path / "plain.parquet"))
    assert source.classes == ["even", "odd"] and ids_and_labels(source, fakes) == [(0, 0), (1, 1), (2, 0), (3, 1)]



@pytest.mark.parametrize("stored", ["save_to_disk", "parquet"])
def test_an_image_column_of_paths_or_labels_that_are_names_are_refused_with_the_cast_to_make(hf_set, tmp_path,
                                                                                             stored):
    # each read as far as the reader, which failed on the first batch: a traceback from inside pyarrow or a comparison
    paths = []
    for i, image in enumerate(hf_set["image"]):
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
    of_paths = datasets.Dataset.from_dict({"image": paths, "label": hf_set["label"]}, features=datasets.Features(
        {"image": datasets.Value("string"), "label": datasets.ClassLabel(names=CLASSES)}))
    named = datasets.Dataset.from_dict({"image": hf_set["image"], "label": [CLASSES[i] for i in hf_set["label"]]},
                                       features=datasets.Features({"image": datasets.Image(),
                                                                   "label": datasets.Value("string")}))
    for data, name, told in ((of_paths, "paths", r"the image column 'image' holds string, not an Image feature.*"
                                                 r"dataset\.cast_column\('image', datasets\.Image\(\)\)"),
                             (named, "names", r"the label column 'label' holds string, not integer class ids.*"
                                              r"dataset\.class_encode_column\('label'\)")):
        where = tmp_path / name / ("data.parquet" if stored == "parquet" else "ds")
        where.parent.mkdir()
        data.save_to_disk(str(where)) if stored == "save_to_disk" else data.to_parquet(str(where))
        beside = where.parent if stored == "parquet" else where
        (beside / "classes.txt").write_text("\n".join(CLASSES))  # names beside them change nothing
        with pytest.raises(DataError, match=told):
            open_source(str(where))


def test_without_pyarrow_one_line_names_the_extra(hf_set, tmp_path, monkeypatch, capsys):
    from vitlab.cli import main

    hf_set.save_to_disk(str(tmp_path / "ds"))
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(DataError, match=r'needs pyarrow: pip install -e "\.\[hf\]"'):
        open_source(str(tmp_path / "ds"))
    capsys.readouterr()
    assert main(["train", "--recipe", "demo", "--data", str(tmp_path / "ds"), "--val-split", "0", "--out",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitlab train: error: ") and '".[hf]"' in err[0]
