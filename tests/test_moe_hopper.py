"CPU tests of the Hopper MoE GEMM's host side (03a): registration, refusals and the fallback to bmm; its kernel runs only on a GPU."
import os
import torch
if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
import rtrainer.moe as moe
from rtrainer import moe_hopper
from rtrainer.kernels import knob_values

def test_registers_itself_in_the_moe_fast_paths():
    assert moe.FAST_PATHS["grouped_gemm"] is moe_hopper._fast_grouped_gemm

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

def test_interleave_gate_up_pairs_columns():
    w = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)          # FF = 4: gate columns 0-3, up 4-7
    wi = moe_hopper.interleave_gate_up(w)
    assert torch.equal(wi[..., 0::2], w[..., :4]) and torch.equal(wi[..., 1::2], w[..., 4:])
