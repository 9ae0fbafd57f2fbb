"""Masked patch prediction (paper Sec. 4.6, Appendix B.1.2): self-supervised pre-training.

The appendix: 50% of the patch embeddings corrupted (80% [mask], 10% another patch, 10%
kept), predict the 3-bit mean colour of each corrupted patch (512 classes); Adam, base
lr 2e-4, 10k warm-up steps, cosine decay, batch 4096, 1M steps on JFT (ViT-B/16; 79.9%
on ImageNet after fine-tuning, +2% over training from scratch).  The other two targets
of the appendix are options: ``target=color4x4`` (the patch shrunk to 4x4, 16
predictions of 512 colours) and ``target=pixels`` (L2 regression of the whole patch).

``vitlab train --recipe mpp[:target=color|color4x4|pixels] --data DATA`` writes the plain
ViT's weights (``model.safetensors``), which ``vitlab finetune`` takes unchanged.  The
labels are not used; the validation split (1%) is held out all the same, so that a fine-tune
on the same data can score on images pre-training never saw: one that holds out the same
(``vitlab finetune --init RUN --data DATA --val-split 0.01``, the same ``data.split_seed``).
The fine-tune's own hold-out is another (2% for CIFAR: 1,000 images, 500 of them this run
trained on), and it warns so.  Weight decay is not stated for MPP: the paper's pre-training value (0.1,
Table 3) is used.
"""
from vitlab.train.config import AugmentConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig


def get_config(target: str = "color") -> TrainConfig:
    return TrainConfig(
        recipe=f"mpp:target={target}",
        model=ModelConfig(name="ViT-B/16", img_size=224, mpp=target, mpp_rate=0.5),
        data=DataConfig(val_split=0.01),
        augment=AugmentConfig(crop="inception", crop_scale=(0.05, 1.0), flip=True),
        optim=OptimConfig(optimizer="adam", betas=(0.9, 0.999), lr=2e-4, weight_decay=0.1, wd_scope="kernels",
                          batch_size=4096, steps=1_000_000, warmup=10_000, decay="cosine", clip_norm=1.0),
        run=RunConfig(precision="bf16", eval_every=0, log_every=50, ckpt_every=1000, keep_ckpts=2, out="runs/mpp"),
    )
