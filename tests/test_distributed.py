"""The distributed trainer on CPU with gloo: 2 ranks at B/2 against 1 at B, resharding checkpoints, a killed rank.

Every multi-process run goes through torchrun (`python -m torch.distributed.run --standalone`) with a timeout."""
import json, sys, time
from pathlib import Path
import pytest
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
import torch
from safetensors.torch import load_file
from rtrainer.distributed import torchrun_command, worker_environment, strip_nproc, export_checkpoint
from rtrainer.training import read_checkpoint
import processes

STEPS = 20
COMMON = ["tiny", "--data", "synthetic", "--vocab-size", "512", "--seq-len", "32", "--steps", str(STEPS), "--log-every", "1",
          "--eval-every", "0", "--lr", "1e-2", "--warmup", "2", "--device", "cpu", "--no-progress", "--checkpoint-every", "10"]
ENV = {"RTRAINER_DIST_TIMEOUT": "20", "OMP_NUM_THREADS": "1"}
INTERPRET, KERNEL_STEPS = {"TRITON_INTERPRET": "1"}, 3

def start(nproc, flags, env=None):
    "`python -m rtrainer.distributed train FLAGS` on nproc gloo ranks, in a process group of its own (see processes.py)."
    cmd = torchrun_command(nproc, ["train", *flags], module="rtrainer.distributed")
    return processes.start(cmd, env={**worker_environment(), **ENV, **(env or {})})

def finish(proc, timeout=240): return processes.finish(proc, timeout)

def finish_all(procs, what="run"):
    "Finish every started run, then fail on the first that failed; none is left running when one fails or times out."
    try:
        results = {name: finish(p) for name, p in procs.items()}
    finally:
        for p in procs.values(): processes.end_tree(p, grace_s=1)   # only those still running: after a failure
    for name, (rc, out) in results.items(): assert rc == 0, f"{name} {what} failed:\n{out[-3000:]}"
    return results

def metrics(out_dir): return [r for r in map(json.loads, open(Path(out_dir) / "metrics.jsonl")) if "loss" in r]

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 rank at batch 8 (FSDP2), 2 ranks at batch 4 (FSDP2) and at 2 micro-batches of 2 (DDP), 20 steps each, started
    together; and on the Triton kernels (interpreter), 1 rank (DDP) against 2 under DDP, whose weight gradients land in
    main_grad, and under FSDP2, where they come back through autograd."""
    root = tmp_path_factory.mktemp("dist")
    kernels = ["--dp", "ddp", "--impl", "triton", "--steps", str(KERNEL_STEPS)]     # a later --steps wins
    procs = {"one": start(1, COMMON + ["--batch-size", "8", "--out-dir", str(root / "one")]),
             "two": start(2, COMMON + ["--batch-size", "4", "--out-dir", str(root / "two")]),
             "ddp": start(2, COMMON + ["--batch-size", "2", "--accumulation", "2", "--dp", "ddp", "--out-dir", str(root / "ddp")]),
             "kernels-one": start(1, COMMON + kernels + ["--batch-size", "8", "--out-dir", str(root / "kernels-one")], INTERPRET),
             "kernels-ddp": start(2, COMMON + kernels + ["--batch-size", "2", "--accumulation", "2", "--out-dir", str(root / "kernels-ddp")],
                                  INTERPRET),
             "kernels-fsdp": start(2, COMMON + kernels + ["--dp", "fsdp", "--batch-size", "4", "--out-dir", str(root / "kernels-fsdp")],
                                   INTERPRET)}
    finish_all(procs)
    return root

def compare(a, b, what):
    loss = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    norm = max(abs(x["grad_norm"] - y["grad_norm"]) / abs(x["grad_norm"]) for x, y in zip(a, b))
    print(f"{what}: {len(a)} steps, largest relative difference: loss {loss:.2e}, gradient norm {norm:.2e}")
    return loss, norm

def test_two_ranks_follow_one_process(runs):
    one, two = metrics(runs / "one"), metrics(runs / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    loss, norm = compare(one, two, "FSDP2, 2 ranks at B=4 vs 1 at B=8")
    assert loss < 1e-5 and norm < 1e-3            # fp32, a different summation order; Adam amplifies it slowly

def test_ddp_follows_one_process(runs):
    loss, norm = compare(metrics(runs / "one"), metrics(runs / "ddp"), "DDP, 2 ranks x 2 micro-batches of 2 vs 1 at B=8")
    assert loss < 1e-5 and norm < 1e-3

@pytest.mark.parametrize("engine, what", [
    ("ddp", "DDP on the Triton kernels, 2 ranks x 2 micro-batches of 2 vs 1 at B=8"),     # main_grad, reduced by rtrainer's all-reduce
    ("fsdp", "FSDP2 on the Triton kernels, 2 ranks at B=4 vs 1 at B=8")])                # gradients through autograd, FSDP2's reduce-scatter
def test_the_triton_kernels_follow_one_process(runs, engine, what):
    "The weight-gradient kernels under each engine: their gradients must cross the ranks, or the runs drift apart."
    one, two = metrics(runs / "kernels-one"), metrics(runs / f"kernels-{engine}")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, KERNEL_STEPS + 1))
    loss, norm = compare(one, two, what)
    assert loss < 1e-5 and norm < 1e-3

@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_autograd_weight_grads_equal_the_main_grad_buffers(preset):
    """`use_autograd_weight_grads`: the Triton linear, embedding and fused classifier, and the MoE layer's experts and
    shared expert, return through `.grad` the weight gradients they otherwise write into `main_grad`, and write no buffer."""
    from rtrainer.distributed import use_autograd_weight_grads
    from rtrainer.kernels import gradient_fp32, KERNELS_CAN_RUN
    from rtrainer.model import TransformerLm, model_config
    if not KERNELS_CAN_RUN: pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    cfg = model_config(preset, vocab_size=512, n_layers=2, impl="triton")
    models = []
    for swap in (False, True):
        torch.manual_seed(0)
        m = TransformerLm(cfg)
        if swap: use_autograd_weight_grads(m)
        ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
        m(ids[:, :-1], ids[:, 1:])[0].backward()
        models.append(m)
    kinds = set()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        if getattr(a, "main_grad_written", False):
            kinds.add(name.split(".")[-1])
            assert b.grad is not None and not getattr(b, "main_grad_written", False), name
        torch.testing.assert_close(b.grad.float(), gradient_fp32(a), rtol=1e-5, atol=1e-6, msg=name)
    assert {"embedding", "lm_head", "qkv"} <= kinds, kinds
    if preset == "tiny_moe": assert {"experts_gate_up", "experts_down", "shared_gate_up"} <= kinds, kinds

def test_only_rank_zero_writes(runs):
    lines = (runs / "two" / "metrics.jsonl").read_text().splitlines()
    assert len([l for l in lines if '"loss"' in l]) == STEPS      # one row per step, not one per rank
    assert (runs / "two" / "loss_curve.png").exists()

def test_checkpoint_metadata_matches_single_process(runs):
    meta = json.loads((runs / "two" / "checkpoints" / "step-00000020.json").read_text())
    assert meta["format"] == "rtrainer-checkpoint-2" and meta["step"] == 20 and meta["world_size"] == 2
    assert meta["optimizer"]["step_count"] == 20 and meta["model_config"]["vocab_size"] == 512
    folder = runs / "two" / "checkpoints" / "step-00000020"
    assert (folder / "index.json").exists() and not (folder / ".metadata").exists()   # DCP's index as JSON, no pickle
    assert set(meta["checksums"]["files"]) == {p.name for p in folder.iterdir()}

@pytest.fixture(scope="module")
def reloaded(runs):
    "The step-10 checkpoints loaded at the other world size and saved again without a step (2 -> 1 and 1 -> 2)."
    procs = {}
    for src, nproc, batch in (("two", 1, "8"), ("one", 2, "4")):
        flags = COMMON[:COMMON.index("--steps")] + ["--steps", "10"] + COMMON[COMMON.index("--steps") + 2:]
        procs[src] = start(nproc, flags + ["--batch-size", batch, "--resume", str(runs / src / "checkpoints" / "step-00000010.json"),
                                           "--out-dir", str(runs / f"{src}-reloaded")])
    for name, (rc, out) in finish_all(procs, "reload").items(): assert "saved on" in out, name
    return runs

@pytest.mark.parametrize("src,label", [("two", "2 ranks -> 1"), ("one", "1 rank -> 2")])
def test_checkpoint_reshards(reloaded, src, label):
    saved = reloaded / src / "checkpoints" / "step-00000010.json"
    again = reloaded / f"{src}-reloaded" / "checkpoints" / "step-00000010.json"
    a = export_checkpoint(saved, reloaded / f"{src}-saved.safetensors")
    b = export_checkpoint(again, reloaded / f"{src}-again.safetensors")
    ta, ma = read_checkpoint(a); tb, mb = read_checkpoint(b)
    assert ma["world_size"] != mb["world_size"]
    keys = [k for k in ta if k.startswith(("model.", "optim."))]
    assert len([k for k in keys if k.startswith("model.")]) == 15 and len(keys) == 45   # 2 blocks x 6 + 3, each with 2 moments
    assert set(keys) <= set(tb)
    differ = [k for k in keys if not torch.equal(ta[k], tb[k])]
    print(f"{label}: {len(keys)} tensors compared, {len(differ)} differ")
    assert not differ
    assert mb["optimizer"]["step_count"] == 10 and mb["step"] == 10

def test_export_loads_like_a_single_process_checkpoint(runs, tmp_path):
    from rtrainer.training import load_model
    out = export_checkpoint(runs / "two" / "checkpoints", tmp_path / "final.safetensors")   # the run folder: newest checkpoint
    model, meta = load_model(out, device="cpu")
    assert meta["step"] == 20
    raw = load_file(str(out))
    assert torch.equal(model.lm_head, raw["model.lm_head"])

def test_killed_rank_ends_the_run_with_an_error(tmp_path):
    t0 = time.perf_counter()
    p = start(2, COMMON + ["--batch-size", "4", "--out-dir", str(tmp_path / "killed")],
              env={"RTRAINER_TEST_KILL_RANK": "1", "RTRAINER_TEST_KILL_STEP": "3"})
    rc, out = finish(p, timeout=120)
    elapsed = time.perf_counter() - t0
    print(f"killed rank 1 at step 3: torchrun exited with {rc} after {elapsed:.0f} s")
    assert rc != 0 and "exitcode  : -9" in out, out[-3000:]     # torchrun's report names the killed worker
    assert elapsed < 100

def test_launch_command():
    cmd = torchrun_command(4, ["train", "dense1b", "--nproc", "4", "--steps", "5", "--nproc=4"])
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]
    assert cmd[7:] == ["rtrainer", "train", "dense1b", "--steps", "5"]
    assert strip_nproc(["--nproc", "2"]) == []
    env = worker_environment({"PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    with pytest.raises(ValueError): torchrun_command(0, [])

def test_ddp_starts_each_blocks_all_reduce_in_the_backward(tmp_path):
    """DDP: on a step's last micro-batch a hook starts each block's all-reduce in the backward, last block first, and
    on the other micro-batches none; nothing is left in flight after the step, whose gradient is the one process's."""
    import torch.distributed as dist
    from rtrainer.distributed import DistributedTrainer
    from rtrainer.model import model_config
    from rtrainer.training import TrainConfig, Trainer, resolved
    cfg = TrainConfig(data="synthetic", steps=2, batch_size=2, seq_len=16, accumulation=2, eval_every=0, progress=False,
                      device="cpu", out_dir=str(tmp_path), checkpoints=False)
    plain = Trainer(cfg, model_config("tiny", vocab_size=512), log=lambda *a: None)
    expected = resolved(plain.train_step(0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = DistributedTrainer(cfg, model_config("tiny", vocab_size=512), dp="ddp", log=lambda *a: None)
        started, start = [], t.start_block_reduction
        t.start_block_reduction = lambda block: (started.append((t.sync_gradients, list(t.model.blocks).index(block))), start(block))
        row = resolved(t.train_step(0))
    finally: dist.destroy_process_group()
    n = len(t.model.blocks)
    assert started == [(True, i) for i in reversed(range(n))], started
    assert t.in_flight == {}
    assert abs(row["loss"] - expected["loss"]) <= 1e-6 * expected["loss"], (row, expected)
    assert abs(row["grad_norm"] - expected["grad_norm"]) <= 1e-5 * expected["grad_norm"], (row, expected)

def test_the_distributed_trainer_takes_eager_steps(tmp_path):
    "No flag: eager steps under DDP and FSDP2 (the CUDA graph refuses a trainer that talks to other ranks); --cuda-graph: refused."
    import torch.distributed as dist
    from rtrainer.distributed import DistributedTrainer
    from rtrainer.model import model_config
    from rtrainer.training import TrainConfig
    cfg = lambda graph: TrainConfig(data="synthetic", steps=1, batch_size=2, seq_len=16, eval_every=0, progress=False, device="cpu",
                                    out_dir=str(tmp_path), checkpoints=False, cuda_graph=graph)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dp in ("ddp", "fsdp"):
            assert DistributedTrainer(cfg("auto"), model_config("tiny", vocab_size=512), dp=dp, log=lambda *a: None).captured is None
        with pytest.raises(ValueError, match="runs in one process"):
            DistributedTrainer(cfg("on"), model_config("tiny", vocab_size=512), dp="ddp", log=lambda *a: None)
    finally: dist.destroy_process_group()

def test_a_timed_out_run_leaves_no_rank_behind(tmp_path):
    "A run past its time limit is ended with every rank it started (torchrun starts each rank in a session of its own)."
    p = start(2, COMMON + ["--steps", "100000", "--batch-size", "4", "--out-dir", str(tmp_path / "long")])
    deadline = time.time() + 60
    while time.time() < deadline and len(ranks_below(p.pid)) < 2: time.sleep(0.5)   # both ranks started
    ranks = ranks_below(p.pid)
    assert len(ranks) == 2, ranks
    t0 = time.perf_counter()
    with pytest.raises(AssertionError, match="did not finish"): finish(p, timeout=1)
    waited = time.perf_counter() - t0    # killing the launcher alone, the test waited on the ranks' output until they ended
    time.sleep(1)
    alive = [pid for pid in ranks if processes.running(pid)]
    assert not alive and waited < 20, f"ranks still running after their run timed out: {alive}; waited {waited:.0f} s"

def ranks_below(pid):
    "Pids of the rank processes (python -m rtrainer.distributed ...) that torchrun `pid` started."
    return [c for c in processes.descendants(pid) if b"rtrainer.distributed" in open(f"/proc/{c}/cmdline", "rb").read()
            and b"torch.distributed.run" not in open(f"/proc/{c}/cmdline", "rb").read()]

class Payload:
    "A pickle that, when loaded, creates the file `marker` (what a crafted checkpoint could do with any command)."
    def __init__(self, marker): self.marker = str(marker)
    def __reduce__(self): return (open, (self.marker, "w"))

def test_no_code_runs_from_a_checkpoint(runs, tmp_path, capsys):
    """A pickle payload planted where DCP keeps its index (`.metadata`), in a DCP data file, or in place of a safetensors
    checkpoint runs on no path that reads a checkpoint: train --resume / --init-from under --dp and --nproc, without them,
    eval, generate and export."""
    import pickle, shutil
    import torch.distributed as dist
    from rtrainer.cli import main
    from rtrainer.distributed import DistributedTrainer
    from rtrainer.model import model_config
    from rtrainer.training import TrainConfig
    marker = tmp_path / "MARKER"
    def plant(path): path.write_bytes(pickle.dumps(Payload(marker)))
    checkpoints = tmp_path / "run" / "checkpoints"; checkpoints.mkdir(parents=True)
    shutil.copytree(runs / "two" / "checkpoints" / "step-00000020", checkpoints / "step-00000020")
    shutil.copy(runs / "two" / "checkpoints" / "step-00000020.json", checkpoints)
    plant(checkpoints / "step-00000020" / ".metadata")

    exported = export_checkpoint(checkpoints, tmp_path / "exported.safetensors")
    assert not marker.exists() and read_checkpoint(exported)[1]["step"] == 20
    config = lambda **kw: TrainConfig(**{**dict(data="synthetic", steps=20, batch_size=8, seq_len=32, lr=1e-2, warmup=2, eval_every=0,
                                                progress=False, device="cpu", out_dir=str(tmp_path / "in-process")), **kw})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for dp, kw in (("ddp", dict(resume=str(checkpoints))), ("fsdp", dict(init_from=str(checkpoints), init_moments=True))):
            t = DistributedTrainer(config(**kw), model_config("tiny", vocab_size=512), dp=dp, log=lambda *a: None)
            assert t.optimizer.step_count == 20 and not marker.exists(), dp
    finally: dist.destroy_process_group()

    done = processes.run([sys.executable, "-m", "rtrainer", "train", *COMMON[:COMMON.index("--steps")], "--steps", "21",
                          *COMMON[COMMON.index("--steps") + 2:], "--batch-size", "4", "--nproc", "2", "--resume", str(checkpoints)],
                         300, env={**worker_environment(), **ENV})   # its ranks end with it
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert not marker.exists() and json.loads((checkpoints / "step-00000021.json").read_text())["step"] == 21

    fake = tmp_path / "fake" / "step-00000030.safetensors"; fake.parent.mkdir()   # a pickle where a safetensors file should be
    plant(fake)
    for argv in (["train", "--data", "synthetic", "--resume", fake, "--out-dir", tmp_path / "a"],
                 ["train", "--data", "synthetic", "--init-from", fake, "--out-dir", tmp_path / "b"],
                 ["train", "--data", "synthetic", "--init-from", fake, "--dp", "ddp", "--out-dir", tmp_path / "c"],
                 ["eval", "--checkpoint", fake.parent, "--data", tmp_path], ["generate", "--checkpoint", fake, "--prompt", "x"]):
        assert main([str(a) for a in argv] + ["--device", "cpu"] + (["--no-progress"] if argv[0] == "train" else [])) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a readable safetensors checkpoint" in err[0], err
        assert not marker.exists(), argv
    data_file = checkpoints / "step-00000020" / "__0_0.distcp"                  # a DCP data file swapped for a payload
    plant(data_file)
    with pytest.raises(ValueError, match="__0_0.distcp: does not match its CRC-32"): export_checkpoint(checkpoints / "step-00000020.json", tmp_path / "x.safetensors")
    assert not marker.exists() and not (tmp_path / "x.safetensors").exists()
