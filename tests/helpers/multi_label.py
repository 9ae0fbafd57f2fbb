"""A JFT-style multi-label shard set, as the tests of streaming, training and eval write it."""
import io
import tarfile

from PIL import Image


def multi_label_shard(out, labels, per_shard=None):
    """A JFT-style shard set in ``out``: one 8x8 PNG per sample, its .cls the sample's labels of
    classes a, b, c, d ("0,2": two labels), in shards of ``per_shard`` samples (None: one shard)."""
    out.mkdir()
    (out / "classes.txt").write_text("a\nb\nc\nd\n")
    per_shard = per_shard or len(labels)
    for first in range(0, len(labels), per_shard):
        with tarfile.open(out / f"{first // per_shard:04d}.tar", "w") as tar:
            for i in range(first, min(first + per_shard, len(labels))):
                buf = io.BytesIO()
                Image.new("RGB", (8, 8), (i, 0, 0)).save(buf, format="PNG")
                for name, data in ((f"{i:04d}.png", buf.getvalue()), (f"{i:04d}.cls", labels[i].encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return out
