"""The Hopper attention kernels (rtrainer.attention_hopper) on an sm_90 GPU: bf16 within 1e-2 of float64 through the
package's functions, the kernels really taken (CALLS), the Triton kernels for what they decline."""
import pytest
import torch

pytestmark = pytest.mark.cuda

def _hopper(monkeypatch):
    "The module, with the Hopper path on."
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0): pytest.skip("needs an sm_90 GPU")
    import rtrainer.attention_hopper as hopper
    monkeypatch.setattr(hopper, "ENABLED", True)
    return hopper

CASES = [  # B, T, H, KV, hd
    (2, 1000, 12, 4, 64),     # rb100m heads, T not a multiple of any tile
    (1, 777, 16, 16, 128),    # dense1b head dim
    (2, 257, 8, 1, 128),      # one KV head
    (1, 300, 6, 2, 128),      # groups of 3
    (1, 513, 48, 48, 64),     # moe4b heads
    (1, 1, 4, 2, 64),         # a single position
    (1, 1, 4, 2, 128),
    (1, 4099, 4, 2, 64),      # long, ragged last tile
    (2, 1024, 16, 16, 128),   # whole tiles only: every output by TMA store
]

@pytest.mark.parametrize("B,T,H,KV,hd", CASES)
def test_hopper_attention_parity(B, T, H, KV, hd, monkeypatch):
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import attention_parity_errors
    hopper.CALLS.clear()
    errors = attention_parity_errors(B, T, H, KV, hd, torch.bfloat16, True, device="cuda")
    print(f"B{B} T{T} H{H} KV{KV} hd{hd}:", {k: f"{e:.1e}" for k, e in errors.items()}, dict(hopper.CALLS))
    assert max(errors.values()) < 1e-2, errors
    assert hopper.CALLS["forward"] >= 2 and hopper.CALLS["dq"] == (2 if hd == 128 or KV < H else 0)
    assert hopper.CALLS["dkdv"] == (2 if hd == 128 or KV < H else 0)      # head dim 64 without groups keeps Triton's

@pytest.mark.parametrize("B,T,H,KV,hd", [(2, 1000, 12, 4, 64), (1, 777, 16, 16, 128), (3, 300, 6, 2, 128), (2, 513, 6, 6, 64)])
def test_hopper_attention_in_narrow_sections(B, T, H, KV, hd, monkeypatch):
    "The tile order in sections of five groups of heads, the last one narrower: every tile still runs once, right."
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import attention_parity_errors
    monkeypatch.setattr(hopper, "section_heads", lambda kind, B, T, H, KV, hd, n_pairs, programs: min(B * KV, 5) if kind == "dkdv" else min(B * H, 5 * (H // KV)))
    monkeypatch.setattr(hopper, "TILE_TABLE", dict(forward=False, dq=False, dkdv=False))
    hopper.CALLS.clear()
    errors = attention_parity_errors(B, T, H, KV, hd, torch.bfloat16, True, device="cuda")
    assert max(errors.values()) < 1e-2, errors
    assert hopper.CALLS["forward"] >= 2 and hopper.CALLS["dq"] == (2 if hd == 128 or KV < H else 0)
    assert hopper.CALLS["dkdv"] == (2 if hd == 128 or KV < H else 0)

@pytest.mark.parametrize("B,T,H,KV,hd", [(2, 4099, 12, 4, 64), (4, 3000, 8, 8, 128), (1, 300, 6, 2, 128)])
def test_hopper_kernels_in_a_table_order(B, T, H, KV, hd, monkeypatch):
    """Every kernel taking its tiles from a host-built table (sections of five groups of query heads, five KV heads for
    dK/dV, the last narrower): every tile once, right."""
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import attention_parity_errors
    plans = []
    def plan(kind, B, T, H, KV, hd, n_pairs, programs, device):
        heads, group = (B * KV, 1) if kind == "dkdv" else (B * H, H // KV)
        plans.append(kind)
        width = min(heads, 5 * group)
        return width, hopper.tile_table(n_pairs, heads, width, programs).to(device)
    monkeypatch.setattr(hopper, "_plan", plan)
    hopper.CALLS.clear()
    errors = attention_parity_errors(B, T, H, KV, hd, torch.bfloat16, True, device="cuda")
    assert max(errors.values()) < 1e-2, errors
    assert all(hopper.CALLS[kind] >= 2 for kind in ("forward", "dq", "dkdv")), dict(hopper.CALLS)
    assert sorted(set(plans)) == ["dkdv", "dq", "forward"], plans

@pytest.mark.parametrize("hd,tiles", [(64, (64, 64, 3, True, True)), (64, (64, 64, 3, True, False)),
                                      (64, (64, 64, 3, False, True)), (64, (64, 64, 2, False, False)),
                                      (128, (64, 64, 3, False, True))])
@pytest.mark.parametrize("B,T,H,KV", [(2, 1000, 12, 4), (1, 900, 4, 2), (1, 1, 4, 2), (2, 513, 6, 6), (1, 4, 4, 2), (3, 68, 2, 1)])
def test_hopper_dkdv_both_schedules(hd, tiles, B, T, H, KV, monkeypatch):
    """The dK/dV kernel pipelined and step by step, lse and δ brought by the loader or loaded by the consumers, at head
    dim 64 (and the step kernel with the loader's lse and δ at 128) against float64,
    grouped heads or not: T 900 leaves the second consumer's keys of the last pair past T, T 1 all of them; 1000 and
    513 end in ragged blocks; at T 4 and 68 the loader's lse block runs past the tensor's end (T 513 and 1 take the
    consumers' loads: their heads' lse do not start 16-byte aligned)."""
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import attention_parity_errors
    monkeypatch.setitem(hopper.DKDV_TILES, hd, tiles)
    monkeypatch.setattr(hopper, "GROUPED_ONLY_HEAD_DIMS", set())
    hopper.CALLS.clear()
    errors = attention_parity_errors(B, T, H, KV, hd, torch.bfloat16, True, device="cuda")
    assert max(errors.values()) < 1e-2, errors
    assert hopper.CALLS["dkdv"] == 2, dict(hopper.CALLS)

@pytest.mark.parametrize("hd", [64, 128])
def test_hopper_dkdv_takes_lse_at_any_alignment(hd, monkeypatch):
    """lse and δ whose bases are 4 bytes past a 16-byte boundary: the Hopper dK/dV still runs (its consumers load them,
    where the loader's TMA copy would need an aligned start), and gives the dK and dV of aligned copies."""
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import flash_backward_dkdv
    monkeypatch.setattr(hopper, "GROUPED_ONLY_HEAD_DIMS", set())
    B, T, H, KV = 2, 256, 4, 2
    q, do = (torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(B, T, KV, hd, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    o, lse = hopper.hopper_forward(q, k, v)
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    def shifted(t):                                   # the same values, 4 bytes into a fresh buffer
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.flatten())
        return buf[1:].view(t.shape)
    hopper.CALLS.clear()
    aligned = flash_backward_dkdv(do, q, k, v, lse, delta)
    moved = flash_backward_dkdv(do, q, k, v, shifted(lse), shifted(delta))
    assert hopper.CALLS["dkdv"] == 2, dict(hopper.CALLS)
    for a, m in zip(aligned, moved):
        assert (m.float() - a.float()).abs().max() <= 1e-2 * a.float().abs().max()

def _tile_start(kind, t, n_pairs, heads, width, per_batch, rows):
    "(batch, head, first row) of the tile at index t of `kind`'s order in sections of `width` heads (the kernels' _sectioned, _tile)."
    first = t // (n_pairs * width) * width
    r = t - first * n_pairs
    pair, head = divmod(r, min(width, heads - first))
    head += first
    start = pair * rows if kind == "dkdv" else (n_pairs - 1 - pair) * rows      # dK/dV: key pairs; forward, dQ: query pairs last first
    return head // per_batch, head % per_batch, start

@pytest.mark.parametrize("kind", ["forward", "dq", "dkdv"])
@pytest.mark.parametrize("hd", [64, 128])
def test_hopper_kernels_read_their_table(kind, hd, monkeypatch):
    """A table that is not a permutation (odd positions repeat the tiles of even ones, in sections of two groups, or of
    three KV heads of four): exactly the rows of the tiles it names are written, as the computed order writes them,
    the rest stay NaN. Fails if a kernel ignores its table or reads it at another width."""
    hopper = _hopper(monkeypatch)
    B, T, H, KV = 2, 1024, 6, 2
    torch.manual_seed(0)
    q = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, T, KV, hd, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    do = torch.randn_like(q)
    o, lse = hopper.hopper_forward(q, k, v)                                # the computed orders (no table at this shape)
    dq, delta = hopper.hopper_dq(do, q, k, v, o, lse)
    dk, dv = hopper.hopper_dkdv(do, q, k, v, lse, delta)
    heads, per_batch, width = (B * KV, KV, 3) if kind == "dkdv" else (B * H, H, 2 * (H // KV))
    named = set()
    package_plan = hopper._plan
    def plan(kind_, B, T, H, KV, hd, n_pairs, programs, device):
        if kind_ != kind: return package_plan(kind_, B, T, H, KV, hd, n_pairs, programs, device)
        table = hopper.tile_table(n_pairs, heads, width, programs)
        table[1::2] = table[0::2][:len(table) // 2].clone()
        named.update(table.tolist())
        plan.n_pairs = n_pairs
        return width, table.to(device)
    monkeypatch.setattr(hopper, "_plan", plan)
    nan = lambda t: torch.full_like(t, float("nan"))
    if kind == "forward": out, ref = hopper.hopper_forward(q, k, v, nan(o), nan(lse))[0], o
    elif kind == "dq": out, ref = hopper.hopper_dq(do, q, k, v, o, lse, nan(dq), nan(delta))[0], dq
    else: out, ref = hopper.hopper_dkdv(do, q, k, v, lse, delta, nan(dk), nan(dv))[0], dk
    torch.cuda.synchronize()
    rows = T // plan.n_pairs
    written = torch.zeros(out.shape[:3], dtype=torch.bool, device="cuda")
    for t in named:
        b, h, start = _tile_start(kind, t, plan.n_pairs, heads, width, per_batch, rows)
        written[b, start:start + rows, h] = True
    assert 0 < len(named) < plan.n_pairs * heads and written.any() and not written.all()
    assert torch.equal(out[written], ref[written]), "a named tile differs from the computed order's"
    assert out[~written].isnan().all(), "rows of tiles the table does not name were written"

@pytest.mark.parametrize("B,T,H,KV,hd", [(2, 1000, 12, 4, 64), (1, 777, 16, 16, 128)])
def test_hopper_in_the_models_rope_attention(B, T, H, KV, hd, monkeypatch):
    "The model's fused RoPE + attention op, whose q, k are views of one rotated buffer and dq a view of dqkv."
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import rope_attention_errors
    hopper.CALLS.clear()
    error, same = rope_attention_errors(B, T, H, KV, hd, torch.bfloat16, device="cuda")
    assert error < 1e-2 and same, (error, same)
    assert hopper.CALLS["forward"] >= 2 and hopper.CALLS["dkdv"] >= 1     # dk, dv: views of the fused dqkv

def test_hopper_matches_triton_and_declines_what_it_cannot_take(monkeypatch):
    hopper = _hopper(monkeypatch)
    from rtrainer.attention import flash_attention, fused_qkv_views, relative_error
    q, k, v = fused_qkv_views(2, 600, 8, 4, 128, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    def run():
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*x)
        return (out, *torch.autograd.grad(out, x, do))
    hopper.CALLS.clear()
    fast = run()
    assert hopper.CALLS["forward"] == 1 and hopper.CALLS["dq"] == 1 and hopper.CALLS["dkdv"] == 1
    monkeypatch.setattr(hopper, "ENABLED", False)
    slow = run()
    monkeypatch.setattr(hopper, "ENABLED", True)
    assert hopper.CALLS["forward"] == 1
    assert all(relative_error(a, b) < 1e-2 for a, b in zip(fast, slow))
    for args, why in (((q.half(), k.half(), v.half()), "not bf16"), ((q, k, v, False), "not causal")):
        hopper.CALLS.clear()
        flash_attention(*args)
        assert hopper.CALLS["forward"] == 0, why

def test_attention_through_direct_launches_repeats_bit_for_bit(monkeypatch):
    "A second forward + backward at the same shapes goes through K.launch's direct path and gives the same bits."
    _hopper(monkeypatch)
    from rtrainer import kernels as K
    from rtrainer.attention import flash_attention, fused_qkv_views
    for H, KV, hd in ((12, 4, 64), (8, 8, 64), (8, 8, 128)):            # the Hopper and the Triton kernels, both head dims
        q, k, v = fused_qkv_views(2, 700, H, KV, hd, torch.bfloat16, "cuda")
        do = torch.randn_like(q)
        def run():
            x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = flash_attention(*x)
            return (out, *torch.autograd.grad(out, x, do))
        first = run()
        direct = K.LAUNCH_COUNTS["direct"]
        second = run()
        assert K.LAUNCH_COUNTS["direct"] >= direct + 3, (H, KV, hd)
        assert all(torch.equal(a, b) for a, b in zip(first, second)), (H, KV, hd)
