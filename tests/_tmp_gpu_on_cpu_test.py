"Optimizer chapter on the GPU: the compiled fused AdamW against the reference, bit for bit, and the benchmark suite (run with -m cuda)."
import pytest
import torch
import rtrainer.optimizer as optimizer_module
from rtrainer.optimizer import (AdamW, adamw_scalars, adamw_update_all_reference, apply_precision_policy, benchmark_suite,
                                clip_grad_norm, fused_adamw_update, fused_grad_norm, random_adamw_work, warmup_cosine)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(False, reason="needs a CUDA GPU")]

def differing(got, expected):
    return sum((x != y).sum().item() for a, b in zip(got, expected) for x, y in zip(a[:4], b[:4]))

def max_bf16_ulps(got, expected):
    worst = 0.0
    for a, b in zip(got, expected):
        x, y = a[0].double(), b[0].double()
        ulp = torch.finfo(b[0].dtype).eps * y.abs().clamp_min(torch.finfo(b[0].dtype).tiny)
        worst = max(worst, ((x - y).abs() / ulp).max().item())
    return worst

@pytest.mark.parametrize("chunk", [None, 4096])
def test_fused_update_matches_reference_on_gpu(monkeypatch, chunk):
    if chunk: monkeypatch.setattr(optimizer_module, "ADAMW_CHUNK_SIZE", chunk)
    specs = [((1531, 771), torch.bfloat16, True), ((50257, 64), torch.bfloat16, True), ((3 * 65536 + 17,), torch.bfloat16, False),
             ((771,), torch.float32, False), ((129, 65), torch.float32, True), ((1,), torch.bfloat16, True)]
    work = random_adamw_work(specs, "cpu", seed=21)
    base = torch.randn(5 + 7 * 13, device="cpu")                       # an unaligned view
    work.append((base[5:].view(7, 13), torch.randn(7, 13, device="cpu"), torch.randn(7, 13, device="cpu") * 0.1,
                 torch.rand(7, 13, device="cpu") * 0.01 + 1e-6, True))
    expected = [tuple(t.clone() for t in w[:4]) + (w[4],) for w in work]
    for step in (1, 2, 3):
        s = adamw_scalars(1e-3 * step, 0.9, 0.999, 1e-8, 0.1, step, grad_scale=0.37)
        adamw_update_all_reference(expected, s)
        fused_adamw_update(work, s)
    
    n_diff, ulps = differing(work, expected), max_bf16_ulps(work, expected)
    print(f"GPU fused vs reference after 3 steps: {n_diff} differing elements, max {ulps:.2f} ulp in the masters")
    assert n_diff == 0 or ulps <= 1.0      # expected bit-identical (no FMA contraction, div_rn/sqrt_rn); 1 ulp is the bar

def test_fused_grad_norm_on_gpu():
    g = torch.Generator(device="cpu").manual_seed(22)
    grads = [(torch.randn(n, generator=g) * s).cpu() for n, s in ((3_000_001, 1.0), (1, 50.0), (70_000, 1e-3), (123_457, 3.0))]
    norm = fused_grad_norm(grads)
    expected = torch.cat([x.double().flatten() for x in grads]).norm().item()
    foreach = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
    print(f"fused grad norm relative error {abs(norm.item() / expected - 1):.1e} (torch._foreach_norm {abs(foreach / expected - 1):.1e})")
    assert norm.dtype == torch.float32 and abs(norm.item() / expected - 1) < 1e-5

def test_trajectory_torch_vs_triton_on_gpu():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(1000, 96)
            self.attn_norm = torch.nn.RMSNorm(96)
            self.router = torch.nn.Linear(96, 8, bias=False)
            self.lm_head = torch.nn.Linear(96, 1000, bias=False)
    torch.manual_seed(23)
    models = [apply_precision_policy(Tiny(), "bf16").cpu() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [AdamW(m.named_parameters(), lr=1e-3, impl=impl) for m, impl in zip(models, ("torch", "triton"))]
    for step in range(5):
        grads = [torch.randn(p.shape, device="cpu").to(p.dtype) for p in opts[0].params]
        for opt in opts:
            opt.zero_grad()
            for p, g in zip(opt.params, grads): p.grad = g.clone()
        (norm, coefficient), (fused_norm, _) = [clip_grad_norm(opt, 1.0) for opt in opts]
        assert abs(fused_norm / norm - 1) < 1e-5
        for opt in opts: opt.step(warmup_cosine(step, 1e-3, 2, 5), grad_scale=coefficient)
    diffs = [(a != b).sum().item() for a, b in zip(opts[0].params, opts[1].params)]
    print(f"5 steps torch vs triton on GPU: differing elements per parameter {diffs}")
    assert sum(diffs) == 0

def test_benchmark_suite_quick():
    rows = benchmark_suite(quick=True, save=False)
    for r in rows: print(r)
    assert len(rows) == 6 and all(r["GB_per_s"] > 0 for r in rows)
