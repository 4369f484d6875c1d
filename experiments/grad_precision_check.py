"""Where the training paths' gradients differ: one rb100m batch (B 32, T 1024, random tokens, the same bf16 weights),
every parameter's gradient from each path against an fp32 reference (the PyTorch ops on fp32 copies of the weights).
Arms: the Triton kernels on B 32 in one pass (the one-process run), the Triton kernels on two micro-batches of 16
(the rows per kernel of a two-rank run), PyTorch's ops in bf16 on B 32. Printed per arm: the loss, the global
gradient norm against the reference's, and the parameters with the largest relative error and norm ratio off 1.
`python experiments/grad_precision_check.py` on a GPU (writes data/results/grad_precision_check.json, a copy in $OUT)."""
import os, shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rtrainer.model import TransformerLm, model_config
from rtrainer.kernels import gradient_fp32, save_results, start_gradient_step
from rtrainer.optimizer import grad_norm_reference

CONFIG, B, T, VOCAB = os.environ.get("GRAD_CONFIG", "rb100m"), int(os.environ.get("GRAD_B", 32)), int(os.environ.get("GRAD_T", 1024)), 50257
DEVICE = os.environ.get("GRAD_DEVICE", "cuda")     # GRAD_DEVICE=cpu TRITON_INTERPRET=1 GRAD_CONFIG=tiny: a smoke test

def gradients(impl, precision, micro, ids, weights):
    "{name: fp32 gradient of the mean loss}, the loss: `micro` micro-batches, summed gradients divided by their number."
    model = TransformerLm(model_config(CONFIG, vocab_size=VOCAB, impl=impl, precision=precision), DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters(): p.copy_(weights[name])
    params = dict(model.named_parameters())
    start_gradient_step(params.values(), release=True)
    losses = []
    for chunk in ids.chunk(micro):
        loss, lm, _ = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward(); losses.append(lm.float().item())
    grads = {n: gradient_fp32(p).clone() / micro for n, p in params.items()}
    del model, params
    if DEVICE == "cuda": torch.cuda.empty_cache()
    return grads, sum(losses) / micro

def main():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T + 1), device=DEVICE)
    init = TransformerLm(model_config(CONFIG, vocab_size=VOCAB, impl="torch", precision="bf16"), DEVICE)
    weights = {n: p.detach().clone() for n, p in init.named_parameters()}   # bf16 matrices, fp32 norms
    del init
    ref, ref_loss = gradients("torch", "fp32", 1, ids, weights)
    ref_norm = grad_norm_reference(list(ref.values())).item()
    print(f"reference (torch ops, fp32): loss {ref_loss:.6f}, gradient norm {ref_norm:.6f}", flush=True)
    rows = []
    for arm, impl, precision, micro in (("triton B32", "triton", "bf16", 1), ("triton 2x16", "triton", "bf16", 2),
                                         ("torch bf16 B32", "torch", "bf16", 1)):
        got, loss = gradients(impl, precision, micro, ids, weights)
        norm = grad_norm_reference(list(got.values())).item()
        per = []
        for n, g in got.items():
            r = ref[n].double(); g = g.double()
            per.append(dict(name=n, rel_error=((g - r).norm() / r.norm()).item(), norm_ratio=(g.norm() / r.norm()).item(),
                            cosine=(torch.dot(g.flatten(), r.flatten()) / (g.norm() * r.norm())).item()))
        rows.append(dict(arm=arm, loss=loss, grad_norm=norm, grad_norm_ratio=norm / ref_norm, params=per))
        print(f"\n{arm}: loss {loss:.6f} (ref {ref_loss:.6f}), gradient norm {norm:.6f} = {norm / ref_norm:.5f} x the reference's", flush=True)
        for p in sorted(per, key=lambda p: -p["rel_error"])[:8]:
            print(f"   {p['name']:32} rel error {p['rel_error']:.2e}  norm ratio {p['norm_ratio']:.5f}  cosine {p['cosine']:.6f}")
        worst = max(per, key=lambda p: abs(p["norm_ratio"] - 1))
        print(f"   norm ratio furthest from 1: {worst['name']} {worst['norm_ratio']:.5f}")
    path = save_results("grad_precision_check", rows, config=CONFIG, batch=B, seq_len=T, vocab_size=VOCAB, reference_loss=ref_loss,
                        reference_grad_norm=ref_norm, method="one batch of random tokens, the same bf16 weights; fp32 torch-ops reference")
    if os.environ.get("OUT"): shutil.copy(path, os.environ["OUT"])
    print("\n=== summary: arm, loss, gradient norm / reference, median and largest per-parameter relative error")
    for r in rows:
        errs = sorted(p["rel_error"] for p in r["params"])
        print(f"{r['arm']:16} {r['loss']:.6f} {r['grad_norm_ratio']:.5f} {errs[len(errs) // 2]:.2e} {errs[-1]:.2e}")

if __name__ == "__main__": main()
