"Optimizer chapter: precision policy, AdamW against float64, clipping, schedules, state, and the fused kernel in Triton's interpreter."
import json, math
import torch
import pytest
import rtrainer.optimizer as optimizer_module
from rtrainer.kernels import accumulate_main_grad
from rtrainer.optimizer import (AdamW, adamw_scalars, adamw_update_all_reference, apply_precision_policy, clip_coefficient,
                                clip_grad_norm, constant, fused_adamw_update, fused_grad_norm, kernels_can_run, parameter_kind,
                                policy_dtype, random_adamw_work, warmup_cosine)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not kernels_can_run(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")

def adamw_float64(param, grad, m, v, decay, lr, beta1, beta2, eps, wd, step, grad_scale=1.0):
    p, g, m, v = (t.double() for t in (param, grad, m, v))
    g = g * grad_scale
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1 ** step), v / (1 - beta2 ** step)
    if decay: p = p - lr * wd * p
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v

def rel(a, b): return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

def named(*specs, seed=0):
    "Parameters for (name, shape, dtype) specs, random, never zero."
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))) for n, shape, dtype in specs]

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(13, 6)
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict(dict(attn_norm=torch.nn.RMSNorm(6),
                                                                     router=torch.nn.Linear(6, 3, bias=False)))])
        self.lm_head = torch.nn.Linear(6, 13, bias=False)

# ---------------------------------------------------------------- precision policy
def test_parameter_kind_and_policy():
    assert [parameter_kind(n) for n in ("blocks.0.attn_norm.weight", "final_norm.weight", "blocks.2.moe.router.weight",
            "embedding.weight", "lm_head.weight", "blocks.0.attn.qkv.weight", "blocks.1.moe.experts_gate_up")] == \
        ["norm", "norm", "router", "matrix", "matrix", "matrix", "matrix"]
    assert policy_dtype("blocks.0.ffn.down.weight", "bf16") == torch.bfloat16
    assert policy_dtype("blocks.0.ffn_norm.weight", "bf16") == torch.float32
    assert policy_dtype("blocks.0.moe.router.weight", "bf16") == torch.float32
    assert policy_dtype("lm_head.weight", "fp32") == torch.float32
    with pytest.raises(ValueError, match="precision"): policy_dtype("lm_head.weight", "fp16")

def test_apply_precision_policy():
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert apply_precision_policy(model, "bf16") is model
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes == {"embedding.weight": torch.bfloat16, "blocks.0.attn_norm.weight": torch.float32,
                      "blocks.0.router.weight": torch.float32, "lm_head.weight": torch.bfloat16}
    for n, p in model.named_parameters(): assert torch.equal(p, before[n].to(p.dtype))
    apply_precision_policy(model, "fp32")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError): apply_precision_policy(model, "int8")

# ---------------------------------------------------------------- one step against float64
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_fp32_step_matches_float64(impl):
    params = named(("w.weight", (13, 7), torch.float32), ("w_norm.weight", (7,), torch.float32),
                   ("router.weight", (7, 3), torch.float32), seed=1)
    params = [(n, torch.nn.Parameter(p.data.to(DEVICE))) for n, p in params]
    opt = AdamW(params, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.2, impl=impl)
    assert opt.decays == [True, False, True]
    moments = {}
    for step in range(1, 4):
        opt.zero_grad()
        for p in opt.params: p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in opt.params]
        grads = [p.grad.clone() for p in opt.params]
        opt.step(2e-3 * step, grad_scale=0.7)
        assert opt.step_count == step
        for i, (n, p) in enumerate(zip(opt.names, opt.params)):
            m, v = moments.get(n, (torch.zeros_like(p), torch.zeros_like(p)))
            p64, m64, v64 = adamw_float64(before[i], grads[i], m, v, opt.decays[i], 2e-3 * step, 0.8, 0.99, 1e-7, 0.2, step, 0.7)
            moments[n] = (m64, v64)
            errors = rel(p, p64), rel(opt.exp_avg[n], m64), rel(opt.exp_avg_sq[n], v64)
            print(f"{impl} step {step} {n}: relative error param {errors[0]:.1e} m {errors[1]:.1e} v {errors[2]:.1e}")
            assert max(errors) < 1e-6

@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_bf16_master_rounds_fp32_result_to_nearest_even(impl):
    params = named(("w.weight", (31, 9), torch.bfloat16), ("x_norm.weight", (9,), torch.bfloat16), seed=2)
    params = [(n, torch.nn.Parameter(p.data.to(DEVICE))) for n, p in params]
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, impl=impl)
    for p in opt.params: p.grad = torch.randn(p.shape, device=DEVICE).to(torch.bfloat16)
    before = [p.detach().clone() for p in opt.params]
    grads = [p.grad.float() for p in opt.params]
    opt.step(1e-2)
    mismatches, total = 0, 0
    for i, p in enumerate(opt.params):
        p64, _, _ = adamw_float64(before[i], grads[i], torch.zeros_like(grads[i]), torch.zeros_like(grads[i]), opt.decays[i],
                                  1e-2, 0.9, 0.999, 1e-8, 0.1, 1)
        mismatches += (p != p64.to(torch.bfloat16)).sum().item(); total += p.numel()
        assert p.dtype == torch.bfloat16
    print(f"{impl}: {mismatches} of {total} bf16 elements differ from float64 rounded to bf16")
    assert mismatches <= total // 1000     # only where the fp32 result sits across a bf16 tie from the float64 one

@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_exact_ties_round_to_even(impl):
    # grad -1 at step 1 with tiny eps makes the update exactly +lr; lr = 2^-8 puts both results exactly on a bf16 tie
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0078125, -1.0078125], dtype=torch.bfloat16, device=DEVICE))
    opt = AdamW([("tie_norm.weight", p)], lr=2 ** -8, eps=1e-30, impl=impl)
    p.grad = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.bfloat16, device=DEVICE)
    opt.step()
    # 1 + 2^-8 lies halfway between 1.0 (even) and 1.0078125 (odd); 1.0078125 + 2^-8 between 1.0078125 (odd) and 1.015625 (even)
    print(impl, p.tolist())
    assert p.tolist() == [1.0, 1.015625, -1.015625]

# ---------------------------------------------------------------- decay, skipping, step counter
def test_weight_decay_only_on_matrices():
    params = named(("blocks.0.attn.qkv.weight", (5, 4), torch.float32), ("blocks.0.attn_norm.weight", (4,), torch.float32),
                   ("weird_norm.weight", (2, 4), torch.float32), ("blocks.0.moe.router.weight", (4, 3), torch.float32),
                   ("some_bias", (4,), torch.float32), seed=3)
    opt = AdamW(params, lr=0.0, weight_decay=0.5)
    assert opt.decays == [True, False, False, True, False]
    decay_only = AdamW(named(("m.weight", (6, 5), torch.float32), ("m_norm.weight", (5,), torch.float32), seed=4), weight_decay=0.5)
    before = [p.detach().clone() for p in decay_only.params]
    for p in decay_only.params: p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in decay_only.params]
    decay_only.step(0.1)
    for i, decay in enumerate((True, False)):
        p64, _, _ = adamw_float64(before[i], grads[i], torch.zeros_like(grads[i]), torch.zeros_like(grads[i]), decay,
                                  0.1, 0.9, 0.999, 1e-8, 0.5, 1)
        without, _, _ = adamw_float64(before[i], grads[i], torch.zeros_like(grads[i]), torch.zeros_like(grads[i]), not decay,
                                      0.1, 0.9, 0.999, 1e-8, 0.5, 1)
        assert rel(decay_only.params[i], p64) < 1e-6 and rel(decay_only.params[i], without) > 1e-3

@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_params_without_gradient_are_skipped(impl):
    params = [(n, torch.nn.Parameter(p.data.to(DEVICE))) for n, p in
              named(("a.weight", (7, 3), torch.float32), ("b.weight", (5, 5), torch.bfloat16), seed=5)]
    opt = AdamW(params, lr=1e-2, impl=impl)
    b_before = opt.params[1].detach().clone()
    opt.params[0].grad = torch.randn(7, 3, device=DEVICE)
    opt.step()
    assert torch.equal(opt.params[1], b_before) and "b.weight" not in opt.exp_avg
    assert set(opt.state_tensors()) == {"exp_avg.a.weight", "exp_avg_sq.a.weight"}
    a_moments = [t.clone() for t in opt.state_tensors().values()]
    opt.zero_grad()
    opt.params[1].grad = torch.randn(5, 5, device=DEVICE).to(torch.bfloat16)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(a_moments, [opt.exp_avg["a.weight"], opt.exp_avg_sq["a.weight"]]))
    assert not torch.equal(opt.params[1], b_before) and opt.step_count == 2
    opt.zero_grad()
    assert opt.grad_norm().item() == 0.0

def test_set_step_bias_correction():
    (name, p), = named(("w.weight", (9, 4), torch.float32), seed=6)
    opt = AdamW([(name, p)], lr=1e-1, weight_decay=0.0)
    opt.set_step(99)
    p.grad = torch.randn_like(p)
    before, g = p.detach().clone(), p.grad.clone()
    opt.step()
    assert opt.step_count == 100
    zeros = torch.zeros_like(g)
    delta64 = adamw_float64(before, g, zeros, zeros, False, 1e-1, 0.9, 0.999, 1e-8, 0.0, 100)[0] - before.double()
    delta64_step1 = adamw_float64(before, g, zeros, zeros, False, 1e-1, 0.9, 0.999, 1e-8, 0.0, 1)[0] - before.double()
    delta = p.detach() - before
    print(f"set_step(99): update relative error {rel(delta, delta64):.1e}; differs from a step-1 update by {rel(delta, delta64_step1):.1e}")
    assert rel(delta, delta64) < 1e-5 and rel(delta, delta64_step1) > 1e-2
    with pytest.raises(ValueError): opt.set_step(-1)

def test_main_grad_buffer_is_used():
    (name, p), = named(("w.weight", (6, 5), torch.bfloat16), seed=7)
    opt = AdamW([(name, p)], lr=1e-2)
    opt.zero_grad()
    g1, g2 = torch.randn(6, 5), torch.randn(6, 5)
    accumulate_main_grad(p, g1); accumulate_main_grad(p, g2)          # two micro-batches written by kernels
    norm, _ = clip_grad_norm(opt, 0)
    assert abs(norm - (g1.double() + g2.double()).norm().item()) < 1e-5 * norm
    before = p.detach().clone()
    opt.step(grad_scale=0.5)
    p64, _, _ = adamw_float64(before, g1 + g2, torch.zeros(6, 5), torch.zeros(6, 5), True, 1e-2, 0.9, 0.999, 1e-8, 0.1, 1, 0.5)
    assert (p != p64.to(torch.bfloat16)).sum().item() <= 1

# ---------------------------------------------------------------- clipping
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_clipping_returns_norm_before_clipping(impl):
    params = [(n, torch.nn.Parameter(p.data.to(DEVICE))) for n, p in named(("a.weight", (17, 3), torch.bfloat16),
              ("b_norm.weight", (11,), torch.float32), ("c.weight", (4, 4), torch.float32), seed=8)]
    opt = AdamW(params, impl=impl)
    opt.params[0].grad = (torch.randn(17, 3, device=DEVICE) * 3).to(torch.bfloat16)
    opt.params[1].grad = torch.randn(11, device=DEVICE)
    expected = torch.cat([opt.params[0].grad.double().flatten(), opt.params[1].grad.double()]).norm().item()
    grad_norm = opt.grad_norm()
    assert grad_norm.dtype == torch.float32 and grad_norm.ndim == 0
    norm, coefficient = clip_grad_norm(opt, 1.0)
    print(f"{impl}: norm {norm:.6f} float64 {expected:.6f} coefficient {coefficient:.6f}")
    assert abs(norm / expected - 1) < 1e-6
    assert abs(coefficient - 1.0 / (expected + 1e-6)) < 1e-6
    assert clip_grad_norm(opt, 2 * expected)[1] == 1.0
    assert torch.equal(opt.params[1].grad, params[1][1].grad)     # clipping never rewrites gradients

def test_clip_coefficient():
    assert clip_coefficient(3.0, 1.5) == pytest.approx(1.5 / (3.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(10.0, 0) == 1.0 and clip_coefficient(10.0, None) == 1.0 and clip_coefficient(10.0, -1) == 1.0
    assert clip_coefficient(torch.tensor(4.0), 2.0) == pytest.approx(2.0 / (4.0 + 1e-6))

# ---------------------------------------------------------------- schedules
def test_warmup_cosine_key_steps():
    peak, warmup, total = 6e-4, 8, 108
    assert warmup_cosine(0, peak, warmup, total) == pytest.approx(peak / warmup)
    assert warmup_cosine(warmup - 1, peak, warmup, total) == pytest.approx(peak)
    assert warmup_cosine(warmup, peak, warmup, total) == pytest.approx(peak)
    mid = (warmup + total) // 2
    assert warmup_cosine(mid, peak, warmup, total) == pytest.approx(0.1 * peak + 0.9 * peak * 0.5)
    quarter = warmup + (total - warmup) // 4
    assert warmup_cosine(quarter, peak, warmup, total) == pytest.approx(0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi / 4)))
    assert warmup_cosine(total, peak, warmup, total) == pytest.approx(0.1 * peak)
    assert warmup_cosine(total + 1000, peak, warmup, total) == pytest.approx(0.1 * peak)
    assert warmup_cosine(total, peak, warmup, total, floor=0.0) == 0.0
    assert warmup_cosine(0, peak, 0, total) == pytest.approx(peak)                 # no warmup
    lrs = [warmup_cosine(s, peak, warmup, total) for s in range(total + 5)]
    assert all(a <= b for a, b in zip(lrs[:warmup], lrs[1:warmup])) and all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    assert constant(0, 3e-4) == constant(10 ** 6, 3e-4) == 3e-4
    for bad in (dict(step=-1), dict(total_steps=4), dict(floor=1.5), dict(warmup_steps=-2)):
        kw = dict(step=0, peak_lr=peak, warmup_steps=warmup, total_steps=total); kw.update(bad)
        with pytest.raises(ValueError): warmup_cosine(**kw)

# ---------------------------------------------------------------- state
def test_state_tensors_round_trip():
    specs = (("a.weight", (6, 5), torch.bfloat16), ("a_norm.weight", (5,), torch.float32), ("c.weight", (3, 3), torch.float32))
    first, second = AdamW(named(*specs, seed=9), lr=1e-2), AdamW(named(*specs, seed=9), lr=1e-2)
    for step in range(2):
        first.zero_grad()
        for p in first.params[:2]: p.grad = torch.randn_like(p)
        first.step()
    state = {k: v.clone() for k, v in first.state_tensors().items()}
    assert set(state) == {"exp_avg.a.weight", "exp_avg_sq.a.weight", "exp_avg.a_norm.weight", "exp_avg_sq.a_norm.weight"}
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in state.values())
    for p, q in zip(second.params, first.params): p.data.copy_(q.data)
    second.load_state_tensors(state, first.step_count)
    assert second.step_count == 2
    for opt in (first, second):
        opt.zero_grad()
        torch.manual_seed(10)
        for p in opt.params: p.grad = torch.randn_like(p)
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(first.params, second.params))
    assert all(torch.equal(first.state_tensors()[k], second.state_tensors()[k]) for k in first.state_tensors())
    meta = json.loads(json.dumps(second.hyperparameters()))
    assert meta == dict(lr=1e-2, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.1, step_count=3, impl="torch")

def test_load_state_tensors_errors():
    opt = AdamW(named(("a.weight", (6, 5), torch.float32), seed=11))
    good = {"exp_avg.a.weight": torch.rand(6, 5), "exp_avg_sq.a.weight": torch.rand(6, 5)}
    with pytest.raises(ValueError, match="'a.weight'"): opt.load_state_tensors({**good, "exp_avg.a.weight": torch.rand(5, 6)}, 3)
    with pytest.raises(ValueError, match="'a.weight'"): opt.load_state_tensors({**good, "exp_avg_sq.a.weight": torch.rand(6, 5).double()}, 3)
    with pytest.raises(ValueError, match="'a.weight'"): opt.load_state_tensors({"exp_avg.a.weight": torch.rand(6, 5)}, 3)
    with pytest.raises(ValueError, match="b.weight"): opt.load_state_tensors({**good, "exp_avg.b.weight": torch.rand(6, 5)}, 3)
    assert opt.state_tensors() == {} and opt.step_count == 0      # a failed load changes nothing
    opt.load_state_tensors(good, 3)
    assert opt.step_count == 3 and torch.equal(opt.state_tensors()["exp_avg.a.weight"], good["exp_avg.a.weight"])

def test_constructor_errors():
    with pytest.raises(ValueError): AdamW([])
    with pytest.raises(ValueError): AdamW(named(("a", (2, 2), torch.float32)) * 2)
    with pytest.raises(ValueError): AdamW(named(("a", (2, 2), torch.float32)), betas=(1.0, 0.9))
    with pytest.raises(ValueError): AdamW(named(("a", (2, 2), torch.float32)), eps=0)
    with pytest.raises(ValueError): AdamW(named(("a", (2, 2), torch.float32)), impl="cuda")
    assert AdamW(named(("a", (2, 2), torch.float32)), impl="auto").impl == ("triton" if DEVICE == "cuda" else "torch")

# ---------------------------------------------------------------- fused kernel (interpreter on CPU)
@needs_triton
@pytest.mark.parametrize("offset", [0, 1])
def test_fused_update_bit_identical(monkeypatch, offset):
    monkeypatch.setattr(optimizer_module, "ADAMW_CHUNK_SIZE", 2048)     # small chunks: tensors span several programs
    monkeypatch.setattr(optimizer_module, "ADAMW_BLOCK_SIZE", 256)
    specs = [((53, 97), torch.bfloat16, True), ((4099,), torch.bfloat16, False), ((7, 3, 5), torch.float32, True),
             ((2049,), torch.float32, False), ((1,), torch.float32, False)]
    work = random_adamw_work(specs, DEVICE, seed=12)
    if offset:   # an unaligned view of a larger buffer: the kernel variant without the alignment promise
        base = torch.randn(1 + 3 * 11, device=DEVICE)
        work.append((base[1:].view(3, 11), torch.randn(3, 11, device=DEVICE), torch.randn(3, 11, device=DEVICE) * 0.1,
                     torch.rand(3, 11, device=DEVICE) * 0.01 + 1e-6, True))
    expected = [tuple(t.clone() for t in w[:4]) + (w[4],) for w in work]
    for step in (1, 2):
        s = adamw_scalars(3e-3, 0.9, 0.95, 1e-8, 0.1, step, grad_scale=0.25)
        adamw_update_all_reference(expected, s)
        fused_adamw_update(work, s)
    differ = sum((x != y).sum().item() for a, b in zip(work, expected) for x, y in zip(a[:4], b[:4]))
    print(f"fused vs reference after 2 steps: {differ} differing elements")
    assert differ == 0

@needs_triton
def test_fused_grad_norm(monkeypatch):
    monkeypatch.setattr(optimizer_module, "ADAMW_CHUNK_SIZE", 1024)
    monkeypatch.setattr(optimizer_module, "ADAMW_BLOCK_SIZE", 128)
    g = torch.Generator().manual_seed(13)
    grads = [(torch.randn(n, generator=g) * scale).to(DEVICE) for n, scale in ((3001, 1.0), (1, 50.0), (777, 0.01))]
    norm = fused_grad_norm(grads)
    expected = torch.cat([x.double().flatten() for x in grads]).norm().item()
    print(f"fused grad norm relative error {abs(norm.item() / expected - 1):.1e}")
    assert norm.dtype == torch.float32 and norm.ndim == 0 and abs(norm.item() / expected - 1) < 1e-6

@needs_triton
def test_fused_errors():
    p = torch.randn(4, 6, device=DEVICE).t()                                            # not contiguous
    work = [(p, torch.randn(6, 4, device=DEVICE), torch.zeros(6, 4, device=DEVICE), torch.zeros(6, 4, device=DEVICE), True)]
    with pytest.raises(ValueError, match="not contiguous"): fused_adamw_update(work, adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 1))
    work = [(torch.randn(6, 4, device=DEVICE), torch.randn(6, 4, device=DEVICE).double(), torch.zeros(6, 4, device=DEVICE),
             torch.zeros(6, 4, device=DEVICE), True)]
    with pytest.raises(ValueError, match="float64"): fused_adamw_update(work, adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 1))
    with pytest.raises(ValueError, match="step counts from 1"): adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 0)

def test_device_tables_cache_validates_only_new_entries():
    "The fused optimizer's address tables: one validation per distinct content (addresses, sizes and dtypes), reused after."
    from rtrainer.optimizer import _tables
    calls = []
    validate = lambda: calls.append(1)
    columns = [[101, 202], [7]]
    first = _tables(columns, "cpu", validate, signature=[torch.float32])
    assert _tables(columns, "cpu", validate, signature=[torch.float32]) is first and len(calls) == 1
    assert [t.tolist() for t in first] == columns
    _tables(columns, "cpu", validate, signature=[torch.bfloat16])       # same addresses, another dtype: checked again
    _tables([[101, 203], [7]], "cpu", validate, signature=[torch.float32])  # a moved tensor: checked again
    assert len(calls) == 3
    def bad(): raise ValueError("bad tensor")
    with pytest.raises(ValueError, match="bad tensor"): _tables([[1], [2]], "cpu", bad)
    with pytest.raises(ValueError, match="bad tensor"): _tables([[1], [2]], "cpu", bad)   # a failed check caches nothing

@needs_triton
def test_a_moved_gradient_resends_its_columns_but_not_the_chunk_plan():
    "A gradient at a new address rebuilds the small per-tensor table; the chunk plan of the same sizes is built once."
    from rtrainer.optimizer import TABLE_BUILDS, fused_grad_norm
    torch.manual_seed(3)
    sizes = [(7, 5), (3000,), (1, 1)]                      # odd sizes: several chunks and a one-element tensor
    before, alive = dict(TABLE_BUILDS), []
    for _ in range(3):                                      # fresh tensors every time, like autograd's .grad each step
        grads = [torch.randn(s, device=DEVICE) for s in sizes]
        alive.append(grads)                                 # kept alive, so the next ones land at new addresses
        want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        got = fused_grad_norm(grads)
        assert abs(got.item() - want.item()) <= 1e-5 * want.item(), (got.item(), want.item())
    assert TABLE_BUILDS["plans"] - before["plans"] == 1, TABLE_BUILDS
    assert TABLE_BUILDS["columns"] - before["columns"] == 3, TABLE_BUILDS

def test_zero_grad_frees_the_fp32_gradient_buffers_and_the_next_step_starts_clean():
    (name, p), = named(("w.weight", (6, 5), torch.bfloat16), seed=11)
    opt = AdamW([(name, p)], lr=1e-2, weight_decay=0.0, impl="torch")
    g = [torch.randn(6, 5, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    opt.zero_grad()
    accumulate_main_grad(p, g[0]); accumulate_main_grad(p, g[1])      # two micro-batches: one buffer, summed
    assert torch.allclose(opt.gradients()[0][1], g[0] + g[1], atol=1e-6)
    opt.step()
    buffer = p.main_grad
    opt.zero_grad()                                                     # between steps: no gradient memory held
    assert p.main_grad is None and opt.gradients() == [] and opt.grad_norm().item() == 0.0
    del buffer
    accumulate_main_grad(p, g[2])                                       # next step: a fresh buffer, last step's sum gone
    assert p.main_grad.dtype == torch.float32 and torch.equal(opt.gradients()[0][1], g[2])

def test_capture_staging_hands_out_disjoint_slices_and_refuses_overflow():
    "CaptureStaging's bookkeeping (on the CPU the pinned buffer is replaced by a plain one): each table gets its own slice."
    from rtrainer.optimizer import CaptureStaging
    staging = CaptureStaging.__new__(CaptureStaging)
    staging.host, staging.used = torch.full((7,), -1, dtype=torch.int64), 0
    a = staging.take([3, 1, 4]); b = staging.take([1, 5])
    assert a.tolist() == [3, 1, 4] and b.tolist() == [1, 5] and staging.host[:5].tolist() == [3, 1, 4, 1, 5]
    assert a.data_ptr() != b.data_ptr()
    with pytest.raises(RuntimeError, match="holds 7 entries, 8 are needed"): staging.take([9, 2, 6])
    assert staging.used == 5 and staging.host[5:].tolist() == [-1, -1]
