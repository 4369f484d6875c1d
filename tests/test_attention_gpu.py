"""Flash attention on the GPU: bf16 within 1e-2 and fp32 (IEEE dots) within 1e-4 of the float64 reference."""
import pytest
import torch

pytestmark = pytest.mark.cuda

CASES = [  # B, T, H, KV, hd, dtype, causal
    (2, 1000, 12, 4, 64, torch.bfloat16, True),    # rb100m heads, T not a multiple of any tile
    (1, 1024, 24, 24, 64, torch.bfloat16, True),   # prof183m heads
    (1, 777, 16, 16, 128, torch.bfloat16, True),   # dense1b head dim
    (1, 513, 48, 48, 64, torch.bfloat16, True),    # moe4b heads
    (2, 257, 8, 1, 128, torch.bfloat16, True),     # one KV head
    (1, 1, 4, 2, 64, torch.bfloat16, True),        # a single position
    (1, 300, 6, 2, 64, torch.float32, True),       # fp32 with input_precision="ieee"
    (1, 300, 6, 3, 128, torch.float32, True),
    (1, 200, 6, 2, 64, torch.bfloat16, False),     # non-causal
    (1, 200, 6, 2, 64, torch.float16, True),
    (1, 4099, 4, 2, 64, torch.bfloat16, True),     # from LONG_SEQUENCE on: the long-sequence configs, T not a multiple of any tile
]

@pytest.mark.parametrize("B,T,H,KV,hd,dtype,causal", CASES)
def test_flash_attention_gpu_parity(B, T, H, KV, hd, dtype, causal):
    if not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU")
    from rtrainer.attention import attention_parity_errors
    errors = attention_parity_errors(B, T, H, KV, hd, dtype, causal, device="cuda")
    print(f"B{B} T{T} H{H} KV{KV} hd{hd} {dtype} causal={causal}:", {k: f"{e:.1e}" for k, e in errors.items()})
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 1e-2), errors

def test_benchmark_suite_quick_runs():
    if not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU")
    from rtrainer.attention import benchmark_suite
    rows = benchmark_suite(quick=True)
    assert rows and all(r["fwd_bwd_tflops"] > 0 for r in rows)

@pytest.mark.parametrize("B,T,H,KV,hd", [(2, 1000, 12, 4, 64), (1, 777, 16, 16, 128)])
def test_rope_attention_gpu_is_the_ops_one_by_one(B, T, H, KV, hd):
    "The model's fused RoPE + attention op in bf16 on the GPU: equal to the ops one by one, within 1e-2 of float64."
    if not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU")
    from rtrainer.attention import rope_attention_errors
    error, same = rope_attention_errors(B, T, H, KV, hd, torch.bfloat16, device="cuda")
    print(f"B{B} T{T} H{H} KV{KV} hd{hd}: error {error:.1e}, equal to the ops one by one: {same}")
    assert same and error < 1e-2, error
