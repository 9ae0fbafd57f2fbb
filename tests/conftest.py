"""Fixtures shared across the test folders."""
import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A saved random ViT of ~5k parameters at 16 px (4 patches of 8), 10 classes: a model any
    command can load in milliseconds."""
    import vitlab

    path = tmp_path_factory.mktemp("tiny_checkpoint") / "tiny"
    vitlab.save_model(vitlab.create_model("ViT-Ti/16", img_size=16, patch_size=8, width=16, depth=1, num_heads=2,
                                          mlp_dim=32, num_classes=10), path)
    return str(path)
