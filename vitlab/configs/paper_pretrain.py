"""Pre-training as in the paper, Table 3 (JFT-300M and ImageNet-21k rows).

Table 3 (all: Adam beta1 0.9, beta2 0.999, batch 4096, linear warm-up 10k steps,
resolution 224):

    model             data          epochs  base lr  decay   weight decay  dropout
    ViT-B/{16,32}     JFT-300M      7       8e-4     linear  0.1           0.0
    ViT-L/32          JFT-300M      7       6e-4     linear  0.1           0.0
    ViT-L/16          JFT-300M      7/14    4e-4     linear  0.1           0.0
    ViT-H/14          JFT-300M      14      3e-4     linear  0.1           0.0
    ViT-B/{16,32}     ImageNet-21k  90      1e-3     linear  0.03          0.1
    ViT-L/{16,32}     ImageNet-21k  30/90   1e-3     linear  0.03          0.1

``get_config(dataset="jft")`` gives the ViT-B/16 JFT row, ``dataset="i21k"`` the
ImageNet-21k row (the one with dropout 0.1); change ``--model`` and ``--lr`` for the
other rows.  Weight decay is in the paper's (and PyTorch AdamW's) units: see
vitlab/train/optim.py for how it maps onto the official code's decoupled decay on the
kernels.  The head has a pre-logits layer (dense + tanh, width D; Sec. 3.1).  A batch of
4096 that does not fit is reached with ``--accum-steps K`` (K micro-batches of 4096/K,
the same update up to float rounding).  Clipping at global norm 1: the caption of Table 3
states it for ImageNet; the official configs use it throughout.

Steps: 7 epochs of JFT-300M's ~303M images at 4096 = ~517k steps; 90 epochs of
ImageNet-21k's ~14.2M = ~312k steps.  The official code trains with sigmoid
cross-entropy on these multi-label sets (big_vision configs); ``loss`` chooses.
"""
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

ROWS = {
    # dataset: (steps, lr, weight decay, dropout)
    "jft": (517_000, 8e-4, 0.1, 0.0),
    "i21k": (312_000, 1e-3, 0.03, 0.1),
}


def get_config(dataset: str = "jft") -> TrainConfig:
    if dataset not in ROWS:
        raise ValueError(f"dataset={dataset!r}: allowed values are {', '.join(ROWS)}")
    steps, lr, wd, dropout = ROWS[dataset]
    return TrainConfig(
        recipe=f"paper_pretrain:dataset={dataset}",
        model=ModelConfig(name="ViT-B/16", overrides=dict(dropout=dropout), pre_logits=True, img_size=224),
        data=DataConfig(val_split=0.01),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),  # the official pre-training crop
        optim=OptimConfig(optimizer="adam", betas=(0.9, 0.999), lr=lr, weight_decay=wd, wd_scope="kernels",
                          batch_size=4096, accum_steps=1, steps=steps, warmup=10_000, decay="linear", clip_norm=1.0,
                          loss="sigmoid_xent"),
        run=RunConfig(precision="bf16", eval_every=10_000, log_every=50, ckpt_every=1000, keep_ckpts=2,
                      out="runs/paper_pretrain"),
    )
