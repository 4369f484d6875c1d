"""A notebook-first, literate LLM training engine in PyTorch and Triton

Modules:

- `rtrainer.attention_hopper`: A warp-specialized flash-attention forward and dQ kernel in Gluon for the H100/H200 (sm_90): a loader warp, two consumer warpgroups taking turns on the tensor cores, one persistent program per SM. They replace the Triton kernels of `02_attention` where they are faster, behind the same functions."""

__version__ = "0.1.0"
