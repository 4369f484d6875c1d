"""One launch each of the Triton, the Hopper (rtrainer.attention_hopper) and cuDNN's attention forward, and of the Triton
and Hopper dQ and dK/dV kernels, and cuDNN's backward, at dense1b (PROFILE_SHAPE: another shape of attention_configs,
T8192 say), for Nsight Compute: `ncu --clock-control none --section ... python experiments/attention_ws_profile.py` (GPU suite stage
`attention-ws-profile`). Warm-up launches run before `torch.cuda.profiler.start()`, so ncu run with
`--profile-from-start off` sees one launch of each kernel. An experiment, not part of rtrainer."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_ws import _inputs
from attention_configs import shape_dims
import rtrainer.attention_hopper as hopper
from rtrainer.attention import flash_attention_forward, flash_backward_dq, flash_backward_dkdv
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F

B, H, KV, T, hd = shape_dims(os.environ.get("PROFILE_SHAPE", "dense1b"))
a = _inputs(B, T, H, KV, hd, seed=2)
hopper.ENABLED = False                       # flash_attention_forward / flash_backward_dq / _dkdv: the Triton kernels
qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (a["q"], a["k"].repeat_interleave(H // KV, 2),
                                                                      a["v"].repeat_interleave(H // KV, 2)))
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
def cudnn_both():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), a["do"].transpose(1, 2))
arms = [lambda: flash_attention_forward(a["q"], a["k"], a["v"], True), lambda: hopper.hopper_forward(a["q"], a["k"], a["v"]), cudnn,
        lambda: flash_backward_dq(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], True),
        lambda: hopper.hopper_dq(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"]),
        lambda: flash_backward_dkdv(a["do"], a["q"], a["k"], a["v"], a["lse"], a["delta"], True),
        lambda: hopper.hopper_dkdv(a["do"], a["q"], a["k"], a["v"], a["lse"], a["delta"]), cudnn_both]
for fn in arms: fn(); fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for fn in arms: fn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled", len(arms), "launches")
