"""Diagnose the bf16 capacity-layer parity test on the GPU: routing decisions of the kernel layer against float64."""
import torch
from rtrainer.moe import MoeFeedForward, route_tokens, RouterLogits, router_logits_triton, capacity_plan
torch.manual_seed(1)
D, FF, E, k, N = 512, 384, 8, 2, 4000
fast = MoeFeedForward(D, FF, E, k, dispatch="capacity", shared_expert_d_ff=256, impl="triton", dtype=torch.bfloat16, device="cuda")
oracle = MoeFeedForward(D, FF, E, k, dispatch="capacity", shared_expert_d_ff=256, impl="torch", dtype=torch.float64, device="cuda")
with torch.no_grad():
    for p64, p in zip(oracle.parameters(), fast.parameters()): p64.copy_(p.double())
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
x64 = x.double()
_, te64, _ = route_tokens(x64, oracle.router, k)
for name, fn in (("triton", router_logits_triton), ("RouterLogits fp32", RouterLogits.apply)):
    _, te, _ = route_tokens(x, fast.router, k, logits_fn=fn)
    flips = (te.sort(-1).values != te64.sort(-1).values).any(-1).sum().item()
    order = (te != te64).any(-1).sum().item()
    lg = fn(x, fast.router)
    p, p64 = capacity_plan(te, E, 1.0), capacity_plan(te64, E, 1.0)
    print(f"{name}: tokens with another expert set {flips}, another order {order}, logit max err "
          f"{(lg.double() - x64 @ oracle.router).abs().max().item():.2e}, same plan rows {torch.equal(p.row_token, p64.row_token)}")
