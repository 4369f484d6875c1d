"""What the trainer's host synchronization per step costs on a host-bound model (rb100m), and whether Python's garbage
collector is behind the spread of the eager trainer's rate between processes. The question, the runs and the answer:
experiments/step_sync_check.md. The arms, each a fresh process, alternated over ROUNDS rounds, WARMUP steps and then
STEPS timed ones:

  trainer           Trainer.train_step as it is
  no-sync           the same device work without the read: the gradient norm and clip scale are computed but not
                    read, and the losses are read after the timed window. An upper bound on
                    what a device-side guard (skip the update on a non-finite step, check one step late) would buy.
  trainer-gc-off    the trainer with Python's garbage collector off over the timed steps (gc.collect() first)
  no-sync-gc-off    both

Every loss of the timed window must be finite. Prints each round and the paired ratio no-sync/arm with its 95% interval.
`python experiments/step_sync_check.py [--config rb100m] [--batch-size 32] [--rounds 3]` on a GPU (GPU suite stage
step-sync); writes $OUT/step_sync_check.json when OUT is set. `--device cpu --config tiny` runs it on a CPU
(TRITON_INTERPRET=1)."""
import gc, json, sys, time
import torch
from arm_rounds import arguments, synthetic_trainer, report, alternated_rounds

ARMS = ("trainer", "no-sync", "trainer-gc-off", "no-sync-gc-off")

def child(spec):
    from rtrainer.moe import load_balance_weight
    trainer = synthetic_trainer(spec)
    device = trainer.device
    no_sync = spec["arm"].startswith("no-sync")

    def step_without_sync(i):
        c = trainer.cfg
        lbw = load_balance_weight(i, c.load_balance_weight, c.load_balance_decay_steps)
        stats, norm, scale = trainer.accumulate(trainer.micro_batches(i), lbw)   # the trainer's device work,
        trainer.optimizer.step(trainer.lr_at(i), grad_scale=scale)              # its loss and norm never read
        return stats[0], norm

    losses = []
    def step(i):
        if no_sync: losses.append(step_without_sync(i)[0])
        else: losses.append(trainer.train_step(i)["loss"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for i in range(spec["warmup"]): step(i)
    sync(); del losses[:]
    gc_off = spec["arm"].endswith("gc-off")
    if gc_off: gc.collect(); gc.disable()
    collections = sum(s["collections"] for s in gc.get_stats())
    t0 = time.perf_counter()
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]): step(i)
    sync(); seconds = time.perf_counter() - t0
    collections = sum(s["collections"] for s in gc.get_stats()) - collections
    if gc_off: gc.enable()
    report(spec, seconds, losses, gc_collections=collections)

def main():
    a = arguments(__doc__, ARMS)
    alternated_rounds(__file__, a, "no-sync", "step_sync_check", describe=lambda res: f", {res['gc_collections']} gc collections")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
