"GPU checks of the MoE chapter: bf16 Triton layer vs a float64 reference, fp32 parity, kernel timings run by benchmark_suite."
import pytest, torch
from rtrainer.moe import (MoeFeedForward, compare_triton_to_torch, grouped_gemm_triton, grouped_gemm_weight_grad_triton,
                          grouped_gemm_reference, benchmark_suite)
from rtrainer.kernels import start_gradient_step, gradient_fp32, load_results

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU", allow_module_level=True)

def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()

@pytest.mark.parametrize("dispatch,capacity_factor", [("capacity", 1.0), ("capacity", 0.7), ("dropless", 1.0)])
def test_fp32_layer_matches_float64(dispatch, capacity_factor):
    errors = compare_triton_to_torch(96, 160, 8, 2, 1001, dispatch, capacity_factor, shared_expert_d_ff=64, device="cuda")
    print(dispatch, errors)
    assert max(errors.values()) < 1e-4, errors

@pytest.mark.parametrize("sizes", [[0, 300, 1, 129, 0, 1000, 64, 7], [4096] * 8])
def test_grouped_gemm_bf16(sizes):
    torch.manual_seed(0)
    s = torch.tensor(sizes); ends = s.cumsum(0); starts = ends - s
    R, K, N = int(s.sum()), 512, 768
    a = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), K, N, device="cuda", dtype=torch.bfloat16) * 0.05
    out = torch.full((R, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_gemm_triton(a, w, starts.cuda(), ends.cuda(), out=out)
    want = grouped_gemm_reference(a.double(), w.double(), starts, ends)
    err = rel(out, want); print("forward", err)
    assert not out.isnan().any() and err < 1e-2
    dc = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    dw = torch.full(w.shape, float("nan"), device="cuda")
    grouped_gemm_weight_grad_triton(a, dc, starts.cuda(), ends.cuda(), out=dw)
    dw_want = torch.stack([a[x:y].double().T @ dc[x:y].double() for x, y in zip(starts.tolist(), ends.tolist())])
    err = rel(dw, dw_want); print("weight grad", err)
    assert not dw.isnan().any() and err < 1e-2

@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_bf16_layer_close_to_float64(dispatch):
    torch.manual_seed(1)
    D, FF, E, k, N = 512, 384, 8, 2, 4000
    fast = MoeFeedForward(D, FF, E, k, dispatch=dispatch, shared_expert_d_ff=256, impl="triton", dtype=torch.bfloat16, device="cuda")
    oracle = MoeFeedForward(D, FF, E, k, dispatch=dispatch, shared_expert_d_ff=256, impl="torch", dtype=torch.float64, device="cuda")
    with torch.no_grad():
        for p64, p in zip(oracle.parameters(), fast.parameters()): p64.copy_(p.double())
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    probe = torch.randn(N, D, device="cuda", dtype=torch.float64)
    start_gradient_step(fast.parameters())
    y = fast(x); (y.double() * probe).sum().backward()
    y64 = oracle(x64); (y64 * probe).sum().backward()
    errors = dict(y=rel(y, y64), x=rel(x.grad, x64.grad),
                  **{n: rel(gradient_fp32(p), p64.grad) for (n, p), p64 in zip(fast.named_parameters(), oracle.parameters())})
    print(dispatch, errors)
    assert max(errors.values()) < 3e-2, errors
    assert fast.experts_gate_up.main_grad.dtype == torch.float32

def test_benchmark_suite_quick_runs():
    path = benchmark_suite(quick=True, rounds=2)
    res = load_results("moe_quick")
    assert res is not None and len(res["rows"]) == 4 and all(r["ms"] > 0 for r in res["rows"]), path
