#!/usr/bin/env bash
# Repeats the distributed chapter's CPU DDP run (2 gloo ranks, tiny, 12 steps) to catch a rare abort of one rank at exit.
# Usage: bash experiments/dist_teardown_stress.sh RUNS [PARALLEL]   (from the repository root; .venv installed)
# DP=fsdp runs the FSDP engine instead of DDP; CHECKPOINTS=1 lets each run write its checkpoint.
# Each run goes in its own temporary folder (torchrun's own temporary files too) with core dumps on; a failed run's log
# (and core, if one was written) is kept under ${KEEP:-/tmp/rtrainer-stress}/. Last line: "N runs, F failed".
# What it found and the fix: experiments/dist_teardown_stress.md.
set -u
runs=${1:?number of runs}; parallel=${2:-2}; dp=${DP:-ddp}; ckpt=$([ "${CHECKPOINTS:-0}" = 1 ] || echo --no-checkpoints)
root=$(cd "$(dirname "$0")/.." && pwd); keep=${KEEP:-/tmp/rtrainer-stress}; mkdir -p "$keep"
loop() {
  local fails=0
  for i in $(seq 1 "$1"); do
    local d; d=$(mktemp -d); cd "$d" || exit 1
    (ulimit -c unlimited; TMPDIR="$d" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 "$root/.venv/bin/python" -m torch.distributed.run --standalone \
      --nproc-per-node 2 -m rtrainer.distributed train tiny --data synthetic --batch-size 2 --seq-len 32 --steps 12 \
      --log-every 1 --eval-every 0 --no-progress $ckpt --device cpu --vocab-size 512 --lr 1e-2 --warmup 2 \
      --dp "$dp" --out-dir "$d/run" > "$d/log" 2>&1) && [ -s "$d/run/metrics.jsonl" ]
    if [ $? -ne 0 ]; then fails=$((fails+1)); mkdir -p "$keep/$2-$i"; cp "$d"/log "$d"/core* "$keep/$2-$i/" 2>/dev/null; fi
    cd / && rm -rf "$d"
  done
  echo "$fails" > "$keep/.fails-$2"
}
per=$(( (runs + parallel - 1) / parallel ))
for p in $(seq 1 "$parallel"); do loop "$per" "$p" & done; wait
failed=0; for f in "$keep"/.fails-*; do failed=$((failed + $(cat "$f"))); done; rm -f "$keep"/.fails-*
echo "$((per * parallel)) runs, $failed failed (logs of failures: $keep)"
