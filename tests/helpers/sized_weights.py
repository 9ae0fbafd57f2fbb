"""A ViT trained at 8x32 px in 4-px patches: a 2x8 grid of 16 patches, a count that a 4x4 grid has too,
saved in the layouts that record no image size (an official .npz, a bare vitlab state dict, a timm file
without its .timm.json) and in vitlab's own, which records it (the reference every reading is held to)."""
from pathlib import Path

import torch

from vitlab.config import ViTConfig
from vitlab.models import create_model

SIZE = (8, 32)
FLAG = "8x32"
# file written, the flags that give it the heads it does not record, the vitlab file of the same model
LAYOUTS = {"official": ("w.npz", [], "ref.safetensors"),
           "state-dict": ("w.pth", ["--num-heads", "2"], "ref.safetensors"),
           "timm": ("t.safetensors", ["--num-heads", "2"], "timm-ref.safetensors")}


def sized_model(**conventions) -> torch.nn.Module:
    """Random weights whose position table and head matter: the default init's 0.02 and zero head
    would give almost the same outputs read in any grid."""
    torch.manual_seed(0)
    model = create_model(ViTConfig(img_size=SIZE, patch_size=4, width=16, depth=1, mlp_dim=32, num_heads=2,
                                   num_classes=10, **conventions))
    with torch.no_grad():
        model.pos_embed.weight.normal_(0, 1.0)
        model.head.weight.normal_(0, 0.5)
    return model.eval()


def write_sized_weights(folder: Path) -> Path:
    """Every layout of ``LAYOUTS`` in ``folder``: timm's with timm's conventions (exact GELU, bicubic
    resampling), which its reader takes without the .timm.json; the others with vit_jax's."""
    from vitlab.weights import save_model, save_official_npz

    official, timm = sized_model(), sized_model(gelu="exact", posemb_resample="bicubic")
    save_official_npz(official, folder / "w.npz")
    torch.save(official.state_dict(), folder / "w.pth")
    save_model(timm, folder / "t.safetensors", format="timm")
    (folder / "t.timm.json").unlink()
    save_model(official, folder / "ref.safetensors")
    save_model(timm, folder / "timm-ref.safetensors")
    return folder
