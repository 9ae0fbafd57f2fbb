"""Bad images and odd data sets: each file is converted to the right pixels or skipped,
counted and reported; loading never stops on one bad file."""
import io
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitlab.data.memory import decode_image, load_in_memory, to_rgb
from vitlab.data.stream import StreamLoader, open_source
from vitlab.data.sources import DataError, scan_image_folder


def encode(img, fmt="PNG", **kw):
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kw)
    return buffer.getvalue()


def decode(data, size=None):
    return decode_image(io.BytesIO(data), size)


def test_rgba_keeps_the_colour_under_the_alpha():
    rgba = np.array([[[10, 20, 30, 0], [40, 50, 60, 255]]], np.uint8)
    out = decode(encode(Image.fromarray(rgba, "RGBA")))
    assert out.tolist() == [[[10, 20, 30], [40, 50, 60]]]


def test_palette_image_with_transparency():
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    img.putdata([0, 1])
    out = decode(encode(img, transparency=0))
    assert out.tolist() == [[[255, 0, 0], [0, 0, 255]]]


def test_16_bit_grayscale_is_scaled_not_clipped():
    wide = np.array([[0, 257, 32896], [65535, 1000, 65278]], np.uint16)
    data = encode(Image.fromarray(wide))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    out = decode(data)
    assert out[:, :, 0].tolist() == [[0, 1, 128], [255, 4, 254]]
    assert (out[:, :, 0] == out[:, :, 1]).all() and (out[:, :, 1] == out[:, :, 2]).all()


def test_32_bit_integer_image_is_clipped_to_16_bits_then_scaled():
    img = Image.fromarray(np.array([[-5, 70000, 514]], np.int32), "I")
    assert to_rgb(img)[0, :, 0].tolist() == [0, 255, 2]


def test_grayscale_bilevel_and_la():
    assert decode(encode(Image.fromarray(np.array([[0, 77, 255]], np.uint8), "L")))[0].tolist() == [
        [0, 0, 0], [77, 77, 77], [255, 255, 255]]
    bits = Image.new("1", (2, 1))
    bits.putdata([0, 255])
    assert decode(encode(bits))[0].tolist() == [[0, 0, 0], [255, 255, 255]]
    la = Image.fromarray(np.array([[[90, 0], [91, 255]]], np.uint8), "LA")
    assert decode(encode(la))[0].tolist() == [[90, 90, 90], [91, 91, 91]]


def test_cmyk():
    cmyk = Image.frombytes("CMYK", (3, 1), bytes([0, 0, 0, 0, 255, 0, 0, 0, 0, 0, 0, 255]))
    out = decode(encode(cmyk, "TIFF"))
    assert out[0].tolist() == [[255, 255, 255], [0, 255, 255], [0, 0, 0]]


def test_one_pixel_image_resized():
    out = decode(encode(Image.fromarray(np.array([[[9, 99, 199]]], np.uint8))), size=(4, 3))
    assert out.shape == (4, 3, 3) and (out == [9, 99, 199]).all()


def test_decompression_bomb_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    over = encode(Image.new("RGB", (12, 12)))     # 144 pixels: PIL warns; vitlab refuses
    far_over = encode(Image.new("RGB", (20, 20)))  # 400 pixels: PIL itself refuses
    for data in (over, far_over):
        with pytest.raises(DataError, match="decompression-bomb limit"):
            decode(data)
    assert decode(encode(Image.new("RGB", (10, 10)))).shape == (10, 10, 3)


@pytest.mark.parametrize("data", [
    b"", b"not an image", b"\xff\xd8\xff\xe0" + b"\0" * 20, b"\x89PNG\r\n\x1a\n" + b"\0" * 30, b"GIF89a",
])
def test_not_an_image_is_a_data_error(data):
    with pytest.raises(DataError, match="not a decodable image"):
        decode(data)


def test_error_names_the_file(tmp_path):
    (tmp_path / "x.jpg").write_bytes(b"nope")
    with pytest.raises(DataError, match=r"x\.jpg: not a decodable image: UnidentifiedImageError"):
        decode_image(str(tmp_path / "x.jpg"))
    with pytest.raises(DataError, match=r"missing\.png: no such file"):
        decode_image(str(tmp_path / "missing.png"))
    (tmp_path / "pictures").mkdir()
    with pytest.raises(DataError, match=r"pictures: a folder, not an image file \(a shell pattern names its images: "):
        decode_image(str(tmp_path / "pictures"))


def test_a_file_that_is_no_image_is_refused_in_the_same_words_by_every_reader(tmp_path, fakes):
    """PIL names the file it cannot identify: read from an archive, a shard or a Hugging Face set (its
    bytes), the reason said and cached was "cannot identify image file <_io.BytesIO object at 0x7f...>",
    an address in place of the file the line names already, where a folder's said the path again."""
    from vitlab.data.decode import SampleCrop, decode_crop

    root = tmp_path / "set"
    _png(root / "a" / "ok.png", 10)
    _png(root / "b" / "ok.png", 20)
    (root / "b" / "zero.jpg").write_bytes(b"")
    (root / "b" / "text.jpg").write_bytes(b"hello, not an image")
    said = "not a decodable image: UnidentifiedImageError: cannot identify image file"
    for source in (root, fakes.make_tar(root, tmp_path / "set.tar")):
        data = load_in_memory(source, cache_dir=tmp_path / "cache", workers=1)
        assert [(os.path.basename(where), reason) for where, reason in data.skipped] == [
            ("text.jpg", said), ("zero.jpg", said)]
    for data in (b"", b"hello, not an image"):
        with pytest.raises(DataError) as raised:
            decode_crop(data, SampleCrop((4, 4)))
        assert str(raised.value) == said
        with pytest.raises(DataError) as raised:
            decode(data)
        assert str(raised.value) == said
    with pytest.raises(DataError) as raised:
        decode_image(str(root / "b" / "zero.jpg"))
    assert str(raised.value) == f"{root / 'b' / 'zero.jpg'}: {said}"


def _png(path, value, mode="RGB", size=(4, 4)):
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (*size, 3) if mode == "RGB" else size
    Image.fromarray(np.full(shape, value, np.uint8), mode).save(path)


def test_a_data_set_of_every_kind_of_bad_file(tmp_path, caplog):
    """Every bad file is skipped and counted exactly; every good one is loaded right."""
    root = tmp_path / "data"
    _png(root / "a" / "ok.png", 10)
    _png(root / "a" / "gray.png", 20, "L")
    _png(root / "b" / "ok.png", 30)                        # the same name in another class
    _png(root / "c" / "only.png", 40)                      # a class with one image
    (root / "empty").mkdir()                               # an empty class folder
    good_jpeg = encode(Image.fromarray(np.full((4, 4, 3), 50, np.uint8)), "JPEG")
    (root / "a" / "truncated.jpg").write_bytes(good_jpeg[: len(good_jpeg) // 2])
    png = bytearray(encode(Image.fromarray(np.full((4, 4, 3), 60, np.uint8))))
    png[-20] ^= 0xFF                                       # inside IDAT: a CRC mismatch
    (root / "b" / "crc.png").write_bytes(bytes(png))
    (root / "b" / "text.png").write_bytes(b"just text")    # not an image, with an image's name
    (root / "c" / "empty.jpg").write_bytes(b"")
    (root / "c" / "notes.txt").write_text("not an image") # ignored by extension, counted
    with caplog.at_level(logging.WARNING):
        data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert data.classes == ["a", "b", "c", "empty"]
    assert data.labels.tolist() == [0, 0, 1, 2]
    assert data.images[:, 0, 0, 0].tolist() == [20, 10, 30, 40]
    assert sorted(os.path.relpath(p, root) for p, _ in data.skipped) == [
        "a/truncated.jpg", "b/crc.png", "b/text.png", "c/empty.jpg"]
    assert all(reason.startswith("not a decodable image: ") for _, reason in data.skipped)
    assert "skipped 4 unreadable image(s) of 8" in caplog.text
    assert "1 class folder(s) hold no images: empty" in caplog.text
    assert "ignored 1 file(s) that are not images by their extension (first: c/notes.txt" in caplog.text
    assert scan_image_folder(root).ignored == ("c/notes.txt",)


def test_a_link_to_nothing_is_an_unreadable_image_not_the_end_of_the_run(tmp_path):
    """A link whose target is gone (a tree of links to a set that moved): the cache key's stat of
    it ended the in-memory load with a bare "[Errno 2] No such file or directory", where a streamed
    read skipped it and counted it."""
    root = tmp_path / "data"
    _png(root / "a" / "ok.png", 10)
    _png(root / "b" / "ok.png", 30)
    (root / "a" / "gone.png").symlink_to(tmp_path / "moved" / "x.png")
    data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
    assert data.images[:, 0, 0, 0].tolist() == [10, 30]
    assert [(os.path.relpath(p, root), reason) for p, reason in data.skipped] == [("a/gone.png", "no such file")]


def test_a_folder_listed_again_is_warned_of_once_until_it_changes(tmp_path, caplog, monkeypatch):
    """A run lists its folder for its size, its cache key and its decoding, by the user's
    spelling and by its real path: each warning about the tree is said once; a change to the
    tree's images is told again."""
    from vitlab.data.memory import CACHE_VERSION
    from vitlab.data.sources import source_key
    from vitlab.train.inputs import count_images

    root = tmp_path / "tree"
    _png(root / "a" / "x.png", 20)
    (root / "empty").mkdir()
    (root / "a" / "notes.txt").write_text("not an image")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert count_images("tree") == 1
        data = load_in_memory("tree", cache_dir=tmp_path / "cache", workers=0)
        # the key of the folder's real path, whatever its spelling (and of the decoding)
        assert data.key == f"{source_key('tree')}-v{CACHE_VERSION}"
        load_in_memory(root, cache_dir=tmp_path / "cache", workers=0)
    assert caplog.text.count("1 class folder(s) hold no images: empty") == 1
    assert caplog.text.count("not images by their extension") == 1
    assert "tree: 1 class folder(s)" in caplog.text  # the spelling the user gave, first
    caplog.clear()
    _png(root / "a" / "y.png", 30)
    with caplog.at_level(logging.WARNING):
        load_in_memory(root, cache_dir=tmp_path / "cache", workers=0)
    assert caplog.text.count("1 class folder(s) hold no images: empty") == 1


@pytest.mark.parametrize("layout", ["tree", "tree/train"])
def test_a_process_that_counts_and_lists_a_folder_again_sees_it_changed(tmp_path, monkeypatch, layout):
    """The per-process caches of a source's count, listing and opened stream (a run resolves
    each more than once) follow a change to the folder's images, and the working folder a
    relative name is read in: a notebook's second run trains on what is there now."""
    from vitlab.data.stream import scan_folder
    from vitlab.train.inputs import count_images, opened_source

    root = tmp_path / layout
    _png(root / "a" / "x.png", 20)
    _png(root / "b" / "x.png", 30)
    monkeypatch.chdir(tmp_path)
    assert count_images("tree") == 2 and len(scan_folder("tree")) == 2 and opened_source("tree").num_samples == 2
    assert count_images("tree") == 2  # unchanged: from the cache
    _png(root / "b" / "y.png", 40)
    assert count_images("tree") == 3 and len(scan_folder("tree")) == 3 and opened_source("tree").num_samples == 3
    (root / "a" / "x.png").unlink()
    assert count_images("tree") == 2 and len(scan_folder("tree")) == 2
    elsewhere = tmp_path / "elsewhere"
    _png(elsewhere / "tree" / "c" / "z.png", 50)
    monkeypatch.chdir(elsewhere)  # the same name, another folder
    assert count_images("tree") == 1 and scan_folder("tree").classes == ["c"]


@pytest.mark.parametrize("decoded_first", [False, True])
@pytest.mark.parametrize("layout", ["tree", "tree/train"])
def test_the_cached_listing_and_the_decoded_copy_see_the_same_images_below_a_class_folder(tmp_path, monkeypatch,
                                                                                         layout, decoded_first):
    """Images in a folder below a class folder (a/extra/x.png) are the class's (ImageFolder's rule, both
    listings'), but one added there, or removed, since the process listed the tree was missed by the
    per-process listing (the count, the streamed folder: its key read the top levels' times only), while the
    decoded copy's key (``source_key``) lists the tree again: a notebook's second run counted and streamed
    the images of before and decoded those of now.  Both give the same images, whichever reads first."""
    from vitlab.data.stream import scan_folder
    from vitlab.train.inputs import count_images, opened_source

    root = tmp_path / layout
    for name in ("a/x.png", "a/extra/y.png", "a/extra/deeper/z.png", "b/x.png"):
        _png(root / name, 20)
    monkeypatch.chdir(tmp_path)

    def listed() -> list[str]:
        return list(scan_folder("tree").paths)

    def decoded() -> list[int]:  # the images of the decoded copy, by class (it keeps no paths)
        return np.bincount(load_in_memory("tree", cache_dir=tmp_path / "cache", workers=0).labels.numpy()).tolist()

    def agree() -> int:
        first = decoded() if decoded_first else None
        paths = listed()
        assert paths == list(scan_image_folder("tree").paths)  # as listed afresh: what the decoded copy's key lists
        assert (first or decoded()) == np.bincount(scan_folder("tree").labels).tolist()
        assert count_images("tree") == opened_source("tree").num_samples == len(paths)
        return len(paths)

    assert agree() == 4
    _png(root / "a" / "extra" / "deeper" / "w.png", 30)  # added below a class folder
    assert agree() == 5
    (root / "a" / "extra" / "y.png").unlink()
    assert agree() == 4
    _png(root / "b" / "more" / "v.png", 40)  # a new folder below a class folder
    _png(root / "b" / "more" / "u.png", 50)
    assert agree() == 6 and any(path.endswith("b/more/u.png") for path in listed())


def test_an_archives_count_is_the_images_its_listing_finds(tmp_path):
    """An archive's images were counted as every image member: macOS's __MACOSX/._x.png beside each image,
    hidden files and images beside the class folders, which its listing leaves out, and a name written
    twice, counted twice (a tar made on a Mac counted twice its images: the memory estimate, and whether
    "auto" streams it, read that count); links to its images, which the listing reads, went uncounted."""
    import io
    import tarfile

    from vitlab.data.sources import read_image_archive
    from vitlab.train.inputs import count_images

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = buffer.getvalue()
    archive = tmp_path / "set.tar"
    with tarfile.open(archive, "w") as tar:
        def add(name, kind=tarfile.REGTYPE, link=""):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(png) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(png) if kind == tarfile.REGTYPE else None)

        for name in ("./train/a/1.png", "./train/a/extra/2.png", "./train/b/1.png", "./train/b/1.png",
                     "./train/a/.3.png", "./__MACOSX/train/a/._1.png", "./train/b/.ipynb_checkpoints/4.png"):
            add(name)
        add("./train/b/5.png", tarfile.SYMTYPE, "1.png")  # a link to an image beside it
    listed = len(read_image_archive(archive)[0])
    assert listed == 4 and count_images(str(archive)) == listed


def test_an_archives_count_is_the_samples_its_reader_yields_whatever_its_odd_members(tmp_path):
    """The count and the reader share one rule of which members are images (``_archive_members``): each
    restating it, links by an image's name to no image (dangling, to a text file), which the reader skips,
    were counted, so the count exceeded the samples read."""
    import io
    import tarfile

    from vitlab.data.sources import count_archive_images, read_image_archive

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = buffer.getvalue()
    archive = tmp_path / "odd.tar"
    with tarfile.open(archive, "w") as tar:
        def add(name, kind=tarfile.REGTYPE, link="", data=png):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        for name in ("a/1.png", "a/._1.png", "__MACOSX/a/._1.png", "b/2.jpg", "top.png", "a/.DS_Store"):
            add(name)
        add("b/notes.txt", data=b"not an image")
        add("a/folder.png", tarfile.DIRTYPE)
        add("b/dangling.png", tarfile.SYMTYPE, "missing.png")
        add("b/text.png", tarfile.SYMTYPE, "notes.txt")
        add("b/outside.png", tarfile.SYMTYPE, "../../elsewhere.png")
        add("b/fifo.png", tarfile.FIFOTYPE)
        add("b/same.png", tarfile.SYMTYPE, "2.jpg")  # a link to an image: that image
        add("b/hard.png", tarfile.LNKTYPE, "a/1.png")
    samples = read_image_archive(archive)[1]
    assert len(samples) == 4 and count_archive_images(archive) == len(samples)


@pytest.mark.parametrize("named", ["pattern", "glob", "folder"])
def test_a_process_that_opens_shards_again_sees_them_written_again(tmp_path, named):
    """Shards written again under the same names since this process opened them are another set: a
    brace pattern or a glob was opened once per process whatever its files became, and so was a folder
    whose shards were written over in place (its own time unchanged); the opened source's cache key
    named the earlier shards, and their held-out part decoded before was read from the cache for these."""
    import shutil

    from vitlab.data.shards import pack_shards
    from vitlab.train.inputs import count_images, opened_source

    for name, base in (("a", 0), ("b", 100)):
        for i in range(4):
            _png(tmp_path / name / f"c{i % 2}" / f"{i}.png", base + i)
    shards, other = tmp_path / "shards", tmp_path / "other"
    pack_shards(tmp_path / "a", shards, samples_per_shard=2)
    pack_shards(tmp_path / "b", other, samples_per_shard=2)  # other images, the same names, sizes and classes
    source = {"pattern": f"{shards}/shard-{{000000..000001}}.tar", "glob": f"{shards}/*.tar",
              "folder": str(shards)}[named]
    first = opened_source(source)
    assert opened_source(source) is first and count_images(source) == 4  # unchanged: from the cache
    for shard in sorted(other.glob("*.tar")):
        shutil.copyfile(shard, shards / shard.name)  # written over in place: the folder's time unchanged
    again = opened_source(source)
    assert again.key == open_source(source).key != first.key
    (shards / "shard-000001.tar").unlink()  # a pattern's file gone: said as the source is opened again
    if named == "pattern":
        with pytest.raises(DataError, match="1 of 2 files missing"):
            opened_source(source)
    else:
        assert count_images(source) == 2 and opened_source(source).num_samples == 2


def test_non_utf8_file_and_folder_names(tmp_path):
    root = tmp_path / "data"
    raw = os.fsencode(root)
    os.makedirs(raw + b"/caf\xe9")                                   # latin-1, not UTF-8
    os.makedirs(raw + b"/dog")
    for name, value in ((b"/caf\xe9/\xff\xfe.png", 11), (b"/dog/ok.png", 22)):
        with open(raw + name, "wb") as f:
            f.write(encode(Image.fromarray(np.full((2, 2, 3), value, np.uint8))))
    with open(raw + b"/dog/\xfe.png", "wb") as f:
        f.write(b"broken")
    for _ in range(2):  # decoded, then read back from the cache
        data = load_in_memory(root, cache_dir=tmp_path / "cache", workers=1)
        assert data.classes == [os.fsdecode(b"caf\xe9"), "dog"]
        assert data.images[:, 0, 0, 0].tolist() == [11, 22]
        assert [os.fsencode(p)[-6:] for p, _ in data.skipped] == [b"/\xfe.png"]
    streamed = StreamLoader(open_source(str(root)), 2, image_size=2, shuffle_buffer=0, workers=0)
    x, y = next(iter(streamed))  # read image by image: the undecodable one is left out
    assert sorted(x[:, 0, 0, 0].tolist()) == [11, 22] and sorted(y.tolist()) == [0, 1]


def _odd_set(root):
    """Write into ``root``'s class folders ``a`` and ``b`` the files users have, every one of its own
    bytes; returns (the images, the unreadable files), as paths relative to ``root``."""
    rng = np.random.default_rng(0)

    def pixels(w=48, h=32):
        y, x = np.mgrid[0:h, 0:w]
        return np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1),
                         rng.integers(0, 256, (h, w))], -1).astype(np.uint8)

    a, b = root / "a", root / "b"
    a.mkdir(parents=True)
    b.mkdir()
    for orientation in (6, 8):  # a camera's portrait photo: the pixels stored sideways, the EXIF tag says so
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(pixels()).save(a / f"exif{orientation}.jpg", exif=exif.tobytes(), quality=95)
    Image.fromarray(pixels()).convert("CMYK").save(a / "cmyk.jpg", quality=95)
    Image.fromarray(pixels()[:, :, 2]).save(a / "gray.png")
    Image.fromarray(pixels()[:, :, 1:].copy(), "LA").save(a / "la.png")
    Image.fromarray(pixels()).convert("P", palette=Image.ADAPTIVE, colors=16).save(a / "palette.png", transparency=0)
    Image.fromarray(np.dstack([pixels(), pixels()[:, :, 2]]), "RGBA").save(a / "rgba.png")
    Image.fromarray(pixels()[:, :, 2].astype(np.uint16) * 257).save(a / "gray16.png")
    Image.fromarray(pixels()).save(b / "lossless.webp", lossless=True)
    frames = [Image.fromarray(np.full((32, 48, 3), v, np.uint8)) for v in (40, 200)]
    frames[0].save(b / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    Image.fromarray(pixels(1, 1)).save(b / "one.png")
    Image.fromarray(pixels(4000, 20)).save(b / "wide.jpg", quality=95)
    for name in ("upper.JPG", "upper.JPEG", "upper.PNG"):
        Image.fromarray(pixels()).save(b / name, "PNG" if name.endswith("PNG") else "JPEG")
    whole = io.BytesIO()
    Image.fromarray(pixels(480, 320)).save(whole, "JPEG")
    (b / "truncated.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    (b / "zero.jpg").write_bytes(b"")
    (b / "text.jpg").write_bytes(b"a text file named .jpg")
    (b / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (b / "._lossless.webp").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X        ")  # macOS's resource fork
    unreadable = ["b/text.jpg", "b/truncated.jpg", "b/zero.jpg"]
    images = sorted(f"{p.parent.name}/{p.name}" for p in root.glob("*/*") if not p.name.startswith("."))
    return [i for i in images if i not in unreadable], unreadable


ODD_SIZE = (16, 24)
READERS = ["folder in memory", "its cached copy", "archive in memory", "streamed folder", "streamed archive",
           "shards", "shards in memory", "Hugging Face", "Hugging Face in memory"]


def _read_by(reader, root, tmp_path, fakes):
    """({name: (H, W, 3) pixels at ODD_SIZE}, [names left out as unreadable]) of the set at ``root``
    read as ``reader`` reads it, names relative to ``root``."""
    import tarfile

    from vitlab.data.decode import decode_crops
    from vitlab.data.shards import pack_shards
    from vitlab.data.stream import reader_crop

    by_bytes = {p.read_bytes(): f"{p.parent.name}/{p.name}" for p in root.glob("*/*")}
    name = lambda where: "/".join(where.split("/")[-2:])  # noqa: E731 - <class>/<file>
    archive = tmp_path / "set.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:  # as a zip made on macOS and packed again holds it
        tar.add(root, root.name)
        fakes.add_bytes(tar, f"__MACOSX/{root.name}/b/._lossless.webp", b"\0\5\26\7")
    source = {"streamed folder": root, "streamed archive": archive}.get(reader)
    if reader.startswith("shards"):
        pack_shards(root, tmp_path / "shards", samples_per_shard=5)
        source = tmp_path / "shards"
    elif reader.startswith("Hugging Face"):
        datasets = pytest.importorskip("datasets", reason='the hf extra: pip install -e ".[hf]"')
        files = sorted(p for p in root.glob("*/*") if not p.name.startswith("."))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
        datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": None} for p in files],
                                    "label": [int(p.parent.name == "b") for p in files]},
                                   features=features).save_to_disk(str(tmp_path / "hf"))
        source = tmp_path / "hf"
    cache = tmp_path / "cache"
    if reader.endswith(("in memory", "cached copy")):
        if reader == "its cached copy":
            load_in_memory(root, ODD_SIZE, cache_dir=cache, workers=1)
        data = load_in_memory(source or (archive if reader.startswith("archive") else root), ODD_SIZE,
                              cache_dir=cache, workers=1)
        skipped = [where for where, _ in data.skipped]
        if source is None:  # a folder or an archive: the listing's order
            names = [name(p) for p in scan_image_folder(root).paths if name(p) not in {name(s) for s in skipped}]
        else:  # a streamed source's samples, in stored order: named by their bytes
            samples = [(key, data) for key, data, _ in open_source(str(source), cache).samples()]
            names = [by_bytes[blob] for key, blob in samples if key not in skipped]
            skipped = [by_bytes[blob] for key, blob in samples if key in skipped]
        return dict(zip(names, data.images.permute(0, 2, 3, 1).numpy())), sorted(map(name, skipped))
    samples = list(open_source(str(source), cache).samples())
    decoded = decode_crops([payload for _, payload, _ in samples], reader_crop(None, ODD_SIZE, draft=False))
    names = [by_bytes[Path(p).read_bytes() if isinstance(p, str) else p] for _, p, _ in samples]
    return ({n: d for n, d in zip(names, decoded) if not isinstance(d, DataError)},
            sorted(n for n, d in zip(names, decoded) if isinstance(d, DataError)))


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_lists_and_decodes_an_odd_file_as_predict_does(reader, tmp_path, fakes):
    """Each way vitlab reads a set gives each image the pixels `vitlab predict` (and eval, inspect,
    fewshot: ``decode_image``) gives it at the same size, and reads and leaves out the same files.
    The rule, torchvision's and timm's ImageFolder's (PIL's ``convert("RGB")``): the pixels as stored,
    EXIF orientation applied by none; alpha dropped, the colour under it kept; a palette's colours; an
    animation's first frame; 16-bit grayscale scaled to 8 bits; upper-case extensions are images;
    hidden files, macOS's ._ files and __MACOSX/ are none; a file that cannot be decoded is left out
    and named."""
    root = tmp_path / "set"
    images, unreadable = _odd_set(root)
    predicted = {name: decode_image(str(root / name), ODD_SIZE) for name in images}
    exif = Image.open(root / "a" / "exif6.jpg")
    assert exif.getexif()[0x0112] == 6 and decode_image(str(root / "a" / "exif6.jpg")).shape == (32, 48, 3)
    assert np.array_equal(decode_image(str(root / "a" / "exif6.jpg")), np.asarray(exif.convert("RGB")))
    assert (predicted["b/animated.gif"] == 40).all()  # the first frame
    read, left_out = _read_by(reader, root, tmp_path, fakes)
    assert sorted(read) == images and left_out == unreadable
    assert [name for name in images if not np.array_equal(read[name], predicted[name])] == []
