"""A TMA reduce-add from Gluon under Triton 3.6: the step a dK/dV kernel that also accumulates dQ would need.

Why: the Hopper backward (rtrainer.attention_hopper) runs dQ and dK/dV as two kernels, seven matmul products where a
kernel that adds each key tile's share of dQ into an fp32 buffer as it goes needs five; at T 8192, head dim 64 that is
why it trails cuDNN (experiments/attention_ws.md, round 18). Gluon's Hopper `tma` module in Triton 3.6 has no
reduce-add copy, but its IR builder has `create_async_tma_reduce`. `async_reduce_add` below wraps it the way
`tma.async_copy_shared_to_global` wraps the plain store.

`python experiments/tma_reduce.py --compile` compiles the kernel for sm_90 without a GPU and prints the PTX's bulk
reduce instruction. On a GPU (no argument) it has every program add its own random fp32 block into blocks of one
buffer, 4 programs to a block, and checks the sums against torch's in float64.

This is an experiment, not part of rtrainer."""
import os, sys
import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BLOCK_M, HEAD_DIM, PROGRAMS, SHARING = 64, 64, 32, 4     # each output block takes the sums of SHARING programs

@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    "TMA reduce-add of shared-memory block `src` into the global block of `tensor_desc` at `coord`; completes like a TMA store."
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

@gluon.jit
def reduce_add_kernel(acc_desc, X, SHARING: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    "Program p adds its (BLOCK_M, HEAD_DIM) block of X into block p % (programs / SHARING) of acc_desc's buffer."
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    p = gl.program_id(0)
    rows = p * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, layout))
    x = gl.load(X + gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0))
    smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], acc_desc.layout)
    smem.store(x)
    fence_async_shared()
    async_reduce_add(acc_desc, [p % (gl.num_programs(0) // SHARING) * BLOCK_M, 0], smem)
    tma.store_wait(0)

def _layout(): return gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)

def compile_check():
    "The kernel compiled for sm_90 without a GPU: ptxas's registers and spills, and the PTX's reduce instruction."
    from sm90_compile import compile_gluon_sm90
    (registers, spilled), _, ptx = compile_gluon_sm90(reduce_add_kernel, dict(SHARING=SHARING, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM),
                                                      dict(acc_desc=(BLOCK_M, HEAD_DIM, "fp32")), 4, types=dict(X="*fp32"))
    reduce = [line.strip() for line in ptx.splitlines() if "cp.reduce" in line]
    print(f"{registers} registers, spills {spilled} bytes; {reduce or 'NO bulk reduce instruction'}")
    return bool(reduce)

def gpu_check():
    "Every program's block added into its output block; the sums against torch's in float64."
    torch.manual_seed(0)
    x = torch.randn(PROGRAMS * BLOCK_M, HEAD_DIM, device="cuda")
    start = torch.randn(PROGRAMS // SHARING * BLOCK_M, HEAD_DIM, device="cuda")
    acc = start.clone()
    desc = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [BLOCK_M, HEAD_DIM], _layout())
    reduce_add_kernel[(PROGRAMS,)](desc, x, SHARING=SHARING, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, num_warps=4)
    want = start.double() + x.double().view(SHARING, PROGRAMS // SHARING * BLOCK_M, HEAD_DIM).sum(0)
    error = ((acc.double() - want).abs().max() / want.abs().max()).item()
    print(f"TMA reduce-add on {torch.cuda.get_device_name()}: max relative error {error:.1e}")
    return error < 1e-6

if __name__ == "__main__":
    if "--compile" in sys.argv: sys.exit(0 if compile_check() else 1)
    if not torch.cuda.is_available(): sys.exit("tma_reduce: needs a CUDA GPU (or --compile)")
    sys.exit(0 if gpu_check() else 1)
