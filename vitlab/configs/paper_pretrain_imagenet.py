"""Training ViT on ImageNet-1k (ILSVRC-2012) alone, the last row of the paper's Table 3:

    ViT-*  ImageNet  300 epochs  base lr 3e-3  cosine decay  weight decay 0.3  dropout 0.1

with Adam (0.9, 0.999), batch 4096, 10k warm-up steps and clipping at global norm 1
("for ImageNet we found it beneficial to additionally apply gradient clipping at global
norm 1", caption of Table 3).  300 epochs of 1,281,167 images at 4096 = 93,834 steps.
The paper holds out 1% of the training set for validation (Appendix B.1).
"""
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        recipe="paper_pretrain_imagenet",
        model=ModelConfig(name="ViT-B/16", overrides=dict(dropout=0.1), pre_logits=True, img_size=224),
        data=DataConfig(val_split=0.01),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        optim=OptimConfig(optimizer="adam", betas=(0.9, 0.999), lr=3e-3, weight_decay=0.3, wd_scope="kernels",
                          batch_size=4096, accum_steps=1, steps=93_834, warmup=10_000, decay="cosine", clip_norm=1.0,
                          loss="softmax_xent"),
        run=RunConfig(precision="bf16", eval_every=5000, log_every=50, ckpt_every=1000, keep_ckpts=2,
                      out="runs/paper_pretrain_imagenet"),
    )
