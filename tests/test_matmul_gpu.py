"GPU tests of rtrainer.matmul in bf16 against float64 (run on the GPU machine: pytest -m cuda tests/test_matmul_gpu.py)."
import pytest, torch
import rtrainer.matmul as mm
from rtrainer.kernels import start_gradient_step, gradient_fp32, relative_error

pytestmark = pytest.mark.cuda
BF16_TOL = 1e-2     # relative error of a bf16 result against float64 of the same bf16 inputs


@pytest.fixture(params=["cublas", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setattr(mm, "GEMM_DEFAULT_BACKEND", request.param)
    return request.param

@pytest.mark.parametrize("M,N,K,a_transposed,b_transposed", [(1000, 1003, 517, False, False), (777, 129, 2049, True, False),
                                                              (65, 4099, 300, False, True), (3, 1, 5, False, False)])
def test_triton_matmul_bf16(M, N, K, a_transposed, b_transposed):
    a = (torch.randn(K, M, device="cuda").t() if a_transposed else torch.randn(M, K, device="cuda")).bfloat16()
    b = (torch.randn(N, K, device="cuda").t() if b_transposed else torch.randn(K, N, device="cuda")).bfloat16()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    mm.triton_matmul(a, b, out=out)
    assert not out.isnan().any()
    assert relative_error(out, a.double() @ b.double()) < BF16_TOL

@pytest.mark.parametrize("use_triton", [True, False])
def test_bf16_gemm_into_fp32_writes_then_adds(use_triton, monkeypatch):
    monkeypatch.setattr(mm, "GEMM_DEFAULT_BACKEND", "triton" if use_triton else "cublas")
    x = torch.randn(3001, 257, device="cuda").bfloat16()      # (positions, in)
    dy = torch.randn(3001, 515, device="cuda").bfloat16()     # (positions, out)
    out = torch.full((257, 515), float("nan"), device="cuda")
    mm.gemm_into_fp32(x.t(), dy, out, accumulate=False)
    expected = x.double().t() @ dy.double()
    assert relative_error(out, expected) < 1e-5               # fp32 result: no bf16 rounding of the product
    mm.gemm_into_fp32(x.t(), dy, out, accumulate=True)
    assert relative_error(out, 2 * expected) < 1e-5

def test_linear_bf16_two_micro_batches(backend):
    weight = torch.nn.Parameter((torch.randn(769, 1411, device="cuda") / 769**0.5).bfloat16())
    w64 = weight.detach().double()
    xs = [torch.randn(3, 337, 769, device="cuda").bfloat16().requires_grad_() for _ in range(3)]
    dys = [torch.randn(3, 337, 1411, device="cuda").bfloat16() for _ in range(3)]
    flat = lambda t: t.detach().double().reshape(-1, t.shape[-1])
    start_gradient_step([weight])
    weight.main_grad = torch.full(weight.shape, float("nan"), device="cuda")   # poisoned: the first write must overwrite
    weight.main_grad_written = False
    for x, dy in zip(xs[:2], dys[:2]):
        y = mm.linear_fp32_weight_grad(x, weight)
        assert y.dtype == torch.bfloat16 and relative_error(y, x.detach().double() @ w64) < BF16_TOL
        y.backward(dy)
        assert relative_error(x.grad, dy.double() @ w64.t()) < BF16_TOL
    assert weight.grad is None and weight.main_grad.dtype == torch.float32
    assert relative_error(gradient_fp32(weight), sum(flat(x).t() @ flat(dy) for x, dy in zip(xs[:2], dys[:2]))) < 1e-4
    start_gradient_step([weight])
    mm.linear_fp32_weight_grad(xs[2], weight).backward(dys[2])
    assert relative_error(weight.main_grad, flat(xs[2]).t() @ flat(dys[2])) < 1e-4

@pytest.mark.parametrize("chunk_rows,transposed", [(8192, False), (384, False), (384, True)])
def test_fused_cross_entropy_bf16_odd_shapes(backend, chunk_rows, transposed, monkeypatch):
    "transposed: the weight is a tied (VP, D) embedding table, its gradient written in that layout."
    monkeypatch.setattr(mm, "CE_CHUNK_ROWS", chunk_rows)
    N, D, V, VP = 1000, 259, 1003, 1024
    head = torch.nn.Parameter((torch.randn(*((VP, D) if transposed else (D, VP)), device="cuda") / D**0.5).bfloat16())
    head64 = head.detach().double().requires_grad_()
    start_gradient_step([head])
    head.main_grad = torch.full(head.shape, float("nan"), device="cuda"); head.main_grad_written = False
    for _ in range(2):
        hidden = (2 * torch.randn(N, D, device="cuda")).bfloat16().requires_grad_()
        targets = torch.randint(0, V, (N,), device="cuda"); targets[::7] = mm.IGNORE_INDEX; targets[0] = V - 1
        loss = mm.linear_cross_entropy(hidden, head, targets, V, weight_transposed=transposed)
        hidden64 = hidden.detach().double().requires_grad_()
        ref = mm.linear_cross_entropy_reference(hidden64, head64, targets, V, weight_transposed=transposed)
        (2 * loss).backward(); (2 * ref).backward()
        assert torch.isfinite(loss) and relative_error(loss, ref.detach()) < 2e-3
        assert not hidden.grad.isnan().any() and relative_error(hidden.grad, hidden64.grad) < BF16_TOL
    assert head.grad is None
    assert not head.main_grad.isnan().any() and relative_error(gradient_fp32(head), head64.grad) < BF16_TOL

def test_fused_cross_entropy_saves_memory():
    "At an lm-head shape, peak memory of fwd + bwd stays below half of what the bf16 logits alone take."
    N, D, V, VP = 32768, 768, 32004, 32064    # rb100m
    head = torch.nn.Parameter((torch.randn(D, VP, device="cuda") / D**0.5).bfloat16())
    hidden = torch.randn(N, D, device="cuda").bfloat16().requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda")
    start_gradient_step([head]); mm.linear_cross_entropy(hidden, head, targets, V).backward()   # warm up, main_grad allocated
    start_gradient_step([head]); hidden.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    mm.linear_cross_entropy(hidden, head, targets, V).backward(); torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits_bf16 = N * VP * 2
    print(f"peak {peak / 2**20:.0f} MiB, all bf16 logits would be {full_logits_bf16 / 2**20:.0f} MiB")
    assert peak < full_logits_bf16 / 2
