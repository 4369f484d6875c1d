"""What capturing rtrainer's whole training step in one CUDA graph buys on a model whose step is bound by the host's
launches (rb100m on the H200). The question, the runs and the answer: experiments/graph_step_check.md.

Arms, each a fresh process, alternated over ROUNDS rounds, the warm-up steps (at least GRAPH_WARMUP_STEPS + 1, so
that the capture falls in them) and then STEPS timed ones; the summary gives the paired ratio graph/arm with its 95%
interval:

  trainer      Trainer.train_step as it is (gradient buffers freed between steps)
  persistent   the trainer's CapturedStep body run eagerly (capture=False): every buffer at a fixed address
  graph        the trainer with cuda_graph=True: that body captured once in a CUDA graph and replayed

`python experiments/graph_step_check.py [--config rb100m] [--rounds 3]` on a GPU (GPU suite stage graph-step); writes
$OUT/graph_step_check.json when OUT is set. `--device cpu --config tiny --arms trainer,persistent` runs the eager arms
on a CPU (TRITON_INTERPRET=1)."""
import json, sys, time
import torch
from arm_rounds import arguments, synthetic_trainer, warmup_steps, report, alternated_rounds

ARMS = ("trainer", "persistent", "graph")

def child(spec):
    import rtrainer.optimizer as optimizer
    from rtrainer.training import CapturedStep
    arm = spec["arm"]
    trainer = synthetic_trainer(spec, cuda_graph=arm == "graph")
    if arm == "persistent": trainer.captured = CapturedStep(trainer, capture=False)
    cuda = trainer.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(trainer.device)) if cuda else (lambda: None)
    losses = []
    def step(i): losses.append(trainer.train_step(i)["loss"])
    warmup = warmup_steps(spec)
    for i in range(warmup): step(i)
    sync(); del losses[:]
    builds = dict(optimizer.TABLE_BUILDS)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + spec["steps"]): step(i)
    sync(); seconds = time.perf_counter() - t0
    report(spec, seconds, losses, peak_memory_gib=torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None,
           peak_reserved_gib=torch.cuda.max_memory_reserved(trainer.device) / 2**30 if cuda else None,
           table_builds_timed={k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds})

def main():
    a = arguments(__doc__, ARMS, steps=8)
    alternated_rounds(__file__, a, "graph", "graph_step_check",
                      describe=lambda res: f", losses {[round(v, 3) for v in res['losses']]}")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
