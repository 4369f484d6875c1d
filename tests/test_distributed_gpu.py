"Distributed chapter on GPUs (run with -m cuda): FSDP2 at world size 1 against the plain trainer, 2 GPUs against 1, resharding on NCCL."
import json, sys
from pathlib import Path
import pytest
import torch
from rtrainer.distributed import torchrun_command, worker_environment, export_checkpoint
from rtrainer.training import read_checkpoint
import processes

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

FLAGS = ["tiny", "--data", "synthetic", "--seq-len", "128", "--steps", "10", "--log-every", "1", "--eval-every", "0",
         "--no-progress", "--checkpoint-every", "5"]

def run(cmd, timeout=600):
    done = processes.run(cmd, timeout, env={**worker_environment(), "RTRAINER_DIST_TIMEOUT": "60"})   # its workers end with it
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done

def worker(nproc, flags): return torchrun_command(nproc, ["train", *flags], module="rtrainer.distributed")

def losses(out_dir): return [r["loss"] for r in map(json.loads, open(Path(out_dir) / "metrics.jsonl")) if "loss" in r]

def relative(a, b): return max(abs(x - y) / abs(x) for x, y in zip(a, b))

def test_fsdp_world_size_one_follows_plain_trainer(tmp_path):
    run([sys.executable, "-m", "rtrainer", "train", *FLAGS, "--batch-size", "8", "--out-dir", str(tmp_path / "plain")])
    # FSDP2 gets the Triton kernels' weight gradients through autograd in bf16; DDP writes them in fp32, as the plain trainer
    for dp, tolerance in (("fsdp", 2e-2), ("ddp", 1e-4)):
        run(worker(1, FLAGS + ["--batch-size", "8", "--dp", dp, "--out-dir", str(tmp_path / dp)]))
        err = relative(losses(tmp_path / "plain"), losses(tmp_path / dp))
        print(f"{dp} at world size 1 vs plain trainer (bf16): largest relative loss difference {err:.2e}")
        assert err < tolerance

@two_gpus
def test_two_gpus_follow_one_and_reshard(tmp_path):
    run(worker(1, FLAGS + ["--batch-size", "8", "--out-dir", str(tmp_path / "one")]))
    run(worker(2, FLAGS + ["--batch-size", "4", "--out-dir", str(tmp_path / "two")]))
    err = relative(losses(tmp_path / "one"), losses(tmp_path / "two"))
    print(f"2 GPUs at B=4 vs 1 at B=8 (bf16, NCCL): largest relative loss difference {err:.2e}")
    assert err < 1e-2
    flags = [f if f != "10" else "5" for f in FLAGS]       # --steps 5: load step 5 and save it again, no step taken
    run(worker(1, flags + ["--batch-size", "8", "--resume", str(tmp_path / "two/checkpoints/step-00000005.json"), "--out-dir", str(tmp_path / "re")]))
    a, _ = read_checkpoint(export_checkpoint(tmp_path / "two/checkpoints/step-00000005.json", tmp_path / "a.safetensors"))
    b, _ = read_checkpoint(export_checkpoint(tmp_path / "re/checkpoints/step-00000005.json", tmp_path / "b.safetensors"))
    keys = [k for k in a if k.startswith(("model.", "optim."))]
    assert keys and all(torch.equal(a[k], b[k]) for k in keys)

@two_gpus
def test_ddp_on_two_gpus_follows_one(tmp_path):
    "DDP on NCCL, its blocks' all-reduces started in the backward: 2 GPUs at B=4 follow 1 at B=8, at 2 micro-batches too."
    run(worker(1, FLAGS + ["--batch-size", "8", "--dp", "ddp", "--out-dir", str(tmp_path / "one")]))
    run(worker(2, FLAGS + ["--batch-size", "2", "--accumulation", "2", "--dp", "ddp", "--out-dir", str(tmp_path / "two")]))
    err = relative(losses(tmp_path / "one"), losses(tmp_path / "two"))
    print(f"DDP, 2 GPUs x 2 micro-batches of 2 vs 1 at B=8 (bf16, NCCL): largest relative loss difference {err:.2e}")
    assert err < 1e-2
