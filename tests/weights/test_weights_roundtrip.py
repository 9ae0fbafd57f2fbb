"""vitlab's own format, timm state dicts, and the errors every loader shares."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vitlab.config import ResNetConfig, ViTConfig
from vitlab.models.posemb import resample_table_1d
from vitlab.models.registry import build_model
from vitlab.weights import WeightsError, load_checked, load_model, save_model, save_official_npz
from vitlab import files

TINY = ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=48, num_heads=2, num_classes=5)


def random_model(cfg):
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def logits(model, size=16, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(torch.randn(2, 3, *((size, size) if isinstance(size, int) else size)))


# ------------------------------------------------------------------------------ native


ALL_KINDS = [
    TINY,
    ViTConfig(**{**TINY.__dict__, "classifier": "gap", "representation_size": 7, "gelu": "exact"}),
    ViTConfig(**{**TINY.__dict__, "posemb": "learned_2d", "posemb_place": "every_layer", "img_size": (16, 24)}),
    ViTConfig(**{**TINY.__dict__, "posemb": "relative"}),
    ViTConfig(**{**TINY.__dict__, "attn_bias": "distance_no_self", "attn_offsets": True, "classifier": "gap"}),
    ViTConfig(**{**TINY.__dict__, "axial": True, "classifier": "gap", "posemb": "learned_2d"}),
    ResNetConfig(layers=(1, 1), num_classes=4, img_size=32),
]


@pytest.mark.parametrize("cfg, as_dir", [(cfg, True) for cfg in ALL_KINDS] + [(TINY, False)],
                         ids=["vit", "gap-prelogits", "2d-every-layer", "relative", "distance-offsets", "axial", "bit",
                              "vit-file"])
def test_save_model_round_trip(tmp_path, cfg, as_dir):
    model = random_model(cfg)
    target = tmp_path / ("run" if as_dir else "model.safetensors")
    written = save_model(model, target)
    assert written.exists() and (not as_dir or (target / "config.json").exists())
    again = load_model(target)
    assert again.cfg == model.cfg and not again.training
    size = cfg.img_size
    assert torch.equal(logits(again, size), logits(model, size))


class Adapter(torch.nn.Module):
    """A LoRA-style wrapper: the layer's output plus a low-rank correction."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base, self.down = base, torch.nn.Linear(base.in_features, 2, bias=False)

    def forward(self, x):
        return self.base(x) + self.down(x).sum(-1, keepdim=True)


@pytest.mark.parametrize("fmt", ["vitlab", "hf", "timm", "official"])
@pytest.mark.parametrize("edit", ["head", "adapter"])
def test_a_model_its_config_does_not_describe_is_refused_before_a_file_is_written(tmp_path, fmt, edit):
    """A head replaced by assignment or an adapter around a layer was saved, the config recording the
    model before: the file could not be loaded again (vitlab's 'do not match the model', transformers'
    size mismatch), or, adapted to the official layout, the save ended in a KeyError."""
    model = random_model(TINY)
    if edit == "head":
        model.head = torch.nn.Linear(32, 3)
    else:
        model.blocks[0].attn.qkv = Adapter(model.blocks[0].attn.qkv)
    target = tmp_path / ("m.npz" if fmt == "official" else "out")
    expected = (r"(?s)^save_model: the model's weights do not match the model its config \(model\.cfg\) describes"
                r".*(head\.weight|blocks\.0\.attn\.qkv\.base\.weight).*model\.reset_classifier\(n\)")
    with pytest.raises(WeightsError, match=expected):
        save_model(model, target, format=fmt)
    assert not target.exists()
    if edit == "head":  # reset_classifier replaces the head and the config together: saved and read back
        model.reset_classifier(3)
        with torch.no_grad():
            model.head.weight.normal_()
        assert torch.equal(logits(load_model(save_model(model, tmp_path / "run")), 16), logits(model, 16))


def test_native_resize_and_new_head(tmp_path):
    model = random_model(TINY)
    save_model(model, tmp_path / "m.safetensors")
    big = load_model(tmp_path / "m.safetensors", img_size=24, num_classes=3, dropout=0.1)
    assert big.cfg.img_size == (24, 24) and big.cfg.num_classes == 3 and big.cfg.dropout == 0.1
    expected = resample_table_1d(model.pos_embed.weight, 1, (4, 4), (6, 6), "bilinear")
    assert torch.equal(big.pos_embed.weight, expected)
    assert not big.head.weight.any() and big.head.weight.shape == (3, 32)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size, new_size", [(16, (16, 24)), ((16, 24), (24, 16)), ((16, 24), (28, 20))])
def test_a_grid_is_resized_to_a_non_square_one_in_2d(tmp_path, size, new_size, mode):
    """A square 4x4 grid loaded at 16x24 (a fine-tune at HxW) and a 4x6 one at 24x16 or 28x20: the patch
    positions are resized as an image, height and width each their own way, the [class] position kept;
    the reference is F.interpolate of the grid laid out by hand (aligned corners for the official
    bilinear, not for Hugging Face's bicubic)."""
    import torch.nn.functional as F

    model = random_model(ViTConfig(**{**TINY.__dict__, "img_size": size, "posemb_resample": mode}))
    save_model(model, tmp_path / "m.safetensors")
    resized = load_model(tmp_path / "m.safetensors", img_size=new_size)
    (gh, gw), (nh, nw) = model.cfg.grid_size, resized.cfg.grid_size
    assert (nh, nw) == (new_size[0] // 4, new_size[1] // 4)
    table = model.pos_embed.weight.detach()  # (1, 1 + gh * gw, D), the patches in raster order
    grid = table[0, 1:].reshape(gh, gw, -1).permute(2, 0, 1).unsqueeze(0)  # (1, D, gh, gw)
    moved = F.interpolate(grid, size=(nh, nw), mode=mode, align_corners=mode == "bilinear")
    expected = torch.cat([table[:, :1], moved[0].permute(1, 2, 0).reshape(1, nh * nw, -1)], dim=1)
    torch.testing.assert_close(resized.pos_embed.weight, expected, rtol=0, atol=1e-6)
    assert logits(resized, new_size).shape == (2, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("posemb", ["learned_1d", "learned_2d"])
def test_half_precision_weights_are_resized_in_float32(tmp_path, dtype, posemb):
    # the float32 model gets the table its float32 values give at the new size (as dynamic_img_size computes
    # it): resampled in the file's own dtype, it was rounded to bf16 (0.4% of the table's values)
    model = random_model(ViTConfig(**{**TINY.__dict__, "posemb": posemb})).to(dtype)
    save_model(model, tmp_path / "m.safetensors")
    big = load_model(tmp_path / "m.safetensors", img_size=24)
    dynamic = load_model(tmp_path / "m.safetensors", dynamic_img_size=True)
    assert torch.equal(big.pos_embed((6, 6)), dynamic.pos_embed((6, 6)))


@pytest.mark.parametrize("size, new_size", [(16, 28), (28, 16), (16, (24, 20))])
def test_resized_offset_bias_attends_as_the_original_at_the_new_size(tmp_path, size, new_size):
    """The distance penalty's offset table, adapted to another grid (cropped, or extended with its
    edge values), gives the bias the original model gives that grid (it clamps its offsets)."""
    cfg = ViTConfig(**{**TINY.__dict__, "img_size": size, "attn_bias": "distance_no_self", "attn_offsets": True})
    model = random_model(cfg)
    save_model(model, tmp_path / "m.safetensors")
    resized = load_model(tmp_path / "m.safetensors", img_size=new_size)
    new_grid = resized.cfg.grid_size
    q = torch.zeros(1, 2, 1 + new_grid[0] * new_grid[1], 16)
    for old, new in zip(model.blocks, resized.blocks):
        if new_grid[0] == new_grid[1]:  # the original takes another grid only when square
            assert torch.equal(new.attn.distance_bias(q), old.attn.distance_bias(q))
        table = new.attn.distance_bias.offset_bias.view(2, 2 * new_grid[0] - 1, 2 * new_grid[1] - 1)
        centre = old.attn.distance_bias.offset_bias.view(2, 2 * cfg.grid_size[0] - 1, 2 * cfg.grid_size[1] - 1)
        assert torch.equal(table[:, new_grid[0] - 1, new_grid[1] - 1], centre[:, cfg.grid_size[0] - 1,
                                                                            cfg.grid_size[1] - 1])


def test_official_round_trip_of_a_vitlab_model(tmp_path):
    model = random_model(TINY)  # tanh GELU, eps 1e-6: vitlab's defaults are the official conventions
    save_official_npz(model, tmp_path / "m.npz")
    again = load_model(tmp_path / "m.npz")
    assert torch.equal(logits(again), logits(model))
    with pytest.raises(WeightsError, match="official layout"):
        save_official_npz(random_model(ViTConfig(**{**TINY.__dict__, "posemb": "relative"})), tmp_path / "r.npz")


# -------------------------------------------------------------------------------- timm


def to_timm(sd):
    """vitlab -> timm names: the inverse of vitlab.weights.timm.RENAMES, written out."""
    renames = {"patch_embed.weight": "patch_embed.proj.weight", "patch_embed.bias": "patch_embed.proj.bias",
               "pos_embed.weight": "pos_embed"}
    return {renames.get(k, k): v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_timm_state_dict_loads(classifier):
    model = random_model(ViTConfig(**{**TINY.__dict__, "gelu": "exact", "classifier": classifier}))
    sd = to_timm(model.state_dict())
    assert "patch_embed.proj.weight" in sd and "pos_embed" in sd
    again = load_model(sd, num_heads=2)
    assert (again.cfg.gelu, again.cfg.ln_eps, again.cfg.classifier) == ("exact", 1e-6, classifier)
    assert torch.equal(logits(again), logits(model))


def test_timm_fc_norm_is_refused_with_the_reason():
    sd = to_timm(random_model(ViTConfig(**{**TINY.__dict__, "classifier": "gap"})).state_dict())
    sd["fc_norm.weight"], sd["fc_norm.bias"] = sd.pop("norm.weight"), sd.pop("norm.bias")
    with pytest.raises(WeightsError, match="after average pooling"):
        load_model(sd, num_heads=2)


def test_timm_class_token_averaged_is_refused_with_the_reason():
    # timm's class_token=True, global_pool="avg": load_timm's docstring said to pass classifier="gap", which was
    # then reported as an unexpected cls_token and a mis-shaped pos_embed; vitlab's "gap" has no [class] token
    sd = to_timm(random_model(TINY).state_dict())
    with pytest.raises(WeightsError, match=r"^classifier='gap' with timm weights that have a \[class\] token"):
        load_model(sd, num_heads=2, classifier="gap")


def test_a_timm_hub_folder_s_mean_and_std_are_taken_into_the_weights(tmp_path):
    """timm's Hub folders state their input scaling in config.json's pretrained_cfg: ImageNet's mean and std
    for DeiT (timm/deit_*.fb_in1k); vitlab gives its models p / 127.5 - 1 and scored such weights on that,
    without a word.  Loaded, the model computes from vitlab's input what timm's computes from its own."""
    import safetensors.torch

    from vitlab.data.transforms import to_float

    model = random_model(ViTConfig(**{**TINY.__dict__, "gelu": "exact", "posemb_resample": "bicubic"}))
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    safetensors.torch.save_file(to_timm(model.state_dict()), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architecture": "deit_tiny_patch16_224", "num_classes": 5, "global_pool": "token",
        "pretrained_cfg": {"tag": "fb_in1k", "mean": mean, "std": std, "num_classes": 5}}))
    pixels = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    timm_input = (pixels.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    with torch.no_grad():
        diff = (load_model(tmp_path, num_heads=2)(to_float(pixels)) - model(timm_input)).abs().max()
    assert diff < 1e-4
    # vitlab's own export states vitlab's scaling in its .timm.json: the weights as they were
    save_model(model, tmp_path / "export.safetensors", format="timm")
    assert torch.equal(logits(load_model(tmp_path / "export.safetensors")), logits(model))


# ------------------------------------------------------------------------------ errors


def test_mismatch_lists_every_bad_key():
    model = build_model(TINY)
    sd = dict(random_model(TINY).state_dict())
    del sd["blocks.0.norm1.bias"], sd["blocks.1.mlp.fc2.weight"]
    sd["blocks.0.attn.extra"] = torch.zeros(1)
    sd["head.weight"] = torch.zeros(6, 32)
    sd["norm.bias"] = torch.zeros(31)
    with pytest.raises(WeightsError) as err:
        load_checked(model, sd)
    msg = str(err.value)
    assert "2 missing key(s): blocks.0.norm1.bias, blocks.1.mlp.fc2.weight" in msg
    assert "1 unexpected key(s): blocks.0.attn.extra" in msg
    assert "head.weight: weights (6, 32), model (5, 32)" in msg
    assert "norm.bias: weights (31,), model (32,)" in msg


def test_timm_mismatch_goes_through_the_same_check():
    sd = to_timm(random_model(TINY).state_dict())
    sd["blocks.1.ls1.gamma"] = torch.ones(32)  # timm layer scale: not in the paper
    sd["blocks.0.mlp.fc2.bias"] = torch.zeros(33)
    with pytest.raises(WeightsError) as err:
        load_model(sd, num_heads=2)
    assert "blocks.1.ls1.gamma" in str(err.value) and "blocks.0.mlp.fc2.bias: weights (33,)" in str(err.value)


def test_unknown_keys_are_named():
    with pytest.raises(WeightsError, match="unrecognised weights.*conv.weight"):
        load_model({"conv.weight": torch.zeros(1)})


@pytest.mark.parametrize("name", ["m.safetensors", "m.npz", "m.pt"])
def test_corrupt_file_gives_a_clear_error(tmp_path, name):
    model = random_model(TINY)
    path = tmp_path / name
    if name.endswith(".safetensors"):
        save_model(model, path)
    elif name.endswith(".npz"):
        save_official_npz(model, path)
    else:
        torch.save(model.state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        load_model(path, name="ViT-Ti/16")


def test_pickled_objects_are_not_loaded(tmp_path):
    torch.save({"weights": torch.zeros(1), "fn": os.getcwd}, tmp_path / "evil.pt")
    with pytest.raises(WeightsError, match="weights_only"):
        load_model(tmp_path / "evil.pt")


def test_failing_save_keeps_the_existing_file(tmp_path, monkeypatch):
    old = random_model(TINY)
    path = save_model(old, tmp_path / "m.safetensors")
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_model(random_model(ViTConfig(**{**TINY.__dict__, "num_classes": 7})), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary file left behind
    assert torch.equal(logits(load_model(path)), logits(old))


@pytest.mark.parametrize("format, out", [("vitlab", "folder"), ("hf", "folder"), ("timm", "m.safetensors")])
def test_a_save_that_fails_between_its_files_keeps_the_old_set(tmp_path, monkeypatch, format, out):
    """Weights and their config (config.json, classes.json, timm's .timm.json) are replaced as a set: a
    failure at the second file (a full disk) left the new weights beside the old config, which loaded
    as neither model or misnamed its classes."""
    cfg = ViTConfig(**{**TINY.__dict__, "posemb_resample": "bicubic"})  # as Hugging Face and timm resample
    old = random_model(cfg)
    save_model(old, tmp_path / out, format=format, class_names=list("abcde"))
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real_new_temporary, calls = files.new_temporary, []

    def failing_at_the_second_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_new_temporary(*args, **kwargs)

    monkeypatch.setattr(files, "new_temporary", failing_at_the_second_file)
    new = random_model(ViTConfig(**{**cfg.__dict__, "num_classes": 7, "depth": 1}))
    with pytest.raises(OSError, match="No space left"):
        save_model(new, tmp_path / out, format=format)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # no temporary file left
    source = tmp_path / out if format == "hf" else next(p for p in tmp_path.rglob("*.safetensors"))
    assert torch.equal(logits(load_model(source)), logits(old))
    # and a save that succeeds replaces the whole set: classes.json of the old weights goes with them
    save_model(new, tmp_path / out, format=format)
    assert torch.equal(logits(load_model(source)), logits(new))
    assert not list(tmp_path.rglob("classes.json")) and not list(tmp_path.rglob(".*.tmp"))


@pytest.mark.parametrize("format, out", [("vitlab", "folder"), ("hf", "folder"), ("timm", "m.safetensors")])
@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_save_that_fails_while_its_files_are_renamed_keeps_the_old_set(tmp_path, monkeypatch, format, out, error):
    """A failure once the set is written, while its files replace the old ones (a full directory, Ctrl-C):
    the files renamed before it were the new set's, the rest the old one's (new config.json, classes.json
    deleted, old weights): the old model was lost, and the folder held neither."""
    cfg = ViTConfig(**{**TINY.__dict__, "posemb_resample": "bicubic"})
    old = random_model(cfg)
    save_model(old, tmp_path / out, format=format, class_names=list("abcde"))
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real_replace = os.replace

    def failing_at_the_weights(src, dst):
        if Path(dst).suffix == ".safetensors":
            raise error
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_at_the_weights)
    new = random_model(ViTConfig(**{**cfg.__dict__, "num_classes": 7, "depth": 1}))
    with pytest.raises(type(error)):
        save_model(new, tmp_path / out, format=format)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing left beside
    source = tmp_path / out if format == "hf" else next(p for p in tmp_path.rglob("*.safetensors"))
    assert torch.equal(logits(load_model(source)), logits(old))


def test_a_folder_save_keeps_a_config_json_that_describes_no_model(tmp_path):
    # a save into a training run's folder replaced its config.json (the recipe) and its model.safetensors
    model = random_model(TINY)
    for config, what in (({"recipe": "demo", "optim": {"lr": 0.1}}, "a training run's config"),
                         (["not", "a", "model"], "not a model's config")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        for format in ("vitlab", "hf", "timm"):
            with pytest.raises(WeightsError, match=f"its config.json is {what}, which saving a model there would "
                                                   "replace, and the folder's model.safetensors with it"):
                save_model(model, tmp_path, format=format)
            assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    # a file named in the folder is written, and a model folder is replaced, as before
    save_model(model, tmp_path / "model.safetensors")
    save_model(model, tmp_path / "hf", format="hf")
    save_model(random_model(ViTConfig(**{**TINY.__dict__, "num_classes": 3})), tmp_path / "hf")
    assert load_model(tmp_path / "hf").cfg.num_classes == 3


def test_bare_vitlab_state_dict_needs_heads():
    sd = random_model(TINY).state_dict()
    with pytest.raises(WeightsError, match="name="):
        load_model(sd)
    assert load_model(sd, num_heads=2).cfg.num_heads == 2
    assert np.isclose(load_model(sd, num_heads=2).cfg.ln_eps, 1e-6)


def test_run_directory_with_its_own_config_json(tmp_path):
    model = random_model(TINY)
    save_model(model, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"model": "ViT-Ti/16", "lr": 0.01}')  # a training config
    assert torch.equal(logits(load_model(tmp_path)), logits(model))


@pytest.mark.parametrize("format, name", [("vitlab", "model.safetensors"), ("official", "model.npz"),
                                          ("timm", "model.pth")])
def test_a_file_is_saved_into_a_new_folder(tmp_path, format, name):
    """A file format's folder is made, as a vitlab-format folder is (and as `vitlab convert`'s
    output check promises): it was the OS's "No such file or directory" naming a hidden temporary file."""
    path = save_model(random_model(TINY), tmp_path / "new" / "deeper" / name, format=format)
    assert path == tmp_path / "new" / "deeper" / name and path.is_file()


def test_a_file_is_not_saved_over_a_folder(tmp_path):
    folder = tmp_path / "model.safetensors"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="model.safetensors is a folder; expected a file") as err:
        save_model(random_model(TINY), folder)
    assert ".tmp" not in str(err.value)  # the caller's path, not the temporary file's
    assert list(tmp_path.iterdir()) == [folder] and not any(folder.iterdir())


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_weights_take_the_mode_the_umask_gives_a_new_file(tmp_path, umask, mode):
    # the staged file was mkstemp's, 0600 whatever the umask, and the renamed weights kept it: a group
    # the run's folder is shared with could read its config.json but not load its weights
    model = build_model(ViTConfig(img_size=8, patch_size=4, width=8, depth=1, num_heads=2, mlp_dim=16,
                                  num_classes=2))
    before = os.umask(umask)
    try:
        save_model(model, tmp_path / "m")
    finally:
        os.umask(before)
    for file in (tmp_path / "m").iterdir():
        assert file.stat().st_mode & 0o777 == mode, file.name


def test_a_timm_sidecar_of_another_file_of_the_same_stem_is_not_read(tmp_path):
    """x.pth and x.safetensors share x.timm.json, which the later timm export wrote: read for x.pth, its
    4 heads made the 2-head weights another model (other logits without a word).  The sidecar names the
    file it was written with; for another file it is not read, and the heads are asked for."""
    from vitlab.weights import HeadsUnknownError

    two, four = random_model(TINY), random_model(ViTConfig(**{**TINY.__dict__, "num_heads": 4}))
    save_model(two, tmp_path / "x.pth", format="timm", class_names=["a", "b", "c", "d", "e"])
    save_model(four, tmp_path / "x.safetensors", format="timm")
    with pytest.raises(HeadsUnknownError):
        load_model(tmp_path / "x.pth")
    # read as a bare timm file: its heads given, and vit_jax's GELU (timm's is exact), which the sidecar recorded
    assert torch.equal(logits(load_model(tmp_path / "x.pth", num_heads=2, gelu="tanh"), 16), logits(two, 16))
    assert torch.equal(logits(load_model(tmp_path / "x.safetensors"), 16), logits(four, 16))
    # a pair renamed together names a file that is not there: its sidecar is still its own
    (tmp_path / "x.safetensors").rename(tmp_path / "y.safetensors")
    (tmp_path / "x.timm.json").rename(tmp_path / "y.timm.json")
    assert torch.equal(logits(load_model(tmp_path / "y.safetensors"), 16), logits(four, 16))
