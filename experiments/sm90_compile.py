"""Compiling kernels for sm_90 on a machine without a GPU, for the experiment scripts' compile checks
(`attention_variants.py --compile-check`, `attention_ahead.py --inspect`, `attention_gluon.py --compile`,
`moe_gemm_variants.py --compile`): Triton's compiler for one kernel at one config, and what ptxas says of the PTX.
`compile_gluon_sm90` does the same for a Gluon kernel. Run them under the Triton of the GPU machine (3.6) for numbers
that match it."""
import inspect, os, re, subprocess, tempfile
import triton

def compile_sm90(kernel, signature, constexprs, hints=(), warps=4, stages=3):
    """`kernel` (triton.jit) compiled for sm_90: `signature` gives the type of each parameter that is not in
    `constexprs` ({name: value}); `hints` are the parameters the launcher would see divisible by 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else signature[p] for p in params}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(n),): v for n, v in constexprs.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in hints})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

def ptxas_usage(ptx):
    "(registers per thread, spilled bytes) that ptxas reports for `ptx` on sm_90a; None for what it did not print."
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f: f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx))
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", os.path.join(tmp, "k.ptx"), "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    registers, spilled = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return (int(registers.group(1)) if registers else None), (int(spilled.group(1)) if spilled else None)

def compile_gluon_sm90(kernel, constexprs, descs, warps, types=None, hints=()):
    """A Gluon kernel compiled for sm_90 without a GPU: ((registers, spilled bytes), shared memory bytes, PTX). `descs`
    gives the (rows, cols) or (values,) block of each tensor-descriptor parameter, bf16 unless a last item names the
    dtype ("fp32"; a 1-D block is unswizzled), `types` the type of each other parameter that is not an i32 (e.g. {"LSE": "*fp32"}), `hints` the
    parameters the launcher would see divisible by 16."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    params = list(inspect.signature(kernel.fn).parameters)
    def desc(*block):                                # (rows, cols) or (values,), then the dtype if not bf16
        dims, dtype = (block[:-1], block[-1]) if isinstance(block[-1], str) else (block, "bf16")
        bits = dict(bf16=16, fp32=32)[dtype]
        layout = (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=1) if len(dims) == 1 else
                  gl.NVMMASharedLayout.get_default_for(list(dims), dict(bf16=gl.bfloat16, fp32=gl.float32)[dtype]))
        return f"tensordesc<{dtype}[{', '.join(map(str, dims))}],{layout!r}>"
    sig = {p: "constexpr" if p in constexprs else desc(*descs[p]) if p in descs else (types or {}).get(p, "i32")
           for p in params}
    src = GluonASTSource(kernel, sig, constexprs={(params.index(n),): v for n, v in constexprs.items()},
                         attrs={(params.index(p),): [["tt.divisibility", 16]] for p in hints})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    return ptxas_usage(c.asm["ptx"]), c.metadata.shared, c.asm["ptx"]

