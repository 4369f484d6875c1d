"""Expert parallelism on CPU with gloo: the split MoE layer against one process on 4 ranks and on 2 (the two pairs of
the 4), and `rtrainer train tiny_moe --nproc 2 --ep` against one process at the same global batch.

Every process starts with a timeout and is ended with its test, pass or fail (spawn_ranks, processes.py)."""
import sys
import pytest
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
import torch
from safetensors.torch import load_file
from rtrainer.cli import main as rtrainer_main
from rtrainer.distributed import worker_environment, export_checkpoint
import rtrainer.expert_parallel as expert_parallel
from rtrainer.expert_parallel import check_layer_parity
from rtrainer.kernels import KERNELS_CAN_RUN
from test_distributed import metrics
import processes

COMPARED = ["y", "x", "load_balance_loss", "expert_load", "dropped_fraction", "router", "experts_gate_up", "experts_down",
            "shared_gate_up", "shared_down"]
CASES = [dict(dispatch="capacity", dtype="float64"), dict(dispatch="dropless", dtype="float64"),
         dict(dispatch="capacity", dtype="float32"), dict(dispatch="dropless", dtype="float32"),
         dict(dispatch="capacity", dtype="float64", ranks=2), dict(dispatch="dropless", dtype="float32", ranks=2)]
if KERNELS_CAN_RUN: CASES.append(dict(dispatch="capacity", dtype="float32", impl="triton", ranks=2))   # the grouped GEMMs (interpreter on a CPU)

STEPS = 10
FLAGS = ["tiny_moe", "--data", "synthetic", "--vocab-size", "512", "--seq-len", "32", "--steps", str(STEPS), "--log-every", "1",
         "--eval-every", "0", "--lr", "1e-2", "--warmup", "2", "--device", "cpu", "--no-progress"]

def case_name(case): return f"{case.get('ranks', 4)} ranks {case['dispatch']} {case['dtype']} {case.get('impl', 'torch')}"

@pytest.fixture(scope="module")
def parity(training):
    """Every case on one world of 4 gloo processes (the 2-rank cases on both of its pairs at once), while the training
    runs go on: the two share the machine's cores instead of waiting for each other."""
    return {case_name(r["case"]): r["errors"] for r in check_layer_parity(4, CASES, timeout=300)}

@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_the_split_layer_is_one_process_on_the_concatenated_tokens(parity, case):
    """Outputs, load-balance loss, load, dropped fraction, and the gradients of x, the router, the shared expert and each
    rank's experts, on 7, 11, 5 and 9 tokens with skewed routing; capacity drops part of expert 0's assignments."""
    errors = parity[case_name(case)]
    worst = max(COMPARED, key=errors.get)
    print(f"{case_name(case)}: largest relative error {errors[worst]:.1e} ({worst}), dropped {errors['dropped']:.0%}, load {errors['load']}")
    tolerance = 1e-12 if case["dtype"] == "float64" else 1e-5
    assert errors[worst] < tolerance, errors
    assert (errors["dropped"] > 0.1) == (case["dispatch"] == "capacity")
    assert max(errors["load"]) > 0.4                                            # uneven: 0.25 each if even
    assert errors["per_rank_load_balance_loss"] > 1e-3     # each rank's own-token loss is not the layer's: the test can tell

@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """Start tiny_moe for 10 steps: one process at batch 8, and 2 gloo ranks with --ep at batch 4; yields (folder, processes).
    Whatever is still running when the module's tests are done is ended."""
    root = tmp_path_factory.mktemp("ep")
    env = {**worker_environment(), "RTRAINER_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    procs = {name: processes.start([sys.executable, "-m", "rtrainer", "train", *FLAGS, *extra, "--out-dir", str(root / name)], env=env)
             for name, extra in (("one", ["--batch-size", "8"]), ("ep", ["--batch-size", "4", "--nproc", "2", "--ep"]))}
    try: yield root, procs
    finally:
        for p in procs.values(): processes.end_tree(p, grace_s=1)

@pytest.fixture(scope="module")
def runs(training):
    "The two training runs' folder, once both have finished (each within 300 s)."
    root, procs = training
    results = {name: processes.finish(p, timeout=300) for name, p in procs.items()}
    for name, (rc, out) in results.items(): assert rc == 0, f"{name} failed:\n{out[-3000:]}"
    return root

def test_two_expert_parallel_ranks_follow_one_process(runs):
    one, ep = metrics(runs / "one"), metrics(runs / "ep")
    assert [r["step"] for r in one] == [r["step"] for r in ep] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "load_balance_loss"):
        worst = max(abs(a[key] - b[key]) / abs(a[key]) for a, b in zip(one, ep))
        print(f"{key}: largest relative difference over {STEPS} steps {worst:.1e}")
        assert worst < 1e-5, key
    assert [r["dropped_fraction"] for r in one] == [r["dropped_fraction"] for r in ep]

def test_the_expert_parallel_checkpoint_holds_the_full_experts(runs, tmp_path):
    """The DCP checkpoint of the 2 ranks, exported to one file: every weight and moment (full experts included) is the one
    process's, to 1e-4 of the tensor's largest entry (Adam magnifies a rounding-level difference in a near-zero gradient:
    2 of the embedding's 32,768 entries differed by 2.5e-6, every other entry by less than 5e-7)."""
    one = load_file(next((runs / "one" / "checkpoints").glob("step-*.safetensors")))
    ep = load_file(export_checkpoint(runs / "ep" / "checkpoints", tmp_path / "ep.safetensors"))
    assert set(k for k in one if not k.startswith("rng")) <= set(ep)
    assert ep["model.blocks.1.moe.experts_gate_up"].shape == (4, 64, 192)
    for key, t in one.items():
        if not key.startswith("rng"): torch.testing.assert_close(ep[key], t, rtol=1e-3, atol=1e-4 * t.abs().max().item(), msg=key)

@pytest.mark.parametrize("argv, reason", [
    (["train", "tiny", "--nproc", "2", "--ep"], "this model is dense"),
    (["train", "tiny_moe", "--nproc", "3", "--ep"], "4 experts do not split evenly over 3 ranks"),
    (["train", "tiny_moe", "--nproc", "4", "--n-experts", "6", "--expert-parallel"], "6 experts do not split evenly over 4 ranks"),
    (["train", "tiny_moe", "--nproc", "2", "--ep", "--dp", "fsdp"], "--dp fsdp is not supported")])
def test_expert_parallelism_refuses_in_one_line(argv, reason, capsys, monkeypatch):
    "Before any process starts: a dense model, experts the ranks do not divide, FSDP2 for the dense part."
    def launch(*args): raise AssertionError("launched torchrun instead of refusing")
    monkeypatch.setattr(expert_parallel, "launch_train", launch)
    assert rtrainer_main(argv + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1, err
