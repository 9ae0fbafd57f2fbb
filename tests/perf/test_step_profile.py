"""benchmarks/step_profile.py's sorting of a GPU step's kernels by kind, on names as CUDA's
profiler reports them (cuBLAS, cuDNN-free attention, inductor's Triton kernels, torch's own)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_profile  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("triton_tem_fused_addmm_gelu_3", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k32_sm80", "attention"),  # a cutlass kernel, but attention's
    ("triton_per_fused_add_native_layer_norm_native_layer_norm_backward_7", "normalisation"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimiser (multi-tensor)"),
    ("triton_poi_fused_gelu_gelu_backward_12", "fused element-wise (inductor)"),
    ("Memcpy HtoD (Pinned -> Device)", "copies and fills"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>",
     "copies and fills"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "other"),
])
def test_a_kernel_is_sorted_by_its_name(name, kind):
    assert step_profile.kernel_kind(name) == kind


def test_the_kinds_add_up_per_step_largest_first():
    kernels = [("nvjet_tst_128x256", 300.0), ("triton_poi_fused_add_0", 50.0), ("nvjet_tst_64x64", 100.0),
               ("flash_bwd_kernel", 150.0)]
    assert step_profile.by_kind(kernels, steps=2) == {"matmul": 0.2, "attention": 0.075,
                                                      "fused element-wise (inductor)": 0.025}


def part_p_b16_arguments() -> list[str]:
    """The arguments gpu_check.sh's part P gives step_profile.py for its ViT-B/16 half (the variables left out)."""
    import shlex

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh").read_text().replace("\\\n", " ")
    line = next(line for line in script.splitlines() if "step_profile.py --recipe paper_pretrain" in line)
    return shlex.split(line.split("step_profile.py", 1)[1].split("${P_ARGS", 1)[0])


def test_part_p_maps_the_vit_b16_step_that_the_benchs_training_row_times(tmp_path):
    # "the trainer's ViT-B/16 step as bench.py's training row has it (bf16, compiled, batch 128)": the
    # paper_pretrain recipe is not compiled, and the half mapped an eager step against the bench's compiled one
    import dataclasses

    import torch

    import harness
    from vitlab.machine import Gpu, Machine
    from vitlab.train.distributed import World
    from vitlab.train.resolve import resolve

    args = step_profile.parse_args([*part_p_b16_arguments(), "--out", str(tmp_path / "run")])
    h200 = Gpu("NVIDIA H200", total_bytes=143 << 30, free_bytes=140 << 30, bf16=True, capability=(9, 0))
    machine = dataclasses.replace(Machine.described(cores=16, memory_available=120 << 30), gpus=(h200,))
    run = resolve(step_profile.config(args), World(0, 1, 0, torch.device("cuda:0")), machine)
    assert (run.config.model.name, run.config.optim.batch_size, run.precision) == ("ViT-B/16", 128, "bf16")
    # harness.graphed_training_step: the model in CUDA graphs, the update compiled into one of its own
    assert run.compile == harness.trainer_mode("vitlab") == run.compile_optimizer
