"""One place that chooses Triton's mode for the whole test run, before any test module imports rtrainer: the interpreter
(TRITON_INTERPRET=1) on a machine without a GPU, compiled kernels on a GPU. A test module that set it itself would set
it for every module collected after it, and for every process they start (on the GPU, the whole suite ran interpreted
from the first module that did)."""
import os
import torch

if not torch.cuda.is_available(): os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("TRITON_INTERPRET") == "1":
    raise RuntimeError("tests: TRITON_INTERPRET=1 on a machine with a GPU; unset it to test the compiled kernels")
