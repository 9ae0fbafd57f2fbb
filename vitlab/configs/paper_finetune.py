"""Fine-tuning as in the paper, Table 4 and Sec. 3.2 / Appendix B.1.1.

SGD with momentum 0.9, batch 512, cosine decay, no weight decay, clipping at global
norm 1, the pre-trained head replaced by a zero-initialised linear layer.

Resolution: higher than pre-training, with the position embeddings interpolated in 2D
(Sec. 3.2).  The paper fine-tunes at 384 the models it pre-trained at 224, and the recipe
follows the init by the same rule (``model.img_size="auto"``, ``resolve.finetune_size``):
the init's resolution times 384/224, at most 384 and never below the init's own, to the
nearest multiple of the patch size.  A 224-px init fine-tunes at 384 as in the paper; a
32-px one (CIFAR, 16-px patches) at 48; the demo's 16-px model (4-px patches) at 28; an
init at 384 or more keeps its own.  ``--img-size`` overrides the rule.
Warm-up: the paper states none (Table 4 gives the steps and the rates).  500 steps for ImageNet
and CIFAR, 100 for Pets and Flowers, as big_vision's config for transferring ViTs to these five
sets gives them (big_vision/configs/transfer.py, with Table 4's steps and hold-outs); the official
fine-tuning code (vit_jax, configs/common.py) warms up 500 on its CIFAR and ImageNet presets.  Table
4's steps are BiT-HyperRule's schedule lengths (Kolesnikov et al. 2020, bit_hyperrule.py: 500
steps for a set under 20k images, 10k under 500k, else 20k), whose warm-ups are the same 100,
500 and 500.
Pre-processing: inception crop + flip for training, a plain resize for evaluation.

Table 4 (steps, learning-rate grid):

    ImageNet        20,000   {0.003, 0.01, 0.03, 0.06}
    CIFAR-10        10,000   {0.001, 0.003, 0.01, 0.03}
    CIFAR-100       10,000   {0.001, 0.003, 0.01, 0.03}
    Oxford-IIIT Pets   500   {0.001, 0.003, 0.01, 0.03}
    Oxford Flowers     500   {0.001, 0.003, 0.01, 0.03}
    VTAB (19 tasks)  2,500   0.01          (see vtab1k.py)

The learning rate is picked on a held-out part of the training set, then the model is
trained on the whole training set (Appendix B.1.1): `vitlab sweep`, which holds out the
recipe's ``data.val_split``: 10% for Pets and Flowers, 2% for CIFAR, 1% for ImageNet, as
the appendix says (``--holdout`` overrides it).
Polyak averaging (factor 0.9999, used for the ImageNet fine-tuning of the largest models,
Table 2, Sec. 4.1) is ``--set optim.ema_decay=0.9999``.
"""
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

DATASETS = {
    # name: (steps, lr grid, share of the training set held out to choose the lr, Appendix B.1.1;
    #        warm-up steps, big_vision's transfer config: module text)
    "imagenet": (20_000, (0.003, 0.01, 0.03, 0.06), 0.01, 500),
    "cifar10": (10_000, (0.001, 0.003, 0.01, 0.03), 0.02, 500),
    "cifar100": (10_000, (0.001, 0.003, 0.01, 0.03), 0.02, 500),
    "pets": (500, (0.001, 0.003, 0.01, 0.03), 0.1, 100),
    "flowers": (500, (0.001, 0.003, 0.01, 0.03), 0.1, 100),
}


def get_config(dataset: str = "cifar10") -> TrainConfig:
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}: allowed values are {', '.join(DATASETS)}")
    steps, grid, holdout, warmup = DATASETS[dataset]
    return TrainConfig(
        recipe=f"paper_finetune:dataset={dataset}",
        model=ModelConfig(name="ViT-B/16", img_size="auto"),  # 384 for a 224-px init (module text)
        data=DataConfig(val_split=holdout),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        optim=OptimConfig(optimizer="sgd", momentum=0.9, lr=grid[2], lr_grid=grid, weight_decay=0.0, batch_size=512,
                          steps=steps, warmup=warmup, decay="cosine", clip_norm=1.0, ema_decay=0.0),
        run=RunConfig(precision="bf16", eval_every=max(steps // 10, 1), log_every=20, ckpt_every=1000, keep_ckpts=2,
                      out=f"runs/finetune_{dataset}"),
    )
