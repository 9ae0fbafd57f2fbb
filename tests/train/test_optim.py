import copy

import pytest
import torch

from vitlab.models.registry import create_model
from vitlab.train.config import OptimConfig
from vitlab.train.optim import build_optimizer, no_decay_names, split_decay


def test_only_kernels_decay():
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, depth=2, representation_size=192, num_classes=10)
    names = set(no_decay_names(model))
    decayed = {n for n, p in model.named_parameters()} - names
    assert "cls_token" in names
    assert any("pos_embed" in n for n in names)
    assert all(n.endswith("bias") or "norm" in n or "pos_embed" in n or n == "cls_token" for n in names), names
    assert all(n.endswith("weight") and "norm" not in n for n in decayed), decayed
    assert {"patch_embed.weight", "head.weight", "pre_logits.fc.weight"} <= decayed
    assert sum(1 for n in decayed if "blocks.0." in n) == 4  # qkv, proj, fc1, fc2 kernels


def test_groups_carry_weight_decay():
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, depth=1, num_classes=10)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decay, no_decay = split_decay(model, "all")
    assert not no_decay and len(decay) == len(list(model.parameters()))
    sgd = build_optimizer(model, OptimConfig(optimizer="sgd", momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


def test_orthogonalise_keeps_the_singular_vectors_and_flattens_the_spectrum():
    from vitlab.train.optim import orthogonalise

    torch.manual_seed(0)
    for shape in ((48, 96), (96, 48)):  # wide and tall take the two sides of the iteration
        g = torch.randn(*shape, dtype=torch.float64) @ torch.diag(torch.logspace(-2, 1, shape[1], dtype=torch.float64))
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
        o = orthogonalise(g).double()
        assert torch.allclose(orthogonalise(torch.stack([g, 2 * g]))[1].double(), o, atol=1e-5)  # batched
        core = u.T @ o @ vh.T  # diagonal when o = U f(S) V^T
        off = core - torch.diag(torch.diagonal(core))
        assert off.abs().max() < 1e-4
        big = torch.diagonal(core)[s > 0.1 * s.max()]  # the iteration is for gradients, not tiny directions
        assert big.min() > 0.6 and big.max() < 1.25, big


def test_orthogonalise_is_the_quintic_iteration_as_written():
    from vitlab.train.optim import NEWTON_SCHULZ, orthogonalise

    a, b, c = NEWTON_SCHULZ
    torch.manual_seed(0)
    for shape in ((3, 20, 36), (3, 36, 20), (20, 36)):  # batched wide and tall, one matrix
        g = torch.randn(*shape, dtype=torch.float64)
        x = g.mT if shape[-2] > shape[-1] else g
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(5):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        expected = x.mT if shape[-2] > shape[-1] else x
        got = orthogonalise(g, dtype=torch.float64)
        assert got.shape == g.shape and torch.allclose(got.double(), expected, atol=1e-6)


def test_muon_adamw_is_muon_on_block_matrices_and_adamw_elsewhere(monkeypatch):
    import torch.optim._muon

    from vitlab.train.optim import MuonAdamW, block_matrices, orthogonalise

    # torch's Muon orthogonalises in bf16; in fp32, as ours does, the two must agree to rounding
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz",
                        lambda g, coefficients, steps, eps: orthogonalise(g, steps, eps))

    torch.manual_seed(0)
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, depth=2, num_classes=10)
    matrices = {id(p) for p in block_matrices(model)}
    assert len(matrices) == 8  # qkv, proj, fc1, fc2 in each of the two blocks
    opt = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-2, weight_decay=0.05))
    assert isinstance(opt, MuonAdamW)
    opt.ns_dtype = torch.float32  # the reference's precision (the built one follows the run's resolved choice)
    assert [(g["muon"], g["weight_decay"]) for g in opt.param_groups] == [(True, 0.05), (False, 0.05), (False, 0.0)]
    assert {id(p) for p in opt.param_groups[0]["params"]} == matrices

    # the reference: torch's AdamW on the same non-matrix groups, and torch's Muon on the
    # matrices, with its AdamW-matching lr scale
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    by_name = dict(ref.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    ref_groups = [[by_name[names[id(p)]] for p in g["params"]] for g in opt.param_groups]
    ref_muon = torch.optim.Muon(ref_groups[0], lr=1e-2, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([{"params": ref_groups[1], "weight_decay": 0.05},
                                   {"params": ref_groups[2], "weight_decay": 0.0}], lr=1e-2, fused=True)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for _ in range(3):
        # both take the same gradients (model's): an Adam step on a near-zero gradient follows its
        # sign, so the forward of weights a rounding apart would part the two by more than rounding
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            by_name[names[id(p)]].grad = p.grad.clone()
        for o in (opt, ref_muon, ref_adamw):
            o.step()
            o.zero_grad()
    moved = 0
    for n, p in model.named_parameters():
        assert torch.allclose(p, by_name[n], atol=1e-6, rtol=1e-5), n
        moved += int(not torch.equal(p, dict(start.named_parameters())[n]))
    assert moved == len(list(model.parameters()))  # every parameter was updated

    # its state goes through state_dict like any optimiser's (checkpoints, resume)
    again = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-2, weight_decay=0.05))
    again.load_state_dict(opt.state_dict())
    first = next(iter(opt.param_groups[0]["params"]))
    assert torch.equal(again.state[first]["momentum_buffer"], opt.state[first]["momentum_buffer"])


def test_muon_orthogonalises_each_shape_up_to_a_transpose_in_one_batch(monkeypatch):
    """A block's fc1 (mlp x width) and fc2 (width x mlp) go in one batch, fc1 as its transpose:
    three batches for a ViT's four matrices per block (qkv, proj, the MLP pair).  Their values:
    the test above, against torch's Muon matrix by matrix."""
    from vitlab.train import optim

    batches = []
    real = optim.orthogonalise
    monkeypatch.setattr(optim, "orthogonalise", lambda g, *a, **k: batches.append(tuple(g.shape)) or real(g, *a, **k))
    model = create_model("ViT-Ti/16", img_size=32, patch_size=8, width=24, depth=2, num_heads=2, mlp_dim=48)
    opt = build_optimizer(model, OptimConfig(optimizer="muon", lr=1e-2))
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    opt.step()
    assert sorted(batches) == [(2, 24, 24), (2, 24, 72), (4, 24, 48)]


def test_muon_adamw_lr_sets_the_adamw_part_apart_from_the_muon_part(tiny):
    from vitlab.train.build import build
    from vitlab.train.step import endless, train_step

    s = build(tiny(optimizer="muon", lr=4e-3, **{"optim.muon_adamw_lr": 1e-3}))
    train_step(s, endless(s.stream), lr=2e-3, size=s.img_size[0])  # the schedule's lr at some step
    lrs = {g["muon"]: g["lr"] for g in s.optimizer.param_groups}
    assert lrs == {True: 2e-3, False: 2e-3 * 1e-3 / 4e-3}
    same = build(tiny("same", optimizer="muon", lr=4e-3))
    assert {g["lr_scale"] for g in same.optimizer.param_groups} == {1.0}


def test_a_resumed_muon_run_with_another_lr_keeps_the_asked_adamw_lr(tiny):
    # the groups' lr_scale (muon_adamw_lr / lr) came back with the checkpoint's optimiser state: resumed with
    # --set optim.lr=2e-3 (numerics' advice after a divergence), the AdamW part ran at 2e-3 * 1e-3 / 4e-3, not 1e-3
    from vitlab.train.build import build
    from vitlab.train.state import restore_state, training_state
    from vitlab.train.step import endless, train_step

    first = build(tiny(optimizer="muon", lr=4e-3, **{"optim.muon_adamw_lr": 1e-3}))
    state = training_state(first, 0, 6, [], {})
    resumed = build(tiny(optimizer="muon", lr=2e-3, **{"optim.muon_adamw_lr": 1e-3}))
    restore_state(resumed, state)
    train_step(resumed, endless(resumed.stream), lr=2e-3, size=resumed.img_size[0])  # the schedule's peak
    assert {g["muon"]: g["lr"] for g in resumed.optimizer.param_groups} == {True: 2e-3, False: 1e-3}


def test_a_resumed_muon_run_takes_another_muon_adamw_lr(tiny):
    # restore_state sets the groups' lr scale again from the run's config, so a changed muon_adamw_lr takes
    # effect on --resume: it was refused as if the checkpoint's optimiser state brought the old one back
    from vitlab.train.build import build
    from vitlab.train.config import to_dict
    from vitlab.train.state import check_same_run, restore_state, training_state
    from vitlab.train.step import endless, train_step

    first = build(tiny(optimizer="muon", lr=4e-3, **{"optim.muon_adamw_lr": 1e-3}))
    state = training_state(first, 0, 6, [], {})
    resumed = build(tiny(optimizer="muon", lr=4e-3, **{"optim.muon_adamw_lr": 5e-4}))
    check_same_run(resumed.cfg, to_dict(first.cfg))
    restore_state(resumed, state)
    train_step(resumed, endless(resumed.stream), lr=4e-3, size=resumed.img_size[0])  # the schedule's peak
    assert {g["muon"]: g["lr"] for g in resumed.optimizer.param_groups} == {True: 4e-3, False: 5e-4}


def test_muon_adamw_lr_must_be_positive_and_with_muon():
    from vitlab.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.muon_adamw_lr.*must be None \(the lr\) or > 0"):
        OptimConfig(optimizer="muon", muon_adamw_lr=0.0)
    with pytest.raises(ConfigError, match=r"optim.muon_adamw_lr.*applies to optim.optimizer='muon' only"):
        OptimConfig(optimizer="adam", muon_adamw_lr=1e-3)


# a BiT ResNet small enough to build in milliseconds, at the digits' 8 px
TINY_BIT = {"layers": (1,), "width_factor": 0.5, "img_size": 8, "root_kernel": 3, "root_stride": 1, "name": "BiT-tiny"}


def test_muon_is_refused_for_a_bit_resnet_trained_or_fine_tuned_before_its_data_is_read(tiny, tmp_path, monkeypatch):
    """Muon orthogonalises the dense layers of a ViT's blocks: a BiT ResNet has none, and its run under
    optim.optimizer='muon' trained every parameter with AdamW (the very losses of the AdamW run), recorded as Muon."""
    import re

    import vitlab
    import vitlab.train.inputs as inputs
    from vitlab.config import ConfigError
    from vitlab.train import train
    from vitlab.train.overrides import with_changes

    monkeypatch.setattr(inputs, "load_labelled", lambda *a, **k: pytest.fail("the data was read"))
    bit = {"model.name": "BiT-R50x1", "model.overrides": TINY_BIT, "optim.optimizer": "muon"}
    with pytest.raises(ConfigError, match=r"^optim.optimizer='muon': Muon orthogonalises the dense layers of a ViT's "
                                          r"Transformer blocks, and BiT-tiny is a BiT ResNet, which has none \(every "
                                          r"parameter would train with AdamW\); use 'adam' or 'sgd'$"):
        train(with_changes(tiny("scratch"), bit), verbose=False)
    init = tmp_path / "bit.safetensors"
    vitlab.save_model(vitlab.create_model("BiT-R50x1", num_classes=10, **{k: v for k, v in TINY_BIT.items()
                                                                          if k != "name"}), init)
    with pytest.raises(ConfigError, match=re.escape("and BiT-R50x1 is a BiT ResNet, which has none")):
        train(with_changes(tiny("fine"), {"model.init": str(init), "model.overrides": {}, "optim.optimizer": "muon"}),
              verbose=False)


def test_orthogonalise_flops_match_torch_flop_counter():
    """The FLOPs the compute experiment charges Muon, against torch's own count of the matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitlab.train.optim import block_matrices, muon_step_flops, orthogonalise, orthogonalise_flops

    for shape in [(24, 72), (72, 24), (32, 32)]:  # wide, tall (iterates on the transpose), square
        with FlopCounterMode(display=False) as counter:
            orthogonalise(torch.randn(shape), steps=3)
        assert orthogonalise_flops(shape, steps=3) == counter.get_total_flops()
    model = create_model("ViT-Ti/16", img_size=32, patch_size=4, width=24, depth=2, num_heads=2, mlp_dim=48)
    shapes = [tuple(p.shape) for p in block_matrices(model)]
    assert sorted(shapes) == sorted([(72, 24), (24, 24), (48, 24), (24, 48)] * 2)  # qkv, proj, fc1, fc2 per block
    assert muon_step_flops(model) == sum(orthogonalise_flops(s) for s in shapes)


def test_a_muon_checkpoint_read_to_the_host_keeps_every_state_tensor_on_its_parameters_device():
    # checkpoints are read with map_location="cpu"; torch moves a loaded "step" count to its parameter's
    # device only in groups marked fused, so a resumed GPU run's AdamW part kept its counts on the host, where
    # the fused CUDA kernel reads them as device memory ("meta" stands in for the GPU: another device)
    from torch import nn

    from vitlab.train.optim import MuonAdamW

    def made_on(device):
        weight, bias = nn.Parameter(torch.ones(32, 16, device=device)), nn.Parameter(torch.ones(16, device=device))
        return MuonAdamW([{"params": [weight], "muon": True}, {"params": [bias]}], lr=1e-3)

    saved = made_on("cpu")
    for p in (p for g in saved.param_groups for p in g["params"]):
        p.grad = torch.full_like(p, 0.5)
    saved.step()
    resumed = made_on("meta")
    resumed.load_state_dict(saved.state_dict())
    state = {name: tensor.device.type for g in resumed.param_groups for p in g["params"]
             for name, tensor in resumed.state[p].items()}
    assert state == {"momentum_buffer": "meta", "step": "meta", "exp_avg": "meta", "exp_avg_sq": "meta"}


def test_vit_ti16_decays_exactly_the_hand_listed_kernels():
    # ViT-Ti/16 with the pre-training head, listed by hand: the official mask ".*/kernel$" decays the
    # patch embedding's, the blocks' four dense layers', the pre-logits' and the head's kernels; no bias,
    # LayerNorm, position embedding or [class] token
    model = create_model("ViT-Ti/16", num_classes=10, representation_size=192)
    blocks = [f"blocks.{i}.{layer}.weight" for i in range(12) for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    decayed = {"patch_embed.weight", *blocks, "pre_logits.fc.weight", "head.weight"}
    kept = {"cls_token", "pos_embed.weight", "patch_embed.bias", "norm.weight", "norm.bias", "pre_logits.fc.bias",
            "head.bias"}
    kept |= {f"blocks.{i}.{part}" for i in range(12) for part in (
        "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
        "attn.qkv.bias", "attn.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias")}
    assert set(no_decay_names(model)) == kept
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1, wd_scope="kernels"))
    assert [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in opt.param_groups] == [
        (0.1, decayed), (0.0, kept)]
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_two_training_steps_are_hand_written_adamw_after_clipping_the_accumulated_gradient(tiny):
    """train_step against the update written out: the gradient of the whole batch (two micro-batches of
    16 accumulated), the sigmoid cross-entropy summed over classes, clipped to global norm 1, then Adam
    (0.9, 0.999, eps 1e-8) with decoupled decay lr_t * wd on the kernels only.

    Each step is written out from the weights the run has then (a float64 reference carried over two steps
    drifts from float32 arithmetic), and an entry whose gradient is below 1e-4 of its tensor's largest is not
    compared (a few per tensor, held under 5%): Adam's first step is about lr * sign(g), and there eps / |g|
    times float32's relative error of a small g moved the update by up to 1e-5, an arithmetic's rounding,
    not the update's rule."""
    from vitlab.train.build import build
    from vitlab.train.step import train_step

    cfg = tiny(steps=2, accum_steps=2, batch_size=32, loss="sigmoid_xent", weight_decay=0.1, pre_logits=True)
    setup = build(cfg)
    with torch.no_grad():  # a zero head passes no gradient back: give every layer one
        # drawn from a generator of its own: the caller's stream, which build leaves as it found it, differs
        # from one pytest process to the next, and so did this test's weights and its outcome
        torch.nn.init.normal_(setup.model.head.weight, std=2.0, generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(dict(setup.model.named_parameters()))
    ref = {n: p.detach().clone().double() for n, p in ref.items()}
    decayed = {n for n in ref} - set(no_decay_names(setup.model))
    g = torch.Generator().manual_seed(1)
    moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in ref.items()}
    for t, lr in ((1, 0.02), (2, 0.05)):
        ref = {n: p.detach().clone().double() for n, p in setup.model.named_parameters()}
        x = torch.randn(32, 3, 8, 8, generator=g)
        targets = (torch.rand(32, 10, generator=g) < 0.3).float()
        # the reference gradient: a plain copy of the model at the reference weights, the whole batch at once
        plain = copy.deepcopy(setup.model).double()
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(ref[n])
        z = plain(x.double())
        loss = -(targets * torch.log(torch.sigmoid(z)) + (1 - targets) * torch.log(1 - torch.sigmoid(z))).sum(1).mean()
        grads = dict(zip(ref, torch.autograd.grad(loss, [p for _, p in plain.named_parameters()])))
        norm = torch.sqrt(sum((gr ** 2).sum() for gr in grads.values()))
        assert norm > 1.5  # the clipping acts
        scale = 1.0 / (norm + 1e-6)
        for n, p in ref.items():
            m, v = moments[n]
            gr = grads[n] * scale
            m.mul_(0.9).add_(0.1 * gr)
            v.mul_(0.999).add_(0.001 * gr * gr)
            step = lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
            ref[n] = (p * (1 - lr * 0.1) if n in decayed else p) - step
        result = train_step(setup, iter([(x[:16], targets[:16]), (x[16:], targets[16:])]), lr, tuple(setup.img_size))
        assert float(result.grad_norm) == pytest.approx(float(norm), rel=1e-5)
        torch.testing.assert_close(result.loss.double(), loss.detach(), rtol=1e-5, atol=0)
        for n, p in setup.model.named_parameters():
            got, want = p.detach().double(), ref[n]
            gradient = grads[n]
            if n.endswith("qkv.bias"):  # the keys' bias moves no softmax: its gradient is rounding, which Adam scales up
                keys = torch.arange(len(want)) // (len(want) // 3) == 1
                got, want, gradient = got[~keys], want[~keys], gradient[~keys]
            compared = gradient.abs() >= 1e-4 * gradient.abs().max()
            assert compared.float().mean() > 0.95, n
            torch.testing.assert_close(got[compared], want[compared], rtol=1e-5, atol=1e-6, msg=n)
