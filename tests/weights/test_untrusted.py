"""Weights from untrusted sources: pickles never run, damaged files never half-load,
hostile configs are refused before anything is allocated."""
import json
import random
import zipfile

import numpy as np
import pytest
import safetensors.torch
import torch

from vitlab.config import ConfigError, ViTConfig, config_to_json
from vitlab.models.registry import build_model
from vitlab.weights import WeightsError, load_model, native, save_model, save_official_npz

TINY = ViTConfig(img_size=16, patch_size=8, width=16, depth=1, mlp_dim=32, num_heads=2, num_classes=3)
X = torch.linspace(-1, 1, 3 * 16 * 16).reshape(1, 3, 16, 16)


def random_model():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


class Payload:
    """Unpickling this writes a marker file: the marker must never appear."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("legacy", [False, True])
def test_malicious_torch_pickle_is_refused_and_never_runs(tmp_path, legacy):
    marker = tmp_path / "pwned"
    torch.save({"patch_embed.weight": torch.zeros(1), "evil": Payload(marker)}, tmp_path / "evil.pt",
               _use_new_zipfile_serialization=not legacy)
    with pytest.raises(WeightsError, match=r"evil\.pt could not be read by torch\.load\(weights_only=True\)"):
        load_model(tmp_path / "evil.pt")
    assert not marker.exists()


def test_malicious_pickle_in_a_hugging_face_folder(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "vit", "num_attention_heads": 2}))
    torch.save({"evil": Payload(marker)}, tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="weights_only"):
        load_model(tmp_path / "hf")
    assert not marker.exists()


def test_pickled_object_array_in_npz_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "evil.npz", a=np.array([Payload(marker)], dtype=object))
    with pytest.raises(WeightsError, match=r"evil\.npz is not a readable \.npz file") as refused:
        load_model(tmp_path / "evil.npz")
    assert not marker.exists()
    assert "never unpickled" in str(refused.value) and "allow_pickle" not in str(refused.value)
    (tmp_path / "text.npz").write_text("not an archive")  # numpy would try it as a pickle and advise doing so
    with pytest.raises(WeightsError, match=r"text\.npz .*: not a zip archive of arrays") as refused:
        load_model(tmp_path / "text.npz")
    assert "allow_pickle" not in str(refused.value)


def _save(model, path):
    if path.suffix == ".safetensors":
        save_model(model, path)
    elif path.suffix == ".npz":
        save_official_npz(model, path)
    else:
        torch.save(model.state_dict(), path)
    return path


FORMATS = ["m.safetensors", "m.npz", "m.pt"]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, 0.99])
def test_truncated_file_is_a_clear_error(tmp_path, name, keep):
    path = _save(random_model(), tmp_path / name)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(WeightsError, match=r"m\.\w+.*(truncated or corrupt|could not be read)"):
        load_model(path, num_heads=2)


@pytest.mark.parametrize("name", FORMATS)
def test_bit_flips_are_errors_never_a_different_model(tmp_path, name):
    """30 random single-bit flips per format: each is an error, or (a flip in metadata that
    carries no weight, such as a zip timestamp) loads the very same model."""
    model = random_model()
    path = _save(model, tmp_path / name)
    reference = model(X)
    data = path.read_bytes()
    rng = random.Random(name)
    outcomes = {"error": 0, "same": 0}
    for _ in range(30):
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(flipped))
        try:
            loaded = load_model(path, num_heads=2)
        except WeightsError:
            outcomes["error"] += 1
            continue
        assert torch.equal(loaded(X), reference), "a flipped bit loaded silently as a different model"
        outcomes["same"] += 1
    assert outcomes["error"] >= 20


@pytest.mark.parametrize("name", FORMATS)
def test_a_flip_inside_the_weights_is_caught(tmp_path, name):
    """A flip in the middle of the largest tensor: no container structure is hit, only data."""
    model = random_model()
    path = _save(model, tmp_path / name)
    data = bytearray(path.read_bytes())
    needle = model.state_dict()["blocks.0.mlp.fc1.weight"].numpy()
    if name.endswith(".npz"):  # stored transposed, as vit_jax kernels are
        needle = np.ascontiguousarray(needle.T)
    at = bytes(data).find(needle.tobytes()[:64])
    assert at > 0
    data[at + 40] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        load_model(path, num_heads=2)


def test_checksum_is_recorded_and_old_files_without_it_still_load(tmp_path):
    model = random_model()
    path = save_model(model, tmp_path / "m.safetensors")
    assert len(native.read_safetensors_metadata(path)[native.CHECKSUM_KEY]) == 64
    old = tmp_path / "old.safetensors"  # as save_model wrote files before the checksum
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, old,
                                metadata={native.CONFIG_KEY: config_to_json(TINY)})
    assert torch.equal(load_model(old)(X), model(X))


def _file_with_config(tmp_path, config_text):
    path = tmp_path / "hostile.safetensors"
    safetensors.torch.save_file({"patch_embed.weight": torch.zeros(2)}, path,
                                metadata={native.CONFIG_KEY: config_text})
    return path


@pytest.mark.parametrize("patch, match", [
    ({"width": 10**9}, r"width=1000000000: must be at most 65536"),
    ({"depth": 10**9}, r"depth=1000000000: must be at most 1024"),
    ({"img_size": [10**9, 10**9]}, r"sizes must be at most 16384"),
    ({"wdith": 16}, r"unknown field\(s\) wdith"),
    ({"width": "16"}, r"width='16': must be a positive integer"),
    ({"num_heads": [2]}, r"num_heads=\(2,\): must be a positive integer"),
    ({"qkv_bias": "false"}, r"qkv_bias='false': must be True or False"),
])
def test_hostile_config_refused_before_any_allocation(tmp_path, monkeypatch, patch, match):
    cfg = json.loads(config_to_json(TINY))
    cfg.update(patch)
    path = _file_with_config(tmp_path, json.dumps(cfg))

    def no_tensors(*a, **k):
        raise AssertionError("tensors were read before the config was checked")

    monkeypatch.setattr(native, "read_safetensors", no_tensors)
    monkeypatch.setattr(native, "build_loaded", no_tensors)
    with pytest.raises(WeightsError, match=r"hostile\.safetensors.*" + match):
        load_model(path)


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot be read"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "Evil"}', "type='Evil'"),
])
def test_malformed_config_metadata(tmp_path, text, match):
    with pytest.raises(WeightsError, match=match):
        load_model(_file_with_config(tmp_path, text))


def test_hostile_config_json_in_a_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    safetensors.torch.save_file({"patch_embed.weight": torch.zeros(2)}, folder / "model.safetensors")
    cfg = json.loads(config_to_json(TINY))
    (folder / "config.json").write_text(json.dumps({**cfg, "width": 10**9}))
    with pytest.raises(WeightsError, match=r"config\.json.*width=1000000000: must be at most 65536"):
        load_model(folder)
    (folder / "config.json").write_bytes(b'{"model_type": "vit", \xff}')
    with pytest.raises(WeightsError, match=r"config\.json is not valid UTF-8 JSON"):
        load_model(folder)


def test_crc_of_a_torch_zip_is_checked(tmp_path):
    path = _save(random_model(), tmp_path / "m.pt")
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # the premise: torch.save writes CRCs a reader can check


@pytest.mark.parametrize("field, value, match", [
    ("num_attention_heads", "two", r"num_attention_heads='two' in the Hugging Face config: must be a positive integer"),
    ("num_attention_heads", 10**9, r"num_heads=1000000000: must be at most 65536"),
    ("layer_norm_eps", [1], r"layer_norm_eps=\[1\] in the Hugging Face config: must be a number"),
    ("hidden_act", ["gelu"], r"hidden_act=\['gelu'\] in the Hugging Face config"),
])
@pytest.mark.filterwarnings("ignore::vitlab.weights.core.ConventionWarning")
def test_hostile_hugging_face_config(tmp_path, field, value, match):
    folder = tmp_path / "hf"
    save_model(random_model(), folder, format="hf")
    config = json.loads((folder / "config.json").read_text())
    assert torch.equal(load_model(folder)(X), random_model()(X))  # the premise: it loads untouched
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises((WeightsError, ConfigError), match=match):
        load_model(folder)


def test_a_refused_torch_pickle_is_one_line_without_pytorchs_advice_to_unpickle_it(tmp_path):
    """torch.load's refusal runs over several lines and suggests allowing the object; vitlab's error
    keeps the line that says what the file holds."""
    path = tmp_path / "weights.pt"
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(WeightsError) as info:
        load_model(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.endswith("vitlab never unpickles: Unsupported operand 103")
    assert "safe_globals" not in message and "weights_only=False" not in message


def test_a_training_checkpoint_given_as_weights_points_to_the_runs_weights(tmp_path):
    """`vitlab train`'s ckpt-<step>.pt holds numpy random states (weights_only refuses them): it is
    named as such, with the run's weights file, not PyTorch's ten lines about safe globals."""
    ckpt = tmp_path / "run" / "checkpoints" / "ckpt-00000020.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"model": random_model().state_dict(), "rng": {"numpy": np.random.get_state()}}, ckpt)
    with pytest.raises(WeightsError) as info:
        load_model(ckpt)
    assert str(info.value) == (f"{ckpt} is a training checkpoint of `vitlab train` (model, optimiser and random "
                               f"states, which --resume reads); the run's weights are "
                               f"{tmp_path / 'run' / 'model.safetensors'}, written when it ends (an interrupted "
                               "run: finish it with --resume)")
