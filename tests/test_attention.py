"""Flash attention parity on the CPU through Triton's interpreter: fp32/fp16, odd lengths, with and without GQA."""
import pytest
import torch

from rtrainer import attention
from rtrainer.attention import attention_parity_errors, flash_attention, attention_reference, fused_qkv_views
from rtrainer.kernels import get_op

pytestmark = pytest.mark.skipif(not attention.INTERPRETING, reason="CPU tests need TRITON_INTERPRET=1 set before rtrainer.attention is imported")

CASES = [  # B, T, H, KV, hd, dtype, causal
    (1, 1, 4, 4, 16, torch.float32, True),      # a single position
    (2, 17, 4, 4, 16, torch.float32, True),     # multi-head, T = tile + 1
    (1, 33, 4, 2, 16, torch.float32, True),     # groups of 2
    (2, 33, 4, 1, 16, torch.float32, True),     # one KV head for all
    (1, 20, 4, 2, 64, torch.float32, True),     # head dim 64
    (1, 17, 4, 1, 32, torch.float16, True),     # fp16 through tl.dot
    (1, 33, 4, 2, 16, torch.float32, False),    # non-causal
]

@pytest.mark.parametrize("B,T,H,KV,hd,dtype,causal", CASES)
def test_flash_attention_matches_float64_reference(B, T, H, KV, hd, dtype, causal):
    errors = attention_parity_errors(B, T, H, KV, hd, dtype, causal)
    print(f"B{B} T{T} H{H} KV{KV} hd{hd} {dtype} causal={causal}:", {k: f"{e:.1e}" for k, e in errors.items()})
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 2e-3), errors

def test_registered_as_triton_attention():
    assert get_op("attention", "triton") is flash_attention
    q, k, v = fused_qkv_views(1, 9, 4, 2, 16)
    out = get_op("attention", "triton")(q, k, v)
    ref = attention_reference(q.double(), k.double(), v.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4

def test_gradients_flow_into_fused_projection():
    "q, k, v as views of one leaf qkv: autograd must deliver all three slices of its gradient."
    B, T, H, KV, hd = 1, 19, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * KV) * hd, requires_grad=True)
    split = lambda t: [s.unflatten(-1, (n, hd)) for s, n in zip(t.split([H * hd, KV * hd, KV * hd], -1), (H, KV, KV))]
    do = torch.randn(B, T, H, hd)
    flash_attention(*split(qkv)).backward(do)
    qkv64 = qkv.detach().double().requires_grad_()
    attention_reference(*split(qkv64)).backward(do.double())
    err = ((qkv.grad.double() - qkv64.grad).norm() / qkv64.grad.norm()).item()
    print("fused qkv gradient relative error:", err)
    assert err < 1e-4

@pytest.mark.parametrize("bad", ["heads", "head_dim", "dtype"])
def test_rejects_bad_inputs(bad):
    q, k, v = fused_qkv_views(1, 5, 4, 2, 16)
    if bad == "heads": k, v = fused_qkv_views(1, 5, 3, 3, 16)[1:]
    if bad == "head_dim": q, k, v = fused_qkv_views(1, 5, 4, 2, 24)
    if bad == "dtype": q = q.double()
    with pytest.raises(ValueError, match="flash_attention"):
        flash_attention(q, k, v)

def test_explicit_configs_match_float64_reference():
    # the sweep's path: each kernel launched alone with a config of the caller's, other tiles than the default 16 x 16
    torch.manual_seed(3)
    B, T, H, KV, hd = 1, 45, 4, 2, 16
    q, k, v = fused_qkv_views(B, T, H, KV, hd)
    do = torch.randn(B, T, H, hd)
    nan = lambda *shape: torch.full(shape, float("nan"))
    o, lse = attention.flash_attention_forward(q, k, v, True, o=nan(B, T, H, hd), lse=nan(B, H, T),
                                               config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2))
    dq, delta = attention.flash_backward_dq(do, q, k, v, o, lse, True, dq=nan(B, T, H, hd), delta=nan(B, H, T),
                                            config=dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2))
    dk, dv = attention.flash_backward_dkdv(do, q, k, v, lse, delta, True, dk=nan(B, T, KV, hd), dv=nan(B, T, KV, hd),
                                           config=dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=2))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, True)
    grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, got, want in (("o", o, ref), ("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2]),
                            ("delta", delta, (o.double() * do.double()).sum(-1).transpose(1, 2))):
        err = attention.relative_error(got, want)
        print(name, f"{err:.1e}")
        assert got.isfinite().all() and err < 1e-4, (name, err)

def test_tuned_config_picks_by_head_dim_and_length():
    L = attention.LONG_SEQUENCE
    short64, long64 = (attention.tuned_config("dkdv", 64, T) for T in (L - 1, L))
    assert short64 == dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3, maxnreg=168)
    assert long64 == dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)        # no register cap
    assert attention.tuned_config("forward", 16, 4 * L) == attention.tuned_config("forward", 64, 4 * L)   # 16 and 32 take 64's
    assert attention.tuned_config("dq", 64, L)["num_warps"] == 8 and attention.tuned_config("dq", 64, 1024)["num_warps"] == 4
    assert attention.tuned_config("forward", 64, L) == attention.tuned_config("forward", 64, 1024)      # one forward tile at head dim 64
    for kernel in ("forward", "dq", "dkdv"):
        for hd in attention.SUPPORTED_HEAD_DIMS:
            for T in (1, 1024, L - 1, L, 8192):
                c = attention.tuned_config(kernel, hd, T)
                m, n = c["BLOCK_M"], c["BLOCK_N"]
                assert (n % m if kernel == "dkdv" else m % n) == 0, (kernel, hd, T, c)

@pytest.mark.parametrize("B,T,H,KV,hd,dtype", [(1, 17, 4, 2, 16, torch.float32), (2, 9, 2, 2, 32, torch.float32),
                                              (1, 33, 6, 3, 64, torch.float32), (1, 17, 4, 1, 16, torch.float16)])
def test_rope_attention_is_the_ops_one_by_one(B, T, H, KV, hd, dtype):
    "The fused op: the output and qkv gradient of rope + flash attention + autograd's concatenation, bit for bit, and near float64."
    from rtrainer.attention import rope_attention_errors
    error, same = rope_attention_errors(B, T, H, KV, hd, dtype)
    assert same and error < (1e-4 if dtype == torch.float32 else 2e-3), error

def test_rope_attention_registration_and_bad_shape():
    from rtrainer.attention import rope_attention_triton, rope_attention_reference
    assert get_op("rope_attention", "triton") is rope_attention_triton and get_op("rope_attention", "torch") is rope_attention_reference
    cos, sin = torch.ones(8, 8), torch.zeros(8, 8)
    with pytest.raises(ValueError, match=r"qkv must be \(B, T, 4 \+ 2 x 2, hd\)"):
        rope_attention_triton(torch.randn(1, 8, 7, 16), cos, sin, 4, 2)

def test_backward_writes_into_strided_views_and_checks_them():
    "dq, dk, dv may be slices of one buffer (unit stride in the last dim); dk and dv must share strides."
    from rtrainer.attention import flash_attention_forward, flash_attention_backward
    B, T, H, KV, hd = 1, 9, 4, 2, 16
    q, k, v = fused_qkv_views(B, T, H, KV, hd)
    do = torch.randn(B, T, H, hd)
    o, lse = flash_attention_forward(q, k, v)
    expected = flash_attention_backward(do, q, k, v, o, lse)
    buf = torch.full((B, T, H + 2 * KV, hd), float("nan"))
    got = flash_attention_backward(do, q, k, v, o, lse, dq=buf[:, :, :H], dk=buf[:, :, H:H + KV], dv=buf[:, :, H + KV:])
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and buf.isfinite().all()
    with pytest.raises(ValueError, match="dk and dv must share their strides"):
        flash_attention_backward(do, q, k, v, o, lse, dk=buf[:, :, H:H + KV], dv=torch.empty(B, T, KV, hd))

def test_fast_paths_get_the_checked_outputs_and_may_decline():
    "A registered fast path receives the validated output buffers; its result is returned, and None falls back to Triton."
    from rtrainer.attention import FAST_PATHS, flash_attention_forward, flash_backward_dq, flash_backward_dkdv, relative_error
    saved = dict(FAST_PATHS)
    seen = {}
    try:
        q, k, v = fused_qkv_views(1, 19, 4, 2, 64, torch.float32)
        def forward(q_, k_, v_, causal, o, lse):
            seen["forward"] = (tuple(o.shape), o.dtype, tuple(lse.shape), lse.dtype, causal)
            o.fill_(7.0); lse.fill_(3.0)
            return o, lse
        FAST_PATHS["forward"] = forward
        o, lse = flash_attention_forward(q, k, v, True)
        assert seen["forward"] == ((1, 19, 4, 64), torch.float32, (1, 4, 19), torch.float32, True)
        assert torch.all(o == 7.0) and torch.all(lse == 3.0)
        FAST_PATHS["forward"] = lambda *args: None                       # declines: the Triton kernel runs
        o, lse = flash_attention_forward(q, k, v, True)
        assert relative_error(o, attention_reference(q.double(), k.double(), v.double(), True)) < 1e-4
        FAST_PATHS["dq"] = lambda do, q_, k_, v_, o_, lse_, causal, dq, delta: seen.setdefault("dq", (tuple(dq.shape), tuple(delta.shape))) and None
        dq, delta = flash_backward_dq(torch.randn_like(o), q, k, v, o, lse, True)
        assert seen["dq"] == ((1, 19, 4, 64), (1, 4, 19)) and dq.isfinite().all() and delta.isfinite().all()
        def dkdv(do, q_, k_, v_, lse_, delta_, causal, dk, dv):
            seen["dkdv"] = (tuple(dk.shape), tuple(dv.shape), dk.dtype, causal)
            dk.fill_(5.0); dv.fill_(6.0)
            return dk, dv
        FAST_PATHS["dkdv"] = dkdv
        dk, dv = flash_backward_dkdv(torch.randn_like(o), q, k, v, lse, delta, True)
        assert seen["dkdv"] == ((1, 19, 2, 64), (1, 19, 2, 64), torch.float32, True)
        assert torch.all(dk == 5.0) and torch.all(dv == 6.0)
        FAST_PATHS["dkdv"] = lambda *args: None
        dk, dv = flash_backward_dkdv(torch.randn_like(o), q, k, v, lse, delta, True)
        assert dk.isfinite().all() and dv.isfinite().all() and dk.abs().max() != 5.0
    finally:
        FAST_PATHS.clear(); FAST_PATHS.update(saved)


def test_attention_benchmark_inputs_repeat_kv_to_every_head():
    B, H, KV, T, hd = 2, 6, 2, 5, 8
    q, k, v, do, k_rep, v_rep = attention.attention_benchmark_inputs(B, H, KV, T, hd, device="cpu", dtype=torch.float32)
    assert q.shape == do.shape == (B, T, H, hd) and k.shape == v.shape == (B, T, KV, hd)
    assert all(t.requires_grad for t in (q, k, v, k_rep, v_rep)) and k_rep.is_leaf and v_rep.is_leaf
    for rep, src in ((k_rep, k), (v_rep, v)):
        assert rep.shape == (B, T, H, hd)
        for h in range(H): assert torch.equal(rep[:, :, h], src[:, :, h // (H // KV)].detach())
