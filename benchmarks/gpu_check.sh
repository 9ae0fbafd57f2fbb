#!/usr/bin/env bash
# One prepared GPU check for a lent device machine (see the device tool's README), run from the project's root.
# Adapted from ../shared/tools/gpu_check.sh: parts B and I measure issue 51's bench rows, part P maps the CIFAR
# recipe's step, part C prints the run's MFU.
#
#   bash benchmarks/gpu_check.sh prepare      # here, no GPU: fills .gpu/ (git-ignored) with this script and the
#                                             # CIFAR-10 archive (../shared does not travel to the device machine)
#   device run: command="PARTS=AB bash .gpu/gpu_check.sh run 2>&1", carry=[".gpu"], timeout_s=590
#
# Parts (each with its own timeout; results land in $OUT as they come, the summary prints last):
#   A  the CUDA tests; a failing test's short traceback, without the debug log lines (about 90-150 s)
#   P  benchmarks/step_profile.py on the CIFAR-10 GPU recipe, then on the trainer's ViT-B/16 at batch 128 (bench's
#      training row): the step's host and device time, the data path alone, the model and optimiser alone, the
#      update alone, the profiler's kernels and their time by kind (matmul, attention, normalisation, fused
#      element-wise, optimiser, copies) (about 3-4 minutes: two compilations);
#      P_ARGS adds step_profile.py arguments (a CPU try of the script: P_ARGS="--warmup 2 --steps 3");
#      P_B16=0 leaves out the ViT-B/16 half (about 2 minutes for the CIFAR recipe's alone); P_B16_ARGS adds
#      arguments to the ViT-B/16 half alone, e.g. P_B16_ARGS="--set run.fp8=tensorwise" (where fp8's time goes)
#   B  bench.py, compiled, bf16, ViT-B/16 training at batch 128: vitlab, its fp8 columns (tensorwise, rowwise)
#      and timm (four fresh processes, each compiling its model, vitlab's also its update as the trainer does:
#      about 5-6 minutes; B_IMPLS narrows or widens the columns, e.g. B_IMPLS='vitlab|timm', or
#      B_IMPLS='vitlab-fp8-tensorwise|vitlab-fp8-torchao-tensorwise|timm' for fp8 by vitlab's arithmetic against
#      torchao's (its wheel carried by prepare, installed in /tmp/site), or
#      B_IMPLS='vitlab|vitlab-cudnn|timm' for vitlab with cuDNN's fused attention first, run.gpu_attention=cudnn;
#      'vitlab-autotune' is vitlab compiled in inductor's max-autotune, run.compile_autotune: minutes of autotuning
#      before its timed steps, so give it a call of its own, e.g. B_IMPLS='vitlab-autotune|timm')
#   I  bench.py, compiled, bf16, ViT-B/16 inference, vitlab (vitlab.fast.compile_for_inference: frozen weights
#      under CUDA graphs) and timm (torch.compile): batch 1 in three rounds (the order of the two rotates), batch 64
#      and 256 in one (ten fresh processes: about 5 minutes); I_IMPLS='vitlab|vitlab-cudnn|timm' adds the cuDNN column,
#      'vitlab-autotune' the max-autotune one
#   C  the CIFAR-10 plain-ViT recipe, PART_C_MIN minutes, on the GPU, once per variant of PART_C_SETS
#      ('|'-separated extra arguments; '' is the recipe; later arguments win, over the recipe's GPU settings too:
#      before 8419e4f a run set those back), e.g. the recipe's GPU model
#      (width 384, 7 blocks) against the CPU's (width 192, 6 blocks) at the CPU's batch rule, its RandAugment
#      against none, and fp8 at the steps S the bf16 run took ({STEPS1} in a variant is the first variant's step
#      count, read from its summary: PART_C_SETS="|--fp8 tensorwise --time-limit 0 --steps {STEPS1}" is fp8's
#      accuracy against bf16's at the same steps in one call; that variant's limit is 1.4x PART_C_MIN):
#        PART_C_SETS="|$CPU_MODEL|--set augment.randaug_ops=0|--fp8 tensorwise --time-limit 0 --steps S", with
#        CPU_MODEL="--set model.width=192 --set model.depth=6 --set model.num_heads=8 --set model.mlp_dim=384
#                   --batch-size 256 --lr 4.24e-3";
#      the optimiser step compiled into its own CUDA graph, which the recipe leaves off: add
#        "|--set run.compile_optimizer=true"; the batches augmented one at a time, as before the recipe grouped
#        them by 8 (the 93.08% run of 2026-11-28): add "|--set data.augment_batches=1"; a quarter of each image's
#        patches dropped in training (fewer tokens a step, with the distance penalty since f351236): add
#        "|--set model.patch_dropout=0.25"; the recipe without its mixup/CutMix (in its GPU form since the
#        95.18% run of 2026-11-28; 93.06% at 3 minutes without): "|--set augment.mixup_alpha=0 --set
#        augment.cutmix_alpha=0"; inductor's max-autotune for the model and the update (minutes of compilation
#        at the start, which the time limit counts): "|--set run.compile_autotune=true"; prints each run's
#        accuracy, MFU and data_wait.  A call runs 10 minutes at
#      most, the machine's start not counted: the 10-minute goal runs as PARTS=C PART_C_MIN=9.5 in a call of
#      its own (timeout_s=600; the half minute short of 10 is for the script's own seconds around the run, which
#      the call's limit counts), a session's device time nearly whole
#   D  ViT-B/16 pre-training recipe from memory vs streamed JPEG shards
# A session has 15 device minutes, a fresh machine's start (1-2 minutes) included: PARTS=AB (the default) fits one
# call of about 7-8 minutes, then PARTS=C PART_C_MIN=3 a second (about 5); P, I and D take a session's calls of
# their own.  The next session's plan (what is still unmeasured, in order): PARTS=AC PART_C_MIN=3
# PART_C_SETS="|--set run.compile_optimizer=true" (the recipe's mixup/CutMix at 3 minutes, the new CUDA tests,
# the update in a CUDA graph; about 9 minutes), then PARTS=B B_IMPLS='vitlab-fp8-tensorwise|vitlab-cudnn|timm'
# (about 4: fp8 since its compiled step's fp32 outputs were mended, cuDNN's attention); a later session
# PARTS=B B_IMPLS='vitlab|vitlab-fp8-torchao-tensorwise|vitlab-fp8-rowwise|timm' (torchao's arithmetic, rowwise
# scaling), PARTS=C PART_C_MIN=3
# PART_C_SETS="|--fp8 tensorwise --time-limit 0 --steps {STEPS1}" (fp8's accuracy against bf16's at the same
# steps, one call of about 9 minutes), then PARTS=B B_IMPLS='vitlab-autotune|timm' (max-autotune's compilation,
# never timed: allow a call).
set -u
mode=${1:-run}
if [ "$mode" = prepare ]; then
  top=$(git rev-parse --show-toplevel) && cd "$top" || exit 1
  exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git where its exclude is
  mkdir -p "$(dirname "$exclude")" && { grep -q '^/.gpu/' "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"; }
  mkdir -p .gpu && cp "$0" .gpu/gpu_check.sh && cp ../shared/data/cifar10/cifar10-train.tar.gz .gpu/
  # torchao for the fp8 columns by its arithmetic (run.fp8_backend=torchao): the device machine's image lacks it
  # and reaches no index; 0.18.0 is the release built against its torch 2.11 (pure Python where fp8 training runs)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .gpu/whl "torchao==${TORCHAO:-0.18.0}" \
    || echo "no torchao wheel: the torchao fp8 columns will fail on the device"
  du -sh .gpu; exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
if ls .gpu/whl/*.whl > /dev/null 2>&1; then  # carried by prepare; installed beside the image's packages
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; PARTS=${PARTS:-AB}; PART_C_MIN=${PART_C_MIN:-3}
# whole logs beside $OUT, which brings back 8 files at most: the parts' summaries there, the logs in one archive
LOGS=/tmp/gpu-logs; mkdir -p "$LOGS"; trap 'tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null' EXIT
t0=$(date +%s); say() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
case $PARTS in *A*) say "A CUDA tests"
  # a test turns on torch's debug log: its lines would push the failure out of the tail
  timeout 240 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -rf --tb=short 2>&1 | grep -v DEBUG \
    > "$LOGS/A.log"; tail -n 40 "$LOGS/A.log" | tee "$OUT/A.txt";; esac
case $PARTS in *P*) say "P the step's host, device and data time: the CIFAR-10 GPU recipe, then ViT-B/16 b128"
  timeout 240 python3 benchmarks/step_profile.py --recipe cifar10_scratch:model=vit --data .gpu/cifar10-train.tar.gz \
    ${P_ARGS:-} > "$LOGS/P.log" 2>&1
  grep -v DEBUG "$LOGS/P.log" | tail -n 32 | tee "$OUT/P.txt"
  # the trainer's ViT-B/16 step as bench.py's training row has it (bf16, compiled, batch 128), on the digits
  # resized to 224 px: its rate against the bench's, and where its time goes (compiled as asked: the recipe is not)
  if [ "${P_B16:-1}" != 0 ]; then
    timeout 200 python3 benchmarks/step_profile.py --recipe paper_pretrain:dataset=i21k --data digits \
      --set model.name=ViT-B/16 --set optim.batch_size=128 --set data.val_split=0 --set run.compile=true \
      --warmup 20 --steps 50 \
      ${P_ARGS:-} ${P_B16_ARGS:-} > "$LOGS/P-b16.log" 2>&1
    grep -v DEBUG "$LOGS/P-b16.log" | tail -n 32 | tee -a "$OUT/P.txt"
  fi;; esac
case $PARTS in *B*) say "B ViT-B/16 bf16 training b128, compiled: vitlab, its fp8 columns, timm"
  timeout 420 python3 benchmarks/bench.py --device cuda --compile --rounds 1 --attention cudnn --autotune \
    --fp8 tensorwise,rowwise,torchao-tensorwise,torchao-rowwise \
    --only "train/ViT-B/16/b128/bf16/(${B_IMPLS:-vitlab|vitlab-fp8-tensorwise|vitlab-fp8-rowwise|timm})\$" \
    --out "$LOGS/B" > "$LOGS/B.log" 2>&1
  tail -n 10 "$LOGS/B.log" | tee "$OUT/B.txt";; esac
case $PARTS in *I*) say "I ViT-B/16 bf16 inference, compiled, vitlab vs timm: b1 (3 rounds), b64, b256"
  timeout 200 python3 benchmarks/bench.py --device cuda --compile --rounds 3 --attention cudnn --autotune \
    --only "infer/ViT-B/16/b1/bf16/(${I_IMPLS:-vitlab|timm})\$" --out "$LOGS/I1" > "$LOGS/I.log" 2>&1
  timeout 200 python3 benchmarks/bench.py --device cuda --compile --rounds 1 --attention cudnn --autotune \
    --only "infer/ViT-B/16/b(64|256)/bf16/(${I_IMPLS:-vitlab|timm})\$" --out "$LOGS/I2" >> "$LOGS/I.log" 2>&1
  grep -E "^\| infer|img/s" "$LOGS/I.log" | tail -n 12 | tee "$OUT/I.txt";; esac
case $PARTS in *C*) say "C CIFAR-10 plain ViT, $PART_C_MIN min per variant"
  # PART_C_SETS: the variants, '|'-separated, each extra arguments to the recipe's command ('' = the recipe)
  IFS='|' read -r -a variants <<< "${PART_C_SETS:-}"; [ ${#variants[@]} -eq 0 ] && variants=("")
  i=0; steps1=""
  for extra in "${variants[@]}"; do
    i=$((i + 1)); slack=1
    case $extra in *"{STEPS1}"*)  # the first variant's steps, e.g. fp8 at the steps the recipe took in bf16
      [ -n "$steps1" ] || { echo "C$i ($extra): skipped, the first variant printed no steps" | tee -a "$OUT/C.txt"; continue; }
      extra=${extra//\{STEPS1\}/$steps1}; slack=1.4;; esac
    say "C$i: the recipe $extra"; rm -f "$LOGS/C$i.log.steps"  # an earlier call's, on a machine still warm
    # shellcheck disable=SC2086  # the variant's arguments are meant to split
    timeout "$(python3 -c "print(int(float('$PART_C_MIN') * 60 * $slack + 90))")" python3 -m vitlab train \
      --recipe cifar10_scratch:model=vit --data .gpu/cifar10-train.tar.gz --time-limit "$PART_C_MIN" $extra \
      --out "/tmp/run-c$i" --overwrite > "$LOGS/C$i.log" 2>&1
    # the accuracy and MFU line: from this run's printed summary (a summary.json of an earlier call could be stale)
    python3 - "$LOGS/C$i.log" "C$i ($extra)" <<'PY' 2>&1 | tee -a "$OUT/C.txt"
import json, sys
printed = [line for line in open(sys.argv[1]) if line.startswith("{")]
if not printed:
    sys.exit(f"{sys.argv[2]}: no summary printed (see its log)")
s = json.loads(printed[-1])
keys = ("steps", "val_top1", "val_top1_flip", "val_top1_single", "val_top1_views", "wall_s", "train_flops_per_image",
        "step_images_per_s", "achieved_tflops", "peak_bf16_tflops", "mfu", "data_wait")
print(sys.argv[2] + ":", " ".join(f"{k}={s.get(k)}" for k in keys), f"(model {s.get('model')})")
open(sys.argv[1] + ".steps", "w").write(str(s.get("steps") or ""))  # for a later variant's {STEPS1}
PY
    [ $i -eq 1 ] && steps1=$(cat "$LOGS/C1.log.steps" 2>/dev/null)
  done;; esac
case $PARTS in *D*) say "D ViT-B/16 paper_pretrain: memory vs shards"
  python3 - <<'PY'
import os, numpy as np
from multiprocessing import Pool
from PIL import Image
def one(i):  # ImageNet-like photographs: 500x375, quality 90
    rng = np.random.default_rng(i); h, w = 375, 500
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6*xx*rng.uniform(.5, 2)+c)*np.cos(4*yy*rng.uniform(.5, 2)+c) for c in range(3)], -1)
    px = np.clip(128+100*base+rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    d = f"/tmp/imgs-d/c{i % 100:03d}"; os.makedirs(d, exist_ok=True); Image.fromarray(px).save(f"{d}/{i}.jpg", quality=90)
with Pool(os.cpu_count()) as p: p.map(one, range(4096))
PY
  python3 -m vitlab pack-shards /tmp/imgs-d /tmp/shards-d --per-shard 128 > /dev/null 2>&1
  common="--recipe paper_pretrain:dataset=i21k --model ViT-B/16 --val-split 0 --batch-size 128 --steps 150 --set optim.warmup=10"
  timeout 100 python3 -m vitlab train $common --data /tmp/imgs-d --stream memory --out /tmp/run-dm --overwrite > "$LOGS/D-memory.log" 2>&1
  timeout 120 python3 -m vitlab train $common --data /tmp/shards-d --out /tmp/run-ds --overwrite > "$LOGS/D-shards.log" 2>&1
  for f in D-memory D-shards; do echo "$f: $(grep -o '[0-9,]* img/s' "$LOGS/$f.log" | tail -n 1)"; done | tee "$OUT/D.txt";; esac
say "done"
