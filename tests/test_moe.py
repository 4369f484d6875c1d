"CPU tests of the MoE chapter: float64 references against a per-token loop, capacity math, Triton in the interpreter."
import math
import torch
import pytest
from rtrainer.moe import (MoeFeedForward, route_tokens, load_balance_loss, load_balance_weight, expert_capacity,
                          capacity_slots, capacity_moe_reference, dropless_moe_reference, capacity_plan, dropless_plan,
                          grouped_gemm_triton, grouped_gemm_reference,
                          gather_rows_triton, combine_rows_triton, naive_moe_loop, check_moe_against_loop,
                          compare_triton_to_torch, moe_parameter_count, accumulation_gradients, grouped_gemm_library,
                          grouped_gemm_weight_grad_library, library_support, expert_backends, check_empty_expert,
                          saved_tensor_bytes, expert_saved_bytes, moe_experts_triton, grouped_gemm_per_expert,
                          grouped_gemm_weight_grad_per_expert, host_group_bounds)
import rtrainer.moe as moe
from rtrainer.kernels import KERNELS_CAN_RUN, knob_values, start_gradient_step, gradient_fp32

needs_kernels = pytest.mark.skipif(not KERNELS_CAN_RUN, reason="needs a CUDA GPU or TRITON_INTERPRET=1 before import")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()

@pytest.mark.parametrize("dispatch,capacity_factor,shared", [("capacity", 1.0, 0), ("capacity", 0.5, 7), ("capacity", 1.7, 0),
                                                              ("dropless", 1.0, 7)])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_reference_layer_matches_per_token_loop(dispatch, capacity_factor, shared, top_k):
    torch.manual_seed(top_k)
    layer = MoeFeedForward(11, 9, 5, top_k, capacity_factor=capacity_factor, dispatch=dispatch,
                           shared_expert_d_ff=shared, dtype=torch.float64)
    for p in layer.parameters(): torch.nn.init.normal_(p, std=0.5)
    errors = check_moe_against_loop(layer, N=29, seed=top_k)
    print(dispatch, capacity_factor, top_k, errors)
    assert max(errors.values()) < 1e-10, errors
    assert set(errors) >= {"y", "x", "router", "experts_gate_up", "experts_down"}

def test_router_gradient_is_nonzero_and_checked():
    torch.manual_seed(3)
    layer = MoeFeedForward(8, 6, 4, 2, dtype=torch.float64)
    for p in layer.parameters(): torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(17, 8, dtype=torch.float64)
    y = layer(x)
    (y.sum() + layer.last_stats["load_balance_loss"]).backward()
    assert layer.router.grad.abs().max() > 1e-6
    # the same loss through the loop gives the same router gradient
    router_grad = layer.router.grad.clone(); layer.router.grad = None
    y2, lb2 = naive_moe_loop(x, layer, expert_capacity(17, 2, 4, 1.0))
    (y2.sum() + lb2).backward()
    assert rel(router_grad, layer.router.grad) < 1e-10

def test_routing_weights_and_dtypes():
    x = torch.randn(9, 6, dtype=torch.bfloat16)
    layer = MoeFeedForward(6, 4, 4, 2, dtype=torch.bfloat16)
    assert layer.router.dtype == torch.float32 and layer.experts_gate_up.dtype == torch.bfloat16
    probs, experts, weights = route_tokens(x, layer.router, 2)
    assert probs.dtype == torch.float32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    stats = layer.last_stats
    assert stats["load_balance_loss"].dtype == torch.float32 and stats["load_balance_loss"].requires_grad
    assert not stats["expert_load"].requires_grad and abs(stats["expert_load"].sum().item() - 1) < 1e-6
    assert 0 <= stats["dropped_fraction"].item() <= 1

def test_capacity_math_and_drop_order():
    assert expert_capacity(4, 2, 3, 0.75) == 2 and expert_capacity(10, 2, 8, 1.0) == 3 and expert_capacity(16384, 2, 8, 1.0) == 4096
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 1]])
    slot, kept = capacity_slots(experts, 3, 2)
    assert kept.tolist() == [True, True, True, True, False, True, False, False]
    assert slot.tolist() == [0, 2, 1, 4, 6, 3, 6, 6]
    # second choices of an early token win over first choices of a later one: (token, rank) order
    experts = torch.tensor([[1, 0], [0, 1], [0, 2]])
    slot, kept = capacity_slots(experts, 3, 1)
    assert kept.tolist() == [True, True, False, False, False, True]

def test_dropped_assignments_contribute_nothing_and_get_no_gradient():
    torch.manual_seed(0)
    N, D, FF, E = 6, 5, 4, 3
    x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    gu, dn = torch.randn(E, D, 2 * FF, dtype=torch.float64), torch.randn(E, FF, D, dtype=torch.float64)
    experts = torch.zeros(N, 1, dtype=torch.long)            # everyone wants expert 0
    weights = torch.ones(N, 1, dtype=torch.float64, requires_grad=True)
    y, dropped = capacity_moe_reference(x, experts, weights, gu, dn, capacity_factor=1.0)   # C = 2
    assert abs(dropped.item() - 4 / 6) < 1e-6
    assert y[2:].abs().max() == 0 and y[:2].abs().min() > 0
    y.sum().backward()
    assert x.grad[2:].abs().max() == 0 and weights.grad[2:].abs().max() == 0 and x.grad[:2].abs().min() > 0

def test_dropless_equals_capacity_when_nothing_dropped():
    torch.manual_seed(1)
    N, D, FF, E, k = 31, 7, 5, 6, 2
    x = torch.randn(N, D, dtype=torch.float64)
    gu, dn = torch.randn(E, D, 2 * FF, dtype=torch.float64), torch.randn(E, FF, D, dtype=torch.float64)
    _, experts, weights = route_tokens(x, torch.randn(D, E, dtype=torch.float64), k)
    y_cap, dropped = capacity_moe_reference(x, experts, weights, gu, dn, capacity_factor=E / k)
    y_free, _ = dropless_moe_reference(x, experts, weights, gu, dn)
    assert dropped.item() == 0
    assert rel(y_cap, y_free) < 1e-12

def test_load_balance_loss_values():
    E = 5
    probs = torch.full((10, E), 1 / E, dtype=torch.float64)
    experts = torch.arange(20).remainder(E).view(10, 2)
    assert abs(load_balance_loss(probs, experts).item() - 1.0) < 1e-12
    # hand computed: f = (3/4, 1/4), P = mean probs
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.7, 0.3]], dtype=torch.float64)
    experts = probs.argmax(-1, keepdim=True)
    want = 2 * (0.75 * 0.6 + 0.25 * 0.4)
    assert abs(load_balance_loss(probs, experts).item() - want) < 1e-12

def test_load_balance_weight_schedule():
    assert load_balance_weight(0) == 1e-2
    assert abs(load_balance_weight(2500) - 7.5e-3) < 1e-15
    assert load_balance_weight(10_000) == 0.0 and load_balance_weight(12_345) == 0.0
    assert abs(load_balance_weight(50, initial=0.1, decay_steps=100) - 0.05) < 1e-15
    with pytest.raises(ValueError): load_balance_weight(0, decay_steps=0)

def test_parameter_count():
    assert moe_parameter_count(3072, 4096, 8) == 302_014_464
    layer = MoeFeedForward(10, 6, 3, 2, shared_expert_d_ff=4)
    assert sum(p.numel() for p in layer.parameters()) == moe_parameter_count(10, 6, 3, 4)
    names = dict(layer.named_parameters())
    assert names["router"].shape == (10, 3) and names["experts_gate_up"].shape == (3, 10, 12)
    assert names["experts_down"].shape == (3, 6, 10) and names["shared_gate_up"].shape == (10, 8) and names["shared_down"].shape == (4, 10)

def test_bad_arguments_raise():
    with pytest.raises(ValueError): MoeFeedForward(8, 4, 4, 2, dispatch="sorted")
    with pytest.raises(ValueError): MoeFeedForward(8, 4, 4, 5)
    with pytest.raises(ValueError): expert_capacity(10, 2, 4, 0.0)

def test_plans_are_consistent():
    torch.manual_seed(2)
    experts = torch.randint(0, 5, (23, 2))
    experts[:, 1] = (experts[:, 0] + 1 + torch.randint(0, 4, (23,))) % 5
    for plan in (capacity_plan(experts, 5, 0.8), dropless_plan(experts, 5)):
        valid = plan.row_assignment >= 0
        assert (plan.row_token[valid].long() == plan.row_assignment[valid] // 2).all()
        rows = plan.assignment_rows.flatten().long()
        kept = rows >= 0
        assert (plan.row_assignment[rows[kept]] == torch.arange(46)[kept]).all()
        for e in range(5):   # every row of group e holds an assignment to expert e
            r = torch.arange(plan.group_starts[e], plan.group_ends[e])
            r = r[plan.row_assignment[r] >= 0]
            assert (experts.flatten()[plan.row_assignment[r]] == e).all()
        assert abs(plan.dropped_fraction.item() - (1 - kept.float().mean().item())) < 1e-6

def test_accumulation_lm_term_matches_load_balance_does_not():
    torch.manual_seed(1)
    layer = MoeFeedForward(8, 6, 4, 2, dispatch="dropless", dtype=torch.float64)
    for p in layer.parameters(): torch.nn.init.normal_(p, std=0.3)
    seqs, probe = torch.randn(4, 16, 8, dtype=torch.float64), torch.randn(4, 16, 8, dtype=torch.float64)
    (lm1, lb1), (lm2, lb2), (lm4, lb4) = (accumulation_gradients(layer, seqs, probe, mb) for mb in (1, 2, 4))
    assert rel(lm1, lm4) < 1e-12 and rel(lm2, lm4) < 1e-12
    assert rel(lb1, lb4) > 1e-3 and rel(lb2, lb4) > 1e-3 and rel(lb1, lb2) > 1e-3

# ---- Triton kernels in the interpreter (fp32 operands) ----

@needs_kernels
@pytest.mark.parametrize("sizes", [[5, 0, 37, 16, 0, 1, 20], [0, 0, 3], [33], [17, 17, 0]])
def test_grouped_gemm_forward_and_backward(sizes):
    torch.manual_seed(len(sizes))
    sizes_t = torch.tensor(sizes)
    ends = sizes_t.cumsum(0); starts = ends - sizes_t
    R, K, N = int(sizes_t.sum()), 24, 40
    a = torch.randn(R + 3, K, device=DEVICE)            # 3 trailing rows outside every group
    w = torch.randn(len(sizes), K, N, device=DEVICE)
    out = torch.full((R + 3, N), float("nan"), device=DEVICE)
    grouped_gemm_triton(a, w, starts.to(DEVICE), ends.to(DEVICE), block_m=16, out=out)
    want = grouped_gemm_reference(a.double().cpu(), w.double().cpu(), starts, ends)
    assert not out[:R].isnan().any() and out[R:].isnan().all()       # group rows all written, others untouched
    if R: assert rel(out[:R].cpu(), want[:R]) < 1e-5
    # input gradient: the same kernel on the transposed weight
    dc = torch.randn(R + 3, N, device=DEVICE)
    da = grouped_gemm_triton(dc, w.transpose(1, 2), starts.to(DEVICE), ends.to(DEVICE), block_m=16)
    da_want = grouped_gemm_reference(dc.double().cpu(), w.double().cpu().transpose(1, 2), starts, ends)
    if R: assert rel(da[:R].cpu(), da_want[:R]) < 1e-5
    # weight gradient, each kernel (the TMA one reads on past a group's end, into the next group or the trailing rows):
    # written, then accumulated
    dw_want = torch.stack([a[s:e].double().cpu().T @ dc[s:e].double().cpu() for s, e in zip(starts.tolist(), ends.tolist())])
    for weight_grad in (moe.pointer_weight_grad_triton, moe.tma_weight_grad_triton):
        dw = torch.full(w.shape, float("nan"), device=DEVICE)
        weight_grad(a, dc, starts.to(DEVICE, torch.int32), ends.to(DEVICE, torch.int32), out=dw)
        assert not dw.isnan().any()
        assert rel(dw.cpu(), dw_want) < 1e-5 if dw_want.norm() > 0 else dw.abs().max() == 0
        for g, n in enumerate(sizes):
            if n == 0: assert dw[g].abs().max() == 0
        weight_grad(a, dc, starts.to(DEVICE, torch.int32), ends.to(DEVICE, torch.int32), out=dw, accumulate=True)
        if dw_want.norm() > 0: assert rel(dw.cpu(), 2 * dw_want) < 1e-5

@needs_kernels
def test_gather_and_combine_kernels():
    torch.manual_seed(5)
    src = torch.randn(9, 13, device=DEVICE)
    index = torch.tensor([3, -1, 0, 8, 8, -1, 2], dtype=torch.int32, device=DEVICE)
    out = gather_rows_triton(src, index)
    safe = index.clamp(min=0).long()
    assert torch.equal(out.cpu(), torch.where((index >= 0)[:, None], src[safe], 0.0).cpu())
    rows = torch.tensor([[0, 4], [-1, 2], [-1, -1]], dtype=torch.int32, device=DEVICE)
    weights = torch.randn(3, 2, device=DEVICE)
    y = combine_rows_triton(src, rows, weights)
    y_want = torch.stack([sum((weights[t, j] * src[rows[t, j]] for j in range(2) if rows[t, j] >= 0), torch.zeros(13, device=DEVICE))
                          for t in range(3)])
    assert rel(y.cpu(), y_want.cpu()) < 1e-6 and y[2].abs().max() == 0

@needs_kernels
@pytest.mark.parametrize("dispatch,capacity_factor,shared,top_k", [("capacity", 0.8, 8, 2), ("capacity", 2.0, 0, 1),
                                                                     ("dropless", 1.0, 8, 2), ("dropless", 1.0, 0, 3)])
def test_triton_layer_matches_float64_reference(dispatch, capacity_factor, shared, top_k):
    errors = compare_triton_to_torch(20, 24, 5, top_k, 37, dispatch, capacity_factor, shared_expert_d_ff=shared,
                                     device=DEVICE, block_m=16)
    print(dispatch, errors)
    # with top_k = 1 the renormalized weight is p/p = 1: the router gets gradient only from the load-balance
    # term, and the output path adds fp32 cancellation noise of relative size ~1e-4 to it
    router_tolerance = 1e-3 if top_k == 1 else 1e-4
    assert errors.pop("router") < router_tolerance, errors
    assert max(errors.values()) < 1e-4, errors

@needs_kernels
@pytest.mark.parametrize("sizes,K,N", [([16, 16, 16], 24, 40), ([8], 8, 136), ([11, 0, 7, 16, 5], 264, 72), ([3, 1, 0], 16, 24)])
def test_tma_weight_grad_matches_float64(sizes, K, N):
    "The TMA weight gradient: groups on and off the row step (8 in the interpreter), written over NaN, then accumulated; K and N off the tile."
    torch.manual_seed(K + N)
    dt = torch.float32 if moe.INTERPRETING else torch.bfloat16
    s = torch.tensor(sizes); ends = s.cumsum(0); starts = ends - s
    R = int(s.sum())
    a, dc = torch.randn(R, K, device=DEVICE).to(dt), torch.randn(R, N, device=DEVICE).to(dt)
    groups = starts.to(DEVICE, torch.int32), ends.to(DEVICE, torch.int32)
    assert moe.tma_weight_grad_applies(a, dc)
    dw = moe.tma_weight_grad_triton(a, dc, *groups, out=torch.full((len(sizes), K, N), float("nan"), device=DEVICE))
    want = torch.stack([a[x:y].double().cpu().T @ dc[x:y].double().cpu() for x, y in zip(starts.tolist(), ends.tolist())])
    assert not dw.isnan().any() and rel(dw.cpu(), want) < 1e-5
    moe.tma_weight_grad_triton(a, dc, *groups, out=dw, accumulate=True)
    assert rel(dw.cpu(), 2 * want) < 1e-5
    with pytest.raises(ValueError, match="int32"): moe.tma_weight_grad_triton(a, dc, starts.to(DEVICE), ends.to(DEVICE), out=dw)
    with pytest.raises(ValueError, match="16-byte"): moe.tma_weight_grad_triton(a[:, :K - 1].contiguous(), dc, *groups, out=dw)

@needs_kernels
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_layer_runs_the_tma_weight_gradient(monkeypatch, dispatch):
    "40 tokens, top-2 of 5 experts: both expert weight gradients take TMA, capacity groups (C = 16) and dropless ones alike."
    calls, real = [], moe.tma_weight_grad_triton
    monkeypatch.setattr(moe, "tma_weight_grad_triton", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    errors = compare_triton_to_torch(20, 24, 5, 2, 40, dispatch, 1.0, device=DEVICE, block_m=16)
    assert len(calls) == (2 if moe.INTERPRETING else 0), calls        # fp32 on a GPU keeps the pointer kernel
    assert errors.pop("router") < 1e-4 and max(errors.values()) < 1e-4, errors

# ---- the library GEMM backend (bmm / _grouped_mm on the CPU, fp32), memory, the router's low-memory product ----

GROUPED_MM_ON_CPU = library_support("cpu")["grouped_mm"][0]

@pytest.mark.parametrize("sizes,capacity", [([5, 0, 37, 16, 0, 1, 20], 0), ([0, 0, 3], 0), ([33], 0), ([17, 17, 0], 0),
                                            ([9] * 5, 9), ([1] * 3, 1)])
def test_library_grouped_gemm_matches_float64(sizes, capacity):
    if not capacity and not GROUPED_MM_ON_CPU: pytest.skip("torch._grouped_mm does not run on this CPU")
    torch.manual_seed(len(sizes) + capacity)
    s = torch.tensor(sizes); ends = s.cumsum(0).to(torch.int32); starts = ends - s.to(torch.int32)
    R, K, N = int(s.sum()), 24, 40
    a, w, dc = torch.randn(R, K), torch.randn(len(sizes), K, N), torch.randn(R, N)
    y = grouped_gemm_library(a, w, starts, ends, capacity)
    want = grouped_gemm_reference(a.double(), w.double(), starts, ends)
    if R: assert rel(y, want) < 1e-5
    da = grouped_gemm_library(dc, w.transpose(1, 2), starts, ends, capacity)       # a view, as the backward passes it
    if R: assert rel(da, grouped_gemm_reference(dc.double(), w.double().transpose(1, 2), starts, ends)) < 1e-5
    dw = torch.full(w.shape, float("nan"))
    grouped_gemm_weight_grad_library(a, dc, starts, ends, dw, capacity=capacity)
    dw_want = torch.stack([a[x:e].double().T @ dc[x:e].double() for x, e in zip(starts.tolist(), ends.tolist())])
    assert not dw.isnan().any()
    for g, n in enumerate(sizes):
        if n == 0: assert dw[g].abs().max() == 0                                      # empty group: zero, written
    if dw_want.norm() > 0: assert rel(dw, dw_want) < 1e-5
    grouped_gemm_weight_grad_library(a, dc, starts, ends, dw, accumulate=True, capacity=capacity)
    if dw_want.norm() > 0: assert rel(dw, 2 * dw_want) < 1e-5

def test_expert_backends_resolve_and_validate():
    assert expert_backends(torch.float32, "cpu", True).gemm == "triton"                # auto on a CPU: the Triton kernels
    assert expert_backends(torch.bfloat16, "cpu", False) == ("triton", "triton", "Triton kernel, fp32 into main_grad")
    with knob_values(moe, {"EXPERT_GEMM": "library"}):
        assert expert_backends(torch.float32, "cpu", True)[:2] == ("library", "library")     # fp32: bmm writes fp32
        b = expert_backends(torch.bfloat16, "cpu", True)                                 # no bmm(out_dtype=) on a CPU
        assert b.weight_grad == ("library" if library_support("cpu")["bmm_fp32_out"][0] else "triton")
        if GROUPED_MM_ON_CPU:
            assert expert_backends(torch.float32, "cpu", False)[:2] == ("library", "library")
            with pytest.raises(ValueError): expert_backends(torch.float32, "cpu", False, strides_aligned=False)
    with knob_values(moe, {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "library"}):
        note = expert_backends(torch.bfloat16, "cpu", True).weight_grad_note
        assert "added to fp32 main_grad" in note and "refused" in note, note            # the fallback says why
    for knob in ("EXPERT_GEMM", "EXPERT_WEIGHT_GRAD"):
        with knob_values(moe, {knob: "cublas"}), pytest.raises(ValueError): expert_backends(torch.float32, "cpu", True)

def test_per_expert_backend_resolves():
    for dtype in (torch.float32, torch.bfloat16):                                      # on a CPU auto never picks per_expert
        for uniform in (True, False): assert "per_expert" not in expert_backends(dtype, "cpu", uniform)[:2]
    with knob_values(moe, {"EXPERT_GEMM": "per_expert"}):                              # runs anywhere, both dispatches
        for uniform in (True, False):
            b = expert_backends(torch.float32, "cpu", uniform, strides_aligned=False)
            assert b == ("per_expert", "per_expert", "bmm per expert (group sizes read on the host), fp32 into main_grad"), b
        b = expert_backends(torch.bfloat16, "cpu", False)        # no bmm(out_dtype=) on a CPU: auto keeps the Triton kernel
        assert b.weight_grad == ("per_expert" if library_support("cpu")["bmm_fp32_out"][0] else "triton"), b
    with knob_values(moe, {"EXPERT_GEMM": "triton", "EXPERT_WEIGHT_GRAD": "per_expert"}):
        note = expert_backends(torch.bfloat16, "cpu", False).weight_grad_note
        assert note.startswith("bmm per expert") and ("refused" in note) != library_support("cpu")["bmm_fp32_out"][0], note

@pytest.mark.parametrize("sizes", [[5, 0, 37, 16, 0, 1, 20], [0, 0, 3], [33], [17, 17, 0], [0, 61, 1, 0, 0, 2, 0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_expert_gemms_match_float64(sizes, dtype):
    torch.manual_seed(len(sizes))
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    starts, ends = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:])
    R, K, N, G = bounds[-1], 24, 40, len(sizes)
    a, w, dc = torch.randn(R, K, dtype=dtype), torch.randn(G, K, N, dtype=dtype), torch.randn(R, N, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    y = grouped_gemm_per_expert(a, w, bounds)
    if R: assert y.dtype == dtype and rel(y, grouped_gemm_reference(a.double(), w.double(), starts, ends)) < tol
    da = grouped_gemm_per_expert(dc, w.transpose(1, 2), bounds)                      # a view, as the backward passes it
    if R: assert rel(da, grouped_gemm_reference(dc.double(), w.double().transpose(1, 2), starts, ends)) < tol
    dw = torch.full((G, K, N), float("nan"))                                           # fp32, like main_grad
    grouped_gemm_weight_grad_per_expert(a, dc, bounds, dw)
    dw_want = torch.stack([a[s:e].double().T @ dc[s:e].double() for s, e in zip(bounds[:-1], bounds[1:])])
    assert not dw.isnan().any()
    for g, n in enumerate(sizes):
        if n == 0: assert dw[g].abs().max() == 0                                      # empty group: zero, written
    assert rel(dw, dw_want) < 1e-6
    grouped_gemm_weight_grad_per_expert(a, dc, bounds, dw, accumulate=True)
    assert rel(dw, 2 * dw_want) < 1e-6
    for g, n in enumerate(sizes):
        if n == 0: assert dw[g].abs().max() == 0                                      # accumulating leaves it alone
    sevens = torch.full((G, K, N), 7.0)
    grouped_gemm_weight_grad_per_expert(a, dc, bounds, sevens, accumulate=True)        # an empty group: skipped, not zeroed
    assert rel(sevens, 7 + dw_want) < 1e-6
    for g, n in enumerate(sizes):
        if n == 0: assert (sevens[g] == 7).all()

def test_host_group_bounds():
    experts = torch.tensor([[2, 0], [2, 4], [0, 2], [4, 2], [2, 0]])                 # expert 1 and 3: no rows
    assert host_group_bounds(dropless_plan(experts, 5)) == [0, 3, 3, 8, 8, 10]
    assert host_group_bounds(capacity_plan(experts, 5, 1.0)) == [0, 2, 4, 6, 8, 10]   # from C: no copy to the host

@needs_kernels
@pytest.mark.parametrize("dispatch,capacity_factor,weight_grad", [("capacity", 0.8, "library"), ("capacity", 1.3, "triton"),
                                                                  ("dropless", 1.0, "library"), ("dropless", 1.0, "triton")])
def test_library_layer_matches_float64_reference(dispatch, capacity_factor, weight_grad):
    if dispatch == "dropless" and not GROUPED_MM_ON_CPU: pytest.skip("torch._grouped_mm does not run on this CPU")
    with knob_values(moe, {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": weight_grad}):
        errors = compare_triton_to_torch(20, 24, 5, 2, 29, dispatch, capacity_factor, shared_expert_d_ff=8, device=DEVICE, block_m=16)
    print(dispatch, weight_grad, errors)
    assert max(errors.values()) < 1e-4, errors

@needs_kernels
@pytest.mark.parametrize("act_scale", [1.0, 2.0])
def test_capacity_layer_takes_a_registered_swiglu_gemm(monkeypatch, act_scale):
    "The capacity layer hands gate_up and the SwiGLU to FAST_PATHS['grouped_gemm_swiglu'] and runs on what it returns."
    calls = []
    def fused(rows, gate_up, capacity, group_starts, group_ends, row_align):   # an exact stand-in for the Hopper kernel, act scaled
        calls.append(capacity)
        E, K, N = gate_up.shape
        hidden = torch.bmm(rows.view(E, capacity, K), gate_up).view(E * capacity, N)
        gate, up = hidden.chunk(2, dim=1)
        return hidden, torch.nn.functional.silu(gate) * up * act_scale
    monkeypatch.setitem(moe.FAST_PATHS, "grouped_gemm_swiglu", fused)
    with knob_values(moe, {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "library"}):
        errors = compare_triton_to_torch(20, 24, 5, 2, 29, "capacity", 1.0, device=DEVICE, block_m=16)
        assert calls and set(calls) == {math.ceil(29 * 2 / 5)}
        if act_scale == 1.0: assert max(errors.values()) < 1e-4, errors
        else: assert errors["y"] > 0.1, errors                    # the layer ran on the returned act
        calls.clear()
        with knob_values(moe, {"FAST_SWIGLU": False}): compare_triton_to_torch(20, 24, 5, 2, 29, "capacity", 1.0, device=DEVICE, block_m=16)
        assert calls == []

def test_dropless_plan_row_align():
    "Groups of whole row_align blocks: the packed plan's rows in the same order, then empty rows up to the next group."
    top_experts = _uneven_routing(37, 5, 2, seed=3)                             # the last expert takes no rows
    packed, aligned = dropless_plan(top_experts, 5), dropless_plan(top_experts, 5, row_align=8)
    assert aligned.row_align == 8 and aligned.row_assignment.shape == (37 * 2 + 5 * 7,)
    assert torch.equal(aligned.group_starts % 8, torch.zeros(5, dtype=torch.int32))
    assert torch.equal(aligned.group_starts[1:], aligned.group_ends[:-1])         # contiguous groups
    sizes = packed.group_ends - packed.group_starts
    assert torch.equal(aligned.group_ends - aligned.group_starts, (sizes + 7) // 8 * 8)
    for e in range(5):
        a0, a1, p0, p1 = aligned.group_starts[e], aligned.group_ends[e], packed.group_starts[e], packed.group_ends[e]
        n = p1 - p0
        assert torch.equal(aligned.row_assignment[a0:a0 + n], packed.row_assignment[p0:p1])
        assert torch.equal(aligned.row_token[a0:a0 + n], packed.row_token[p0:p1])
        assert (aligned.row_token[a0 + n:a1] == -1).all()                        # the group's empty rows
    used = aligned.row_assignment >= 0
    assert used.sum() == 37 * 2 and torch.equal(aligned.row_token[~used], torch.full_like(aligned.row_token[~used], -1))
    rows = aligned.assignment_rows.flatten().long()
    assert torch.equal(aligned.row_assignment[rows], torch.arange(37 * 2))        # each assignment's row holds it

@needs_kernels
@pytest.mark.parametrize("gemm,weight_grad", [("library", "library"), ("library", "triton"), ("library", "per_expert"), ("auto", "auto")])
def test_aligned_dropless_layer_matches_float64_reference(monkeypatch, gemm, weight_grad):
    """A registered kernel asks for dropless groups on multiples of 8 rows: the layer plans them so, and its math holds
    on every backend (auto on a CPU: the Triton kernels), the weight gradients summing each group's empty rows as zeros."""
    if gemm == "library" and not GROUPED_MM_ON_CPU: pytest.skip("torch._grouped_mm does not run on this CPU")
    asked = []
    monkeypatch.setitem(moe.FAST_PATHS, "dropless_row_align", lambda x: asked.append(x.shape) or 8)
    with knob_values(moe, {"EXPERT_GEMM": gemm, "EXPERT_WEIGHT_GRAD": weight_grad}):
        errors = compare_triton_to_torch(20, 24, 5, 2, 29, "dropless", shared_expert_d_ff=8, device=DEVICE, block_m=16)
    assert asked == [(29, 20)], asked
    print(gemm, weight_grad, errors)
    assert max(errors.values()) < 1e-4, errors

@needs_kernels
@pytest.mark.parametrize("dispatch,capacity_factor,shared,top_k", [("dropless", 1.0, 8, 2), ("dropless", 1.0, 0, 3),
                                                                     ("dropless", 1.0, 0, 1), ("capacity", 0.8, 0, 2)])
def test_per_expert_layer_matches_float64_reference(dispatch, capacity_factor, shared, top_k):
    with knob_values(moe, {"EXPERT_GEMM": "per_expert", "EXPERT_WEIGHT_GRAD": "per_expert"}):
        errors = compare_triton_to_torch(20, 24, 5, top_k, 37, dispatch, capacity_factor, shared_expert_d_ff=shared,
                                         device=DEVICE, block_m=16, seed=top_k)
    print(dispatch, top_k, errors)
    assert errors.pop("router") < (1e-3 if top_k == 1 else 1e-4), errors        # top_k = 1: see the Triton test above
    assert max(errors.values()) < 1e-4, errors

def _uneven_routing(N, E, k, seed):
    "top_experts (N, k) where expert 0 takes most assignments, the last expert none, the others a few."
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g) + torch.tensor([4.0] + [0.0] * (E - 2) + [-1e9])
    return logits.topk(k, dim=-1).indices

@needs_kernels
@pytest.mark.parametrize("gemm,weight_grad", [("per_expert", "per_expert"), ("triton", "per_expert"), ("per_expert", "triton")])
def test_per_expert_uneven_groups_overwrite_and_accumulate(gemm, weight_grad):
    "Very uneven dropless groups with an empty expert: y and every gradient vs float64, main_grad written then accumulated."
    torch.manual_seed(8)
    N, D, FF, E, k = 41, 20, 24, 6, 2
    top_experts = _uneven_routing(N, E, k, seed=8)
    sizes = torch.bincount(top_experts.flatten(), minlength=E).tolist()
    assert sizes[-1] == 0 and sizes[0] == N and max(sizes[1:]) < N, sizes
    x64 = torch.randn(N, D, dtype=torch.float64).float().double().requires_grad_()    # values fp32 holds exactly
    w64 = torch.rand(N, k, dtype=torch.float64).float().double().requires_grad_()
    gate_up64 = (0.3 * torch.randn(E, D, 2 * FF, dtype=torch.float64)).float().double().requires_grad_()
    down64 = (0.3 * torch.randn(E, FF, D, dtype=torch.float64)).float().double().requires_grad_()
    probes = [torch.randn(N, D, dtype=torch.float64) for _ in range(2)]
    x, w = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
    gate_up, down = torch.nn.Parameter(gate_up64.detach().float()), torch.nn.Parameter(down64.detach().float())
    for p in (gate_up, down): p.main_grad = torch.full(p.shape, float("nan"))
    start_gradient_step([gate_up, down])
    plan = dropless_plan(top_experts, E)
    with knob_values(moe, {"EXPERT_GEMM": gemm, "EXPERT_WEIGHT_GRAD": weight_grad}):
        for i, probe in enumerate(probes):                                             # micro-batch 0 writes, 1 accumulates
            y = moe_experts_triton(x, w, plan, gate_up, down, block_m=16)
            (y.double() * probe).sum().backward()
            y64, _ = dropless_moe_reference(x64, top_experts, w64, gate_up64, down64)
            (y64 * probe).sum().backward()
            assert rel(y, y64) < 1e-5
            for got, want in [(x.grad, x64.grad), (w.grad, w64.grad), (gradient_fp32(gate_up), gate_up64.grad),
                              (gradient_fp32(down), down64.grad)]:
                assert rel(got, want) < 1e-5, (i, rel(got, want))
            assert gradient_fp32(gate_up)[-1].abs().max() == 0 and gradient_fp32(down)[-1].abs().max() == 0

@needs_kernels
def test_per_expert_reads_the_bounds_once_per_forward(monkeypatch):
    "One host_group_bounds call in the forward, none in the backward; none at all for the other backends."
    calls = []
    real = moe.host_group_bounds
    monkeypatch.setattr(moe, "host_group_bounds", lambda plan: calls.append(1) or real(plan))
    torch.manual_seed(9)
    layer = MoeFeedForward(16, 8, 4, 2, dispatch="dropless", impl="triton", device=DEVICE)
    layer.grouped_gemm_block_m = 16
    x = torch.randn(13, 16, device=DEVICE, requires_grad=True)
    for backend, want in [("per_expert", 1), ("triton", 0)]:
        calls.clear()
        with knob_values(moe, {"EXPERT_GEMM": backend, "EXPERT_WEIGHT_GRAD": backend}):
            start_gradient_step(layer.parameters())
            y = layer(x)
            assert len(calls) == want, (backend, calls)
            y.sum().backward()
        assert len(calls) == want, (backend, calls)

@needs_kernels
@pytest.mark.parametrize("backend", ["triton", "library", "per_expert"])
def test_empty_expert_gets_zero_gradient(backend):
    if backend == "library" and not GROUPED_MM_ON_CPU: pytest.skip("torch._grouped_mm does not run on this CPU")
    with knob_values(moe, {"EXPERT_GEMM": backend, "EXPERT_WEIGHT_GRAD": backend}):
        errors, empty_grad = check_empty_expert(n_tokens=17, n_experts=6, empty=0, device=DEVICE, seed=3)
    print(backend, errors)
    assert empty_grad == 0 and max(errors.values()) < 1e-4, (errors, empty_grad)

@needs_kernels
@pytest.mark.parametrize("R,FF", [(5, 37), (3, 2100)])     # FF past one block: the row's dot sums over two
def test_routed_swiglu_backward_matches_float64(R, FF):
    torch.manual_seed(R)
    N, k = 4, 2
    dact, hidden = torch.randn(R, FF, device=DEVICE), torch.randn(R, 2 * FF, device=DEVICE)
    weights = torch.rand(N, k, device=DEVICE)
    row_assignment = torch.randperm(N * k, device=DEVICE)[:R]
    row_assignment[1] = -1                                                # an unused capacity slot: weight 0
    w = torch.where(row_assignment >= 0, weights.flatten()[row_assignment.clamp(min=0)], 0.0)
    gate, up = hidden.double().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    h64 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    (torch.nn.functional.silu(h64[0]) * h64[1] * dact.double() * w.double()[:, None]).sum().backward()
    d_hidden, weighted_act = hidden.clone(), dact.clone()
    grad_weights = moe.routed_swiglu_backward(weighted_act, d_hidden, row_assignment, weights)
    assert rel(d_hidden.cpu(), torch.cat([h64[0].grad, h64[1].grad], -1).cpu()) < 1e-6
    assert rel(weighted_act.cpu(), (act * w.double()[:, None]).cpu()) < 1e-6 and weighted_act[1].abs().max() == 0
    want = torch.zeros(N * k, dtype=torch.float64, device=DEVICE)
    valid = row_assignment >= 0
    want[row_assignment[valid]] = (dact.double() * act).sum(-1)[valid]    # each row's dot at its assignment, 0 elsewhere
    assert grad_weights.shape == (N, k) and rel(grad_weights.flatten().cpu(), want.cpu()) < 1e-6
    assert (grad_weights.flatten()[want == 0] == 0).all()
    with pytest.raises(ValueError, match="routed_swiglu_backward"):
        moe.routed_swiglu_backward(dact, hidden[:, :-1].contiguous(), row_assignment, weights)

@needs_kernels
@pytest.mark.parametrize("N,D,E,top_k,dtype", [(37, 70, 5, 2, torch.float32), (100, 129, 8, 1, torch.float32),
                                               (65, 40, 8, 3, torch.bfloat16), (3, 16, 2, 2, torch.float16),
                                               (64, 256, 8, 2, torch.bfloat16), (5, 9, 1, 1, torch.float32),
                                               (50, 70, 12, 2, torch.float32)])
def test_route_tokens_triton_matches_float64(N, D, E, top_k, dtype):
    "The row-dot kernel up to 8 experts (masked, and whole tiles at 64 x 256), the tl.dot kernel above (12)."
    torch.manual_seed(N)
    x = torch.randn(N, D, device=DEVICE).to(dtype)
    router = torch.randn(D, E, device=DEVICE) * 0.3
    probs, experts, weights = moe.route_tokens_triton(x, router, top_k)
    p64, e64, w64 = route_tokens(x.double(), router.double(), top_k)
    assert probs.dtype == weights.dtype == torch.float32 and experts.dtype == torch.int64
    assert rel(probs, p64) < 1e-6, rel(probs, p64)
    assert torch.equal(experts, e64)                                      # no near-ties at this spread
    assert rel(weights, w64) < 1e-6 and torch.allclose(weights.sum(-1), torch.ones(N, device=DEVICE, dtype=torch.float32))

@needs_kernels
def test_route_tokens_triton_ties_fallback_and_errors():
    x, router = torch.randn(6, 20, device=DEVICE), torch.zeros(20, 5, device=DEVICE)    # every probability 1/5: all ties
    probs, experts, weights = moe.route_tokens_triton(x, router, 3)
    assert torch.equal(experts, torch.tensor([[0, 1, 2]] * 6, device=DEVICE))          # ties go to the lower expert
    assert torch.allclose(probs, torch.full_like(probs, 0.2)) and torch.allclose(weights, torch.full_like(weights, 1 / 3))
    x64, r64 = x.double(), torch.randn(20, 5, dtype=torch.float64, device=DEVICE)       # a float64 router: route_tokens
    for a, b in zip(moe.route_tokens_triton(x64, r64, 2), route_tokens(x64, r64, 2)): assert torch.equal(a, b)
    with pytest.raises(ValueError, match="route_tokens_triton"): moe.route_tokens_triton(x, router, 6)
    with pytest.raises(ValueError, match="route_tokens_triton"): moe.route_tokens_triton(x, torch.zeros(21, 5, device=DEVICE), 2)

@needs_kernels
@pytest.mark.parametrize("N,E,top_k,broadcast", [(37, 5, 2, False), (70, 8, 2, True), (9, 3, 3, False), (64, 8, 1, True)])
def test_router_backward_triton_matches_autograd_float64(N, E, top_k, broadcast):
    torch.manual_seed(E + N)
    logits = (torch.randn(N, E, dtype=torch.float64, device=DEVICE) * 2).requires_grad_()
    probs = logits.softmax(-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    weights = top_probs / top_probs.sum(-1, keepdim=True)
    grad_w = torch.randn(N, top_k, dtype=torch.float64, device=DEVICE)
    grad_p = (torch.randn(1, E, dtype=torch.float64, device=DEVICE).expand(N, E) if broadcast     # the load-balance loss's
              else torch.randn(N, E, dtype=torch.float64, device=DEVICE))                       # gradient is a broadcast
    torch.autograd.backward([weights, probs], [grad_w, grad_p])
    got = moe.router_backward_triton(grad_w.float(), weights.detach().float(), experts, probs.detach().float(), grad_p.float())
    assert rel(got, logits.grad) < 1e-5, rel(got, logits.grad)
    with pytest.raises(ValueError, match="router_backward_triton"):
        moe.router_backward_triton(grad_w, weights.detach(), experts, probs.detach(), grad_p)   # float64: not this kernel's

@needs_kernels
@pytest.mark.parametrize("N,top_k,E,capacity_factor,block", [(23, 2, 5, 0.8, None), (40, 2, 4, 1.7, None), (7, 1, 8, 1.0, None),
                                                               (300, 3, 6, 1.0, None), (300, 3, 6, 0.9, 16), (61, 2, 4, 1.3, 8)])
def test_capacity_plan_kernel_matches_reference(N, top_k, E, capacity_factor, block):
    torch.manual_seed(N)
    experts = torch.stack([torch.randperm(E)[:top_k] for _ in range(N)]).to(DEVICE)
    experts[: N // 3, 0] = 0                                              # crowd expert 0: drops under capacity < 2
    with knob_values(moe, {"PLAN_BLOCK": block or moe.PLAN_BLOCK}):   # small blocks: the count's carry
        got = capacity_plan(experts, E, capacity_factor)
    want = moe.capacity_plan_reference(experts, E, capacity_factor)
    assert got.capacity == want.capacity
    for field in ("row_token", "row_assignment", "assignment_rows", "group_starts", "group_ends"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert abs(got.dropped_fraction.item() - want.dropped_fraction.item()) < 1e-6

@needs_kernels
@pytest.mark.parametrize("N,top_k,E,row_align,block", [(23, 2, 5, 1, None), (23, 2, 5, 8, None), (300, 3, 6, 16, 16),
                                                         (61, 2, 4, 8, 8), (7, 1, 8, 4, None), (41, 2, 6, 8, 16)])
def test_dropless_plan_kernel_matches_reference(N, top_k, E, row_align, block):
    "Field for field against the argsort plan: crowded, empty (first and last) experts, packed and aligned groups."
    experts = _uneven_routing(N, E, top_k, seed=N)                        # expert 0 crowded, the last one empty
    if top_k == 1: experts[experts == 1] = 2                              # an empty expert between two others
    with knob_values(moe, {"PLAN_BLOCK": block or moe.PLAN_BLOCK}):       # small blocks: the count's carry
        got = dropless_plan(experts.to(DEVICE), E, row_align)
    want = moe.dropless_plan_reference(experts.to(DEVICE), E, row_align)
    assert got.row_align == want.row_align == row_align and got.capacity == want.capacity == 0
    for field in ("row_token", "row_assignment", "assignment_rows", "group_starts", "group_ends"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert got.dropped_fraction.item() == 0

@needs_kernels
def test_second_backward_through_one_forward_is_refused():
    torch.manual_seed(5)
    layer = MoeFeedForward(16, 8, 4, 2, dispatch="dropless", impl="triton", device=DEVICE)
    layer.grouped_gemm_block_m = 16
    x = torch.randn(11, 16, device=DEVICE, requires_grad=True)
    loss = layer(x).square().sum()
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert first.isfinite().all() and first.abs().sum() > 0
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, x)

@needs_kernels
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_saved_bytes_match_the_count_from_shapes(dispatch):
    torch.manual_seed(6)
    N, D, FF, E, k = 13, 16, 8, 4, 2
    x = torch.randn(N, D, device=DEVICE, requires_grad=True)
    gate_up = torch.nn.Parameter(torch.randn(E, D, 2 * FF, device=DEVICE)); down = torch.nn.Parameter(torch.randn(E, FF, D, device=DEVICE))
    _, experts, weights = route_tokens(x.detach(), torch.randn(D, E, device=DEVICE), k)
    plan = capacity_plan(experts, E, 1.0) if dispatch == "capacity" else dropless_plan(experts, E)
    measured, y = saved_tensor_bytes(lambda: moe_experts_triton(x, weights.requires_grad_(), plan, gate_up, down, block_m=16),
                                     exclude=[gate_up, down])
    want = sum(expert_saved_bytes(N, D, FF, E, k, plan.row_token.shape[0], itemsize=4).values())
    assert measured == want, (measured, want)

def test_router_logits_same_numbers_fewer_bytes():
    torch.manual_seed(7)
    x0, r0 = torch.randn(23, 12, dtype=torch.bfloat16), torch.randn(12, 5)
    out, saved = {}, {}
    for name, logits_fn in (("autograd", None), ("low_memory", moe.RouterLogits.apply)):
        x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
        saved[name], (probs, _, weights) = saved_tensor_bytes(lambda: route_tokens(x, r, 2, logits_fn=logits_fn), exclude=[r])
        (probs.square().sum() + weights.exp().sum()).backward()
        out[name] = [probs.detach(), weights.detach(), x.grad, r.grad]
    for a, b in zip(out["autograd"], out["low_memory"]): assert torch.equal(a, b)
    assert saved["autograd"] - saved["low_memory"] == 23 * 12 * 2     # the fp32 copy of x (4 bytes) replaced by x (2 bytes)

@needs_kernels
@pytest.mark.parametrize("N,D,E,dtype", [(37, 70, 5, torch.float32), (100, 129, 8, torch.float32), (1, 16, 2, torch.float32),
                                         (45, 66, 8, torch.bfloat16), (600, 40, 3, torch.float16), (64, 256, 6, torch.bfloat16),
                                         (33, 70, 16, torch.float32)])
def test_router_logits_triton_matches_float64(N, D, E, dtype):
    errors = moe.router_parity_errors(N, D, E, dtype, device=DEVICE, seed=N)
    print(errors)
    assert errors["logits"] < 1e-5 and errors["router"] < 1e-5, errors    # fp32 sums of values the dtype holds exactly
    assert errors["x"] < (1e-5 if dtype == torch.float32 else 1e-2), errors   # dx is written in x's dtype

@needs_kernels
def test_router_kernels_fall_back_and_refuse_bad_shapes():
    x, r = torch.randn(9, 20, device=DEVICE), torch.randn(20, 4, device=DEVICE)
    assert moe.router_logits_triton(x, r).dtype == torch.float32
    x64, r64 = x.double(), r.double()                                   # a float64 router: the torch products
    assert torch.equal(moe.router_logits_triton(x64, r64), x64 @ r64)
    g64 = torch.randn(9, 4, dtype=torch.float64, device=DEVICE)
    assert torch.equal(moe.router_weight_grad_triton(x64, g64, r64), x64.T @ g64)
    with pytest.raises(ValueError, match="router_logits_triton"):
        moe.router_logits_triton(x, torch.randn(21, 4, device=DEVICE))
    with pytest.raises(ValueError, match="router_weight_grad_triton"):
        moe.router_weight_grad_triton(x, g64.float(), torch.randn(21, 4, device=DEVICE))
    no_rows = torch.full((9, 1), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="combine_rows_triton"):                # the router's dx needs an fp32 router
        combine_rows_triton(torch.zeros(1, 20, device=DEVICE), no_rows, router_grad=(g64.float(), r64))

@needs_kernels
def test_triton_layer_refuses_float64():
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        MoeFeedForward(8, 4, 3, 2, impl="triton", dtype=torch.float64)

def test_benchmark_arms_quick_leaves_out_max_autotune_only():
    full, quick = moe.benchmark_arms(), moe.benchmark_arms(quick=True)
    assert list(full) == list(moe.BENCHMARK_ARMS) and len(full) == 12
    assert [n for n in full if n not in quick] == ["torch.compile max-autotune capacity"]
    assert next(iter(quick)) == "torch.compile capacity" and moe.COMPILE_MODES["torch.compile capacity"] == "default"

def test_the_moe_module_alone_runs_a_shared_expert():
    "In a fresh process that imports only rtrainer.moe, a layer with a shared expert finds the `linear` op it runs."
    import subprocess, sys
    code = ("import torch; from rtrainer.moe import MoeFeedForward; "
            "print(MoeFeedForward(8, 6, 4, 2, shared_expert_d_ff=4)(torch.randn(5, 8)).shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch.Size([5, 8])" in out.stdout, out.stderr[-2000:]
