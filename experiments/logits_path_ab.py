"""Does the Hopper logits path (03a's GEMM writing the log-sum-exp partials, so that the cross-entropy kernel reads
each row of logits once) make the training step faster? The account: experiments/ce_lse_epilogue.md. The arms, each a
fresh process, alternated over ROUNDS rounds, WARMUP steps (at least the eager ones and the capture) and then STEPS
timed ones, the default trainer (its step replayed as one CUDA graph):

  partials   the package as it is: the logits from matmul.FAST_PATHS["logits"] where it takes the chunk
  cuBLAS     the same with that entry removed: cuBLAS writes the logits and the kernel reads each row twice

Every loss of the timed window must be finite. Prints each round and the paired ratio partials/arm with its 95%
interval. `python experiments/logits_path_ab.py [--config prof183m] [--batch-size 32] [--rounds 3]` on a GPU (GPU
suite stage logits-ab); writes $OUT/logits_path_ab.json when OUT is set."""
import json, sys, time
import torch
from arm_rounds import arguments, synthetic_trainer, warmup_steps, report, alternated_rounds

ARMS = ("partials", "cuBLAS")

def child(spec):
    from rtrainer import matmul, moe_hopper
    if spec["arm"] == "cuBLAS": del matmul.FAST_PATHS["logits"]
    trainer = synthetic_trainer(spec, cuda_graph="on")
    warmup = warmup_steps(spec)
    calls = moe_hopper.CALLS["logits"]
    losses = [trainer.train_step(i)["loss"] for i in range(warmup)]
    torch.cuda.synchronize()
    took_path = moe_hopper.CALLS["logits"] > calls           # counted while the graph was captured
    t0 = time.perf_counter()
    losses = [trainer.train_step(i)["loss"] for i in range(warmup, warmup + spec["steps"])]
    torch.cuda.synchronize()
    report(spec, time.perf_counter() - t0, losses, logits_path=took_path)

def main():
    a = arguments(__doc__, ARMS, steps=10)
    alternated_rounds(__file__, a, "partials", "logits_path_ab", describe=lambda res: f", logits path {res['logits_path']}")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
