#!/usr/bin/env bash
# Warp-stall breakdown and tensor-pipe activity of the kernels experiments/attention_ws_profile.py launches once each
# (the Triton, the Hopper (rtrainer.attention_hopper) and cuDNN's forward, the Triton and the Hopper dQ and dK/dV, cuDNN's
# forward + backward; at dense1b or PROFILE_SHAPE), under Nsight Compute.
# Asks ncu which metrics this GPU has, keeps the wanted ones it lists, writes $OUT/ncu_stalls.csv.
set -u
OUT=${OUT:-/tmp}; PY=${PY:-python3}
ncu --query-metrics --chip gh100 > "$OUT/ncu_metric_list.txt" 2>&1 || ncu --query-metrics > "$OUT/ncu_metric_list.txt" 2>&1
want="smsp__average_warp_latency_issue_stalled_barrier smsp__average_warp_latency_issue_stalled_long_scoreboard
smsp__average_warp_latency_issue_stalled_short_scoreboard smsp__average_warp_latency_issue_stalled_wait
smsp__average_warp_latency_issue_stalled_math_pipe_throttle smsp__average_warp_latency_issue_stalled_mio_throttle
smsp__average_warp_latency_issue_stalled_sleeping smsp__average_warp_latency_issue_stalled_membar
smsp__average_warp_latency_issue_stalled_dispatch_stall smsp__average_warp_latency_issue_stalled_no_instruction
smsp__average_warp_latency_issue_stalled_branch_resolving smsp__average_warp_latency_issue_stalled_selected
smsp__average_warp_latency_issue_stalled_not_selected smsp__average_warp_latency_issue_stalled_misc
smsp__average_warp_latency_issue_stalled_lg_throttle smsp__average_warp_latency_issue_stalled_drain
smsp__pcsamp_warps_issue_stalled_barrier smsp__pcsamp_warps_issue_stalled_long_scoreboard smsp__pcsamp_warps_issue_stalled_wait
smsp__pcsamp_warps_issue_stalled_math_pipe_throttle smsp__pcsamp_warps_issue_stalled_sleeping smsp__pcsamp_warps_issue_stalled_short_scoreboard
smsp__pcsamp_warps_issue_stalled_mio_throttle smsp__pcsamp_warps_issue_stalled_selected smsp__pcsamp_warps_issue_stalled_not_selected
sm__pipe_tensor_op_gmma_cycles_active sm__inst_executed_pipe_tensor_op_gmma sm__pipe_fma_cycles_active sm__pipe_alu_cycles_active
sm__inst_executed_pipe_xu sm__pipe_xu_cycles_active sm__cycles_elapsed sm__cycles_active smsp__inst_executed smsp__issue_active
lts__t_bytes gpu__time_duration"
metrics=""
for m in $want; do
  if grep -q "^$m\b\|^ *$m " "$OUT/ncu_metric_list.txt"; then
    case $m in
      smsp__average_warp_latency*) metrics+="$m.ratio," ;;
      smsp__pcsamp*) metrics+="$m," ;;
      gpu__time_duration|sm__cycles_elapsed) metrics+="$m.max," ;;
      *cycles_active) metrics+="$m.avg.pct_of_peak_sustained_active," ;;
      *) metrics+="$m.sum," ;;
    esac
  fi
done
echo "metrics: ${metrics%,}"
ncu --clock-control none --profile-from-start off --csv --metrics "${metrics%,}" $PY experiments/attention_ws_profile.py > "$OUT/ncu_stalls.csv" 2> "$OUT/ncu_stalls.err"
echo "rc=$?"; tail -3 "$OUT/ncu_stalls.err"
$PY - "$OUT/ncu_stalls.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
k, n, v, i = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value"), head.index("ID")
table = collections.defaultdict(dict)
for r in body: table[f"{r[i]} {r[k][:30]}"][r[n]] = r[v]     # by launch: cuDNN's forward and backward kernels share a prefix
names = sorted({m for t in table.values() for m in t})
for m in names: print(f"{m[:70]:70} " + " ".join(f"{table[kn].get(m, '-'):>14}" for kn in table))
print(" " * 71 + " ".join(f"{kn[:14]:>14}" for kn in table))
PY
