"""``vitlab.fast.compile_for_inference``: the frozen, compiled model scores as the eager one, in one graph
whatever the batch, leaves the model and the caller's inductor settings as they were, and holds the
weights of its first call (freezing).  CUDA graphs, its other half, need a GPU (``tests/test_cuda.py``)."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

import vitlab
import vitlab.fast
from vitlab.config import ViTConfig
from vitlab.fast import compile_for_inference

torch.set_num_threads(2)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                                   reason="inductor needs a C++ compiler on a CPU")]

TINY = ViTConfig(img_size=16, patch_size=4, width=32, depth=2, mlp_dim=64, num_heads=2, num_classes=5)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model(TINY)
    with torch.no_grad():
        model.head.weight.normal_()  # the head starts at zero: every logit would be 0
    return model


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_scores_as_the_eager_model_in_one_graph_for_every_batch_and_leaves_all_as_it_was():
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model().train()  # a model left in training mode: scored in eval mode, returned as it was
    state = {k: v.clone() for k, v in model.state_dict().items()}
    settings = (inductor_config.freezing, inductor_config.triton.cudagraphs)
    infer = compile_for_inference(model, "fp32", batch_size=4)
    images = torch.randn(11, 3, 16, 16)
    with torch.no_grad():
        want = model.eval()(images)
    model.train()

    got = infer(images)  # chunks of 4, 4 and 3, the last padded
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(infer(images[:1]), want[:1], rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # the caller in inference mode: the same graph
        torch.testing.assert_close(infer(images[3:7]), want[3:7], rtol=1e-4, atol=1e-5)
    assert graphs_compiled() == 1
    assert not got.requires_grad and got.shape == (11, TINY.num_classes)

    assert model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert (inductor_config.freezing, inductor_config.triton.cudagraphs) == settings


@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "fast"])
def test_bf16_matches_the_eager_model_under_autocast_and_keeps_the_weights_bf16_copies(optimized):
    torch._dynamo.reset()
    model = tiny_model().eval()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(images)
    if optimized:  # the fast layer steps aside under compilation: the graph is the plain model's
        vitlab.fast.optimize(model)
    infer = compile_for_inference(model, "bf16")
    got = infer(images)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)

    # frozen: the head's bf16 copy was made once, at compilation; the eager model casts the new weight
    with torch.no_grad():
        model.head.weight.mul_(2)
    assert torch.equal(infer(images), got)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert not torch.allclose(model(images).float(), want.float())


@pytest.mark.parametrize("kwargs, words", [
    (dict(precision="int8"), "precision='int8': expected one of fp32, bf16, fp16"),
    (dict(batch_size=0), "batch_size=0: expected a positive integer"),
    (dict(batch_size=2.5), "batch_size=2.5: expected a positive integer"),
    # a string was taken by its truth: "no" gave up a failed compilation for eager, and refused autotuning on a CPU
    (dict(eager_on_failure="no"), "eager_on_failure='no': must be True or False"),
    (dict(autotune="no"), "autotune='no': must be True or False"),
])
def test_refuses_an_unknown_precision_or_batch(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        compile_for_inference(tiny_model(), **kwargs)


def test_autotuning_is_refused_off_a_cuda_gpu():
    with pytest.raises(ValueError, match=r"^autotune=True tunes a CUDA GPU's Triton matmul templates; the model is on cpu$"):
        compile_for_inference(tiny_model(), autotune=True)


def test_refuses_images_it_cannot_score_before_compiling():
    infer = compile_for_inference(tiny_model())
    with pytest.raises(ValueError, match=r"expected float images \(N, C, H, W\), got torch.uint8"):
        infer(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"got torch.float32 \(3, 16, 16\)"):
        infer(torch.zeros(3, 16, 16))


def test_a_failed_compilation_is_the_callers_error_unless_eager_was_asked_for():
    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here\nsecond line")

    model = tiny_model().eval()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = model(images)
    strict = compile_for_inference(model, batch_size=4)
    strict.graph = torch.compile(model, backend=failing_backend)
    with pytest.raises(Exception, match="no compiler here"):
        strict(images)

    lenient = compile_for_inference(model, batch_size=4, eager_on_failure=True)
    lenient.graph = torch.compile(model, backend=failing_backend)
    with pytest.warns(RuntimeWarning, match=r"torch.compile failed \(.*no compiler here\); inference continues eager"):
        got = lenient(images)
    torch.testing.assert_close(got, want)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # given up once: no second attempt, no second warning
        torch.testing.assert_close(lenient(images), want)
    assert lenient.graph is None
