"CPU tests of the Hopper MoE GEMM's host side (03a): registration, refusals and the fallback to bmm; its kernel runs only on a GPU."
import torch
import pytest
import rtrainer.moe as moe
from rtrainer import moe_hopper
from rtrainer.kernels import knob_values

def test_registers_itself_in_the_moe_fast_paths():
    assert moe.FAST_PATHS["grouped_gemm"] is moe_hopper._fast_grouped_gemm
    assert moe.FAST_PATHS["grouped_gemm_swiglu"] is moe_hopper._fast_grouped_gemm_swiglu
    assert moe.FAST_PATHS["dropless_row_align"] is moe_hopper._dropless_row_align

def test_cpu_operands_are_refused_and_take_bmm():
    torch.manual_seed(0)
    E, C, K, N = 3, 128, 64, 256
    rows, weight = torch.randn(E * C, K), torch.randn(E, K, N)
    assert moe_hopper.hopper_gemm_refusal(rows.bfloat16(), weight.bfloat16(), C) == "not on a CUDA device"
    with pytest.raises(ValueError, match="hopper_grouped_gemm: not on a CUDA device"):
        moe_hopper.hopper_grouped_gemm(rows.bfloat16(), weight.bfloat16())
    before = sum(moe_hopper.CALLS.values())
    starts = torch.arange(E, dtype=torch.int32) * C
    out = moe.grouped_gemm_library(rows, weight, starts, starts + C, capacity=C)   # refused: bmm
    assert sum(moe_hopper.CALLS.values()) == before
    assert torch.equal(out, torch.bmm(rows.view(E, C, K), weight).view(E * C, N))

def test_disabled_says_so():
    rows, weight = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    with knob_values(moe_hopper, {"ENABLED": False}):
        assert moe_hopper.hopper_gemm_refusal(rows, weight, 128).startswith("disabled")

def test_cpu_layer_runs_the_separate_swiglu():
    rows, gate_up = torch.zeros(2 * 128, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    top_experts = torch.tensor([[0, 1]] * 128)
    capacity, dropless = moe.capacity_plan(top_experts, 2, 1.0), moe.dropless_plan(top_experts, 2)
    assert capacity.capacity == 128
    assert moe.grouped_gemm_swiglu_fast(rows, gate_up, capacity) is None     # refused: the layer runs bmm + swiglu_forward
    assert moe.grouped_gemm_swiglu_fast(rows, gate_up, dropless) is None     # packed dropless groups: never offered

def test_dropless_alignment_only_where_the_kernel_runs():
    assert moe.dropless_row_align(torch.zeros(4, 64, dtype=torch.bfloat16)) == 1   # CPU: packed groups
    rows, weight = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    assert moe_hopper.hopper_gemm_refusal(rows, weight, 0, row_align=64).startswith("not on a CUDA")
