"GPU checks of the Hopper GEMM (03a): the Gluon grouped GEMM against float64 (uniform and aligned dropless groups), its SwiGLU epilogue, the bf16 layers that take it, and the classifier's logits with their partials."
import pytest, torch
if not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] != 9: pytest.skip("the Gluon kernel is for Hopper (sm_90)", allow_module_level=True)
import rtrainer.moe as moe
import rtrainer.matmul as mm
from rtrainer import moe_hopper
from rtrainer.moe import MoeFeedForward
from rtrainer.kernels import start_gradient_step, gradient_fp32, knob_values, swiglu_forward

pytestmark = pytest.mark.cuda

def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()

@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("E,C,K,N", [(3, 256, 192, 512), (1, 128, 64, 256), (8, 384, 320, 768), (8, 512, 128, 1280)])
def test_hopper_grouped_gemm_matches_float64(E, C, K, N, transposed):
    "(8, 512, 128, 1280): 160 tiles, so some programs take two."
    torch.manual_seed(E + K)
    rows = torch.randn(E * C, K, device="cuda").bfloat16()
    weight = (torch.randn(E, N, K, device="cuda").transpose(1, 2) if transposed else torch.randn(E, K, N, device="cuda")).bfloat16() / K ** 0.5
    assert moe_hopper.hopper_gemm_refusal(rows, weight, C) is None
    out = torch.full((E * C, N), float("nan"), device="cuda", dtype=torch.bfloat16)    # every element must be written
    moe_hopper.hopper_grouped_gemm(rows, weight, out=out)
    want = torch.cat([rows[e * C:(e + 1) * C].double() @ weight[e].double() for e in range(E)])
    print(E, C, K, N, transposed, rel(out, want))
    assert not out.isnan().any() and rel(out, want) < 5e-3

@pytest.mark.parametrize("E,C,K,FF", [(2, 256, 128, 256), (3, 128, 192, 384), (1, 384, 320, 128), (8, 512, 64, 640)])
def test_hopper_swiglu_epilogue(E, C, K, FF):
    "hidden in the layer's [gate | up] layout and act = silu(gate) * up of its bf16 values, as swiglu_forward computes it."
    torch.manual_seed(E * FF)
    rows = torch.randn(E * C, K, device="cuda").bfloat16()
    gate_up = (torch.randn(E, K, 2 * FF, device="cuda") / K ** 0.5).bfloat16()
    hidden = torch.full((E * C, 2 * FF), float("nan"), device="cuda", dtype=torch.bfloat16)
    hidden, act = moe_hopper.hopper_grouped_gemm(rows, gate_up, swiglu=True, out=hidden)
    want = torch.cat([rows[e * C:(e + 1) * C].double() @ gate_up[e].double() for e in range(E)])
    assert not hidden.isnan().any() and rel(hidden, want) < 5e-3
    gate, up = hidden.double().chunk(2, dim=1)
    assert rel(act, torch.nn.functional.silu(gate) * up) < 5e-3
    assert torch.equal(act, swiglu_forward(hidden))                          # the bits the separate pass writes

def _aligned_groups(sizes, align=128, tail=100):
    "(starts, ends) int32 on the GPU for groups of `sizes` rows starting on multiples of align, and the rows they span."
    padded = [(n + align - 1) // align * align for n in sizes]
    starts = [sum(padded[:e]) for e in range(len(sizes))]
    ends = [s + n for s, n in zip(starts, sizes)]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")
    return as_tensor(starts), as_tensor(ends), sum(padded) + tail

@pytest.mark.parametrize("swiglu,transposed", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("sizes,K,N", [([300, 0, 128, 1], 192, 512), ([5000], 64, 256), ([77, 129, 0, 256, 640, 3, 1000, 12], 320, 768),
                                       ([300, 0, 128, 1], 256, 256)])
def test_hopper_grouped_gemm_aligned_groups(sizes, K, N, swiglu, transposed):
    """Dropless groups of any size (empty ones too) starting on multiples of BLOCK_M: every group row against float64.
    N 256 with four groups: one column tile (tiles_n 1, which Triton must not specialize: see the kernel)."""
    torch.manual_seed(len(sizes) + K)
    E = len(sizes)
    starts, ends, R = _aligned_groups(sizes)
    rows = torch.randn(R, K, device="cuda").bfloat16()
    weight = (torch.randn(E, N, K, device="cuda").transpose(1, 2) if transposed else torch.randn(E, K, N, device="cuda")).bfloat16() / K ** 0.5
    assert moe_hopper.hopper_gemm_refusal(rows, weight, 0, swiglu=swiglu, row_align=128) is None
    out = torch.full((R, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    out, act = moe_hopper.hopper_grouped_gemm(rows, weight, swiglu=swiglu, out=out, groups=(starts, ends))
    for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
        if s == t: continue
        want = rows[s:t].double() @ weight[e].double()
        assert not out[s:t].isnan().any() and rel(out[s:t], want) < 5e-3, (e, rel(out[s:t], want))
        if swiglu: assert torch.equal(act[s:t], swiglu_forward(out[s:t]))
    assert out[R - 100:].isnan().all()                                         # past the last group's tiles: not written

def test_hopper_refusals():
    rows, weight = torch.zeros(2 * 128, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    assert moe_hopper.hopper_gemm_refusal(rows, weight, 128) is None
    assert "bf16" in moe_hopper.hopper_gemm_refusal(rows.float(), weight, 128)
    assert "off the" in moe_hopper.hopper_gemm_refusal(rows[:200], weight, 100)
    assert "off the" in moe_hopper.hopper_gemm_refusal(rows, weight[:, :, :200], 128)
    assert "neither" in moe_hopper.hopper_gemm_refusal(rows, torch.zeros(2, 128, 512, device="cuda", dtype=torch.bfloat16)[:, :, ::2], 128)
    transposed = torch.zeros(2, 256, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert moe_hopper.hopper_gemm_refusal(rows, transposed, 128) is None
    assert "contiguous" in moe_hopper.hopper_gemm_refusal(rows, transposed, 128, swiglu=True)
    assert "multiple of 128" in moe_hopper.hopper_gemm_refusal(rows, weight, 128, config=(128, 64, 64, 3, 8), swiglu=True)
    assert "not of 128" in moe_hopper.hopper_gemm_refusal(rows, weight, 0, row_align=64)
    assert moe_hopper.hopper_gemm_refusal(rows, weight, 0, row_align=256) is None
    assert moe_hopper._dropless_row_align(rows) == 128 and moe_hopper._dropless_row_align(rows.float()) == 1
    with pytest.raises(ValueError, match="groups must be two"):
        moe_hopper.hopper_grouped_gemm(rows, weight, groups=(torch.zeros(2, device="cuda", dtype=torch.int64),) * 2)

@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
@pytest.mark.parametrize("knobs,calls,swiglu_calls", [({}, 4, 1), ({"FAST_SWIGLU": False}, 4, 0), ({"FAST_GEMM": False}, 0, 0)])
def test_bf16_layer_takes_the_hopper_gemm(knobs, calls, swiglu_calls, dispatch):
    """4,096 tokens, top-2 of 8 experts (capacity 1,024; dropless: groups aligned to 128 rows): the two forward and two
    input-gradient products take the kernel."""
    torch.manual_seed(1)
    N, D, FF, E, k = 4096, 512, 512, 8, 2
    layer = MoeFeedForward(D, FF, E, k, dispatch=dispatch, impl="triton", dtype=torch.bfloat16, device="cuda")
    oracle = MoeFeedForward(D, FF, E, k, dispatch=dispatch, impl="torch", dtype=torch.float64, device="cuda")
    with torch.no_grad():
        layer.router.normal_(std=0.5)                                         # no near-ties (see test_moe_gpu.check_bf16_layer)
        for p64, p in zip(oracle.parameters(), layer.parameters()): p64.copy_(p.double())
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    probe = torch.randn(N, D, device="cuda", dtype=torch.float64)
    for p in layer.parameters(): p.main_grad = torch.full(p.shape, float("nan"), device="cuda")
    start_gradient_step(layer.parameters())
    swiglu_key = "swiglu" if dispatch == "capacity" else "swiglu dropless"
    before, swiglu_before = sum(moe_hopper.CALLS.values()), moe_hopper.CALLS[swiglu_key]
    with knob_values(moe, {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "library", **knobs}):
        y = layer(x); ((y.double() * probe).sum() + 0.37 * layer.last_stats["load_balance_loss"].double()).backward()
    assert sum(moe_hopper.CALLS.values()) - before == calls and moe_hopper.CALLS[swiglu_key] - swiglu_before == swiglu_calls
    y64 = oracle(x64); ((y64 * probe).sum() + 0.37 * oracle.last_stats["load_balance_loss"]).backward()
    assert torch.equal(layer.last_stats["expert_load"], oracle.last_stats["expert_load"].float())
    errors = dict(y=rel(y, y64), x=rel(x.grad, x64.grad),
                  **{n: rel(gradient_fp32(p), p64.grad) for (n, p), p64 in zip(layer.named_parameters(), oracle.parameters())})
    print(knobs, errors)
    assert errors["y"] < 1e-2 and max(errors.values()) < 3e-2, errors

@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("R,D,V,VP", [(1000, 192, 1003, 1024), (77, 64, 300, 320), (4096, 768, 32004, 32064), (300, 1536, 50257, 50432)])
def test_hopper_logits_and_partials(R, D, V, VP, transposed):
    """The classifier's logits against float64, and their partials against matmul.logit_partials_reference of the same
    bf16 logits: rows off the 128-row tile, columns off the 256-column tile, a tied (VP, D) table or a (D, VP) head."""
    torch.manual_seed(R + D)
    h = torch.randn(R, D, device="cuda").bfloat16()
    weight = (torch.randn(VP, D, device="cuda") * 3 / D ** 0.5).bfloat16()
    if not transposed: weight = weight.t().contiguous()
    assert moe_hopper.hopper_logits_refusal(h, weight, transposed) is None
    logits, (part_max, part_sum) = moe_hopper.hopper_logits(h, weight, transposed, V)
    assert rel(logits, h.double() @ (weight.double().t() if transposed else weight.double())) < 5e-3
    want_max, want_sum = mm.logit_partials_reference(logits, V, moe_hopper.GEMM_CONFIG[1])
    assert part_max.shape == (R, -(-VP // 256)) and torch.equal(part_max, want_max) and rel(part_sum, want_sum) < 1e-5

def test_hopper_logits_refusals():
    h, w = torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16), torch.zeros(64, 320, device="cuda", dtype=torch.bfloat16)
    assert moe_hopper.hopper_logits_refusal(h, w, False) is None
    assert "do not make a product" in moe_hopper.hopper_logits_refusal(h, w, True)
    assert "not contiguous" in moe_hopper.hopper_logits_refusal(h[:, :32], w[:32], False)
    assert "16 bytes" in moe_hopper.hopper_logits_refusal(h[:, :60].contiguous(), w[:60].contiguous(), False)
    assert "float32" in moe_hopper.hopper_logits_refusal(h, w.float(), False)
    with pytest.raises(ValueError, match="hopper_logits: "): moe_hopper.hopper_logits(h, w, True, 300)

@pytest.mark.parametrize("transposed", [False, True])
def test_linear_cross_entropy_takes_the_hopper_logits(transposed, monkeypatch):
    """The fused classifier (01a) in chunks of 384 rows (the last short) with the Hopper logits and their partials,
    so the row kernel reads each row once: loss and both gradients against float64."""
    monkeypatch.setattr(mm, "CE_CHUNK_ROWS", 384)
    torch.manual_seed(7 + transposed)
    N, D, V, VP = 1000, 264, 1003, 1024
    head = torch.nn.Parameter((torch.randn(*((VP, D) if transposed else (D, VP)), device="cuda") * 3 / D ** 0.5).bfloat16())
    head64 = head.detach().double().requires_grad_()
    start_gradient_step([head])
    hidden = torch.randn(N, D, device="cuda").bfloat16().requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda"); targets[::7] = mm.IGNORE_INDEX; targets[0] = V - 1
    before = moe_hopper.CALLS["logits"]
    loss = mm.linear_cross_entropy(hidden, head, targets, V, weight_transposed=transposed)
    assert moe_hopper.CALLS["logits"] - before == 3
    hidden64 = hidden.detach().double().requires_grad_()
    ref = mm.linear_cross_entropy_reference(hidden64, head64, targets, V, weight_transposed=transposed)
    (2 * loss).backward(); (2 * ref).backward()
    assert torch.isfinite(loss) and rel(loss, ref.detach()) < 2e-3
    assert rel(hidden.grad, hidden64.grad) < 1e-2 and rel(gradient_fp32(head), head64.grad) < 1e-2
