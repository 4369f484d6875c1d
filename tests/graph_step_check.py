"""What capturing rtrainer's whole training step in one CUDA graph would buy on a model whose step is bound by the
host's launches. At rb100m on the H200 (commit fbe2962) the step takes 56.1 ms for 50.7 ms of kernels, about 750
launches: the GPU waits for the host about a tenth of the time even though the loop never waits for the GPU.

An experiment, not the trainer: it changes nothing in the package, and patches what a capture needs in this process.
- The fp32 gradient buffers are kept from step to step (`start_gradient_step(release=False)`), and autograd's `.grad`
  tensors too, zeroed in place, so every gradient sits at the same address in each step. The fused optimizer's
  address tables are then built before the capture and found in their cache during it; a table built during the
  capture would copy from a temporary pinned buffer that a replay reads after it is freed, so this script makes
  any such rebuild an error.
- The learning rate, the load-balance weight and AdamW's bias corrections are the capture step's on every replay
  (the kernels take them as launch arguments). The clip coefficient is already computed on the device. Throughput
  does not depend on those numbers; the losses only have to stay finite, and they are printed.
- Each step's batch is copied into the captured inputs before the replay.

Arms, each a fresh process, alternated over ROUNDS rounds, WARMUP steps and then STEPS timed ones; the summary
gives the paired ratio graph/arm with its 95% interval:

  trainer      Trainer.train_step as it is (gradient buffers freed between steps)
  persistent   the step body below, run eagerly, gradients kept at fixed addresses
  graph        the same body captured once in a CUDA graph and replayed

`python tests/graph_step_check.py [--config rb100m] [--rounds 3]` on a GPU; writes $OUT/graph_step_check.json when
OUT is set. `--device cpu --config tiny --arms trainer,persistent` runs the eager arms on a CPU (TRITON_INTERPRET=1)."""
import json, sys, time
import torch
from arm_rounds import arguments, synthetic_trainer, report, alternated_rounds

ARMS = ("trainer", "persistent", "graph")

def child(spec):
    import rtrainer.optimizer as optimizer
    from rtrainer.kernels import start_gradient_step
    from rtrainer.optimizer import clip_scale
    from rtrainer.moe import load_balance_weight
    trainer = synthetic_trainer(spec)
    device = trainer.device
    cuda = device.type == "cuda"
    c, opt, arm = trainer.cfg, trainer.optimizer, spec["arm"]
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    losses, notes = [], {}

    if arm == "trainer":
        def step(i): losses.append(trainer.train_step(i)["loss"])
    else:
        inputs, targets, _ = next(iter(trainer.micro_batches(0)))
        static_inputs, static_targets = inputs.clone(), targets.clone()

        def zero_grad():                                  # gradients stay where they are: same addresses every step
            kept = [(p, p.grad) for p in opt.params if p.grad is not None]
            start_gradient_step(opt.params, release=False)
            for p, g in kept: p.grad = g.zero_()

        def body(i):
            zero_grad()
            lm, lb = trainer.forward_backward(static_inputs, static_targets, None,
                                              load_balance_weight(i, c.load_balance_weight, c.load_balance_decay_steps))
            norm = opt.grad_norm()
            opt.step(trainer.lr_at(i), grad_scale=clip_scale(norm, c.clip, 1.0, also_finite=[lm]))
            return lm.detach().float(), norm

        def load_batch(i):
            x, y, _ = next(iter(trainer.micro_batches(i)))
            static_inputs.copy_(x, non_blocking=True); static_targets.copy_(y, non_blocking=True)

        for i in range(2): load_batch(i); body(i)         # eager: compiles the kernels, settles the gradient buffers
        sync()
        if arm == "persistent":
            def step(i): load_batch(i); losses.append(body(i)[0])
        else:
            if not cuda: sys.exit("graph_step_check: the graph arm needs a CUDA device")
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):                 # the warm-up PyTorch asks for before a capture
                for i in range(2, 4): load_batch(i); body(i)
            torch.cuda.current_stream(device).wait_stream(side)
            sync()
            builds = dict(optimizer.TABLE_BUILDS)
            real_to_device = optimizer._to_device
            def refuse(*a, **k): raise RuntimeError("an optimizer table was rebuilt during the capture (a gradient moved)")
            optimizer._to_device = refuse
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    static_loss, static_norm = body(4)
            finally: optimizer._to_device = real_to_device
            notes["table_builds_during_capture"] = {k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds}
            def step(i):
                load_batch(i); graph.replay()
                losses.append(static_loss.clone())
    for i in range(5, 5 + spec["warmup"]): step(i)
    sync(); del losses[:]
    builds = dict(optimizer.TABLE_BUILDS)
    t0 = time.perf_counter()
    for i in range(5 + spec["warmup"], 5 + spec["warmup"] + spec["steps"]): step(i)
    sync(); seconds = time.perf_counter() - t0
    report(spec, seconds, losses, peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           table_builds_timed={k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds}, **notes)

def main():
    a = arguments(__doc__, ARMS, steps=8)
    alternated_rounds(__file__, a, "graph", "graph_step_check",
                      describe=lambda res: f", losses {[round(v, 3) for v in res['losses']]}")

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
