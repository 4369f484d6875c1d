"""One launch each of the Triton, the Hopper (rtrainer.attention_hopper) and cuDNN's attention forward, and of the Triton
and Hopper dQ and dK/dV kernels, at dense1b, for
Nsight Compute: `ncu --clock-control none --section ... python experiments/attention_ws_profile.py` (GPU suite stage
`attention-ws-profile`). Warm-up launches run before `torch.cuda.profiler.start()`, so ncu run with
`--profile-from-start off` sees one launch of each kernel. An experiment, not part of rtrainer."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_ws import _inputs
import rtrainer.attention_hopper as hopper
from rtrainer.attention import flash_attention_forward, flash_backward_dq, flash_backward_dkdv, REFERENCE_ATTENTION_SHAPES
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F

B, H, KV, T, hd = REFERENCE_ATTENTION_SHAPES["dense1b"]
a = _inputs(B, T, H, KV, hd, seed=2)
hopper.ENABLED = False                       # flash_attention_forward / flash_backward_dq / _dkdv: the Triton kernels
qt, kt, vt = (t.transpose(1, 2) for t in (a["q"], a["k"], a["v"]))
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
arms = [lambda: flash_attention_forward(a["q"], a["k"], a["v"], True), lambda: hopper.hopper_forward(a["q"], a["k"], a["v"]), cudnn,
        lambda: flash_backward_dq(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], True),
        lambda: hopper.hopper_dq(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"]),
        lambda: flash_backward_dkdv(a["do"], a["q"], a["k"], a["v"], a["lse"], a["delta"], True),
        lambda: hopper.hopper_dkdv(a["do"], a["q"], a["k"], a["v"], a["lse"], a["delta"])]
for fn in arms: fn(); fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for fn in arms: fn()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled", len(arms), "launches")
