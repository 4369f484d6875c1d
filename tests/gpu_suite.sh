#!/usr/bin/env bash
# The one GPU script: `bash tests/gpu_suite.sh STAGE...` on the GPU machine (stages below, run in the order
# given, each under its own time limit). Logs go to $OUT; the recorded data/results/*.json come back in
# $OUT/results.tgz, the stage logs in $OUT/logs.tgz. Prints a short summary table last.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/rtrainer-gpu}; mkdir -p "$OUT"
# Compile caches in the tree (git-ignored): a call that carries .gpu_cache (device tool: carry [".gpu_cache"]) starts warm;
# stage save-cache packs them into $OUT for the next call.
CACHE=$PWD/.gpu_cache; mkdir -p "$CACHE"
if ls .gpu_cache_parts/gpu_cache.tgz.part-* >/dev/null 2>&1; then cat .gpu_cache_parts/gpu_cache.tgz.part-* | tar xzf - -C "$CACHE"; fi   # carried parts
export TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
LOGS=$(mktemp -d /tmp/rtrainer-logs.XXXX)   # stage logs; they come back as $OUT/logs.tgz (the device returns at most 8 files)
SUMMARY=$LOGS/summary.txt; : > "$SUMMARY"
PY=${PY:-python3}
start_all=$SECONDS

stage() {  # stage NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  grep -v -i "warn\|scaled_dot_product_attention(" "$LOGS/$name.log" | tail -n ${TAIL:-25}
  printf '%-28s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS-t0))" >> "$SUMMARY"
  tar czf "$OUT/results.tgz" data/results 2>/dev/null   # after every stage: a call cut short keeps what it measured
  tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
}
RT="$PY -m rtrainer"

for s in "$@"; do case $s in
  gpu-tests) stage gpu_tests ${TESTS_LIMIT:-590} $PY tests/gpu_tests.py ${TESTS_WORKERS:+--workers $TESTS_WORKERS} ${TESTS_K:+-k "$TESTS_K"} ;;   # every -m cuda test, recorded in data/results/gpu_tests.json (pass or fail)
  save-cache) tar czf - -C "$CACHE" . | split -b 15m - "$OUT/gpu_cache.tgz.part-"; ls -la "$OUT"/gpu_cache.tgz.part-* ;;   # the compile caches in 15 MB parts (the device returns files of 16 MB at most): cat them into tar xz -C .gpu_cache
  env)       stage env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv; $PY -c 'import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'; $PY -m rtrainer doctor" ;;
  parity-*)  f=${s#parity-}; stage "parity_$f" "${PARITY_LIMIT:-150}" $PY -m pytest -m cuda -v -p no:cacheprovider -o addopts="" --timeout 140 --durations=8 "tests/test_${f}_gpu.py" ;;
  train)     stage train ${TRAIN_LIMIT:-300} $PY tests/gpu_train_bench.py --arms rb100m:32:torch,rb100m:32:triton,dense1b:16:torch,dense1b:16:triton --rounds ${ROUNDS:-2} --steps ${STEPS:-12} --name training_throughput ;;
  kernels)   stage bench_kernels 150 $PY -c "from rtrainer.kernels import benchmark_suite; benchmark_suite(quick=True)" ;;
  kernels-full) stage bench_kernels_full ${KERNELS_LIMIT:-200} $PY -c "from rtrainer.kernels import benchmark_suite; benchmark_suite()" ;;
  sweep-arch) stage sweep_arch ${SWEEP_ARCH_LIMIT:-300} $PY -c "from rtrainer.profiling import sweep_arch_suite; sweep_arch_suite()" ;;   # the reference configurations and other shapes at their active parameters: data/results/sweep_arch.json
  sweeps)    stage sweeps ${SWEEPS_LIMIT:-150} $RT sweep rms_norm 'BACKWARD_PREFETCH=1,BACKWARD_PREFETCH=0,BACKWARD_NUM_WARPS=32,BACKWARD_NUM_WARPS=32 BACKWARD_BLOCK_ROWS=2,BACKWARD_BLOCK_ROWS=2,BACKWARD_NUM_WARPS=8,BACKWARD_PROGRAMS_PER_SM=2,BACKWARD_NUM_WARPS=4 BACKWARD_PREFETCH=0 BACKWARD_PROGRAMS_PER_SM=16' --sizes 32768x3072 16384x8192 65536x8192 ;;   # the last variant is the backward of before the occupancy fix
  sweep-*)   k=${s#sweep-}; v=SWEEP_${k^^}; z=SIZES_${k^^}; stage "sweep_$k" ${SWEEPS_LIMIT:-150} $RT sweep "$k" "${!v}" ${!z:+--sizes ${!z}} ;;   # SWEEP_RMS_NORM='NUM_WARPS=4,...' SIZES_RMS_NORM='32768x3072 ...'
  matmul-ce) stage bench_matmul_ce 150 $PY -c "from rtrainer.matmul import benchmark_suite; benchmark_suite(chunk_rows=(2048,), gemm_models=())" ;;
  gemm-all)  stage bench_gemm_all ${GEMM_LIMIT:-240} $PY -c "from rtrainer.matmul import benchmark_suite; benchmark_suite(gemm_models=list(__import__('rtrainer.matmul').matmul.MODEL_SHAPES))" ;;
  profile-graph-*) c=${s#profile-graph-}; stage "profile_graph_$c" 150 $RT profile --config "$c" --cuda-graph ;;   # the CUDA-graph step, 10 steps back to back, at sustained ceilings: data/results/profile_graph_CONFIG.json
  profile-*) c=${s#profile-}; stage "profile_$c" 120 $RT profile --config "$c" ;;
  e2e-*)     c=${s#e2e-}; b=$($PY -c "from rtrainer.model import REFERENCE_BATCH as R; print(R['$c'])"); stage "e2e_$c" ${E2E_LIMIT:-300} $PY tests/gpu_train_bench.py --arms $c:$b:torch,$c:$b:triton --rounds ${ROUNDS:-2} --steps ${STEPS:-10} --name "training_throughput_$c" ;;
  attention-quick) stage bench_attention_quick 90 $PY -c "from rtrainer.attention import benchmark_suite; benchmark_suite(quick=True)" ;;
  attention) stage bench_attention 180 $PY -c "from rtrainer.attention import benchmark_suite; benchmark_suite()" ;;
  matmul)    stage bench_matmul 150 $PY -c "from rtrainer.matmul import benchmark_suite; benchmark_suite(quick=True)" ;;
  moe)       stage bench_moe ${MOE_LIMIT:-300} $PY -c "from rtrainer import moe_hopper; from rtrainer.moe import benchmark_suite; benchmark_suite(rounds=3)" ;;   # with the Hopper GEMM (03a) registered
  optimizer) stage bench_optimizer 90 $PY -c "from rtrainer.optimizer import benchmark_suite; benchmark_suite(quick=True)" ;;
  profile)   stage profile 100 $PY -m rtrainer profile --config prof183m --batch-size 32 ;;
  versus-*)  c=${s#versus-}; stage "versus_$c" "${VERSUS_LIMIT:-220}" $PY -m rtrainer versus --config "$c" --tiers "${TIERS:-default}" --rounds "${ROUNDS:-2}" --steps ${VSTEPS:-4} --warmup ${VWARMUP:-3} --timeout ${ARM_TIMEOUT:-300} ${VGRAPH:+--cuda-graph} ${VBATCH:+--batch-size "$VBATCH"} ${SAVE_AS:+--save-as "$SAVE_AS"} ;;   # VGRAPH=1: also the trainer with --cuda-graph, leading; VBATCH=N: N sequences a step instead of the reference batch; SAVE_AS=NAME: results under that name
  norms)     stage bench_norms 90 $PY -c "from rtrainer.kernels import benchmark_suite; benchmark_suite(kernels=['rms_norm', 'add_rms_norm'], save_as='kernels_norms')" ;;
  dist-curves-*) c=${s#dist-curves-}; stage "dist_curves_$c" ${CURVES_LIMIT:-500} $PY -c "from rtrainer.distributed import loss_curve_suite; loss_curve_suite('$c', engine='${ENGINE:-ddp}', world_size=${WORLD:-2}, steps=${CURVE_STEPS:-200}, extra='--lr 6e-4 --warmup 20 ${CURVE_EXTRA:---vocab-size 50257}')" ;;   # one process against WORLD ranks, same run, on the python-docs shard: data/results/dist_curves_CONFIG_ENGINE.json
  scaling-*) c=${s#scaling-}; stage "scaling_$c" ${SCALING_LIMIT:-560} $PY -c "from rtrainer.distributed import scaling_suite; scaling_suite('$c', engine='${ENGINE:-fsdp}', steps=${STEPS:-12}, rounds=${ROUNDS:-2})" ;;   # weak scaling over every GPU of the machine: data/results/scaling_CONFIG_ENGINE.json
  fsdp)      stage fsdp ${FSDP_LIMIT:-300} $PY -c "from rtrainer.distributed import benchmark_suite; print(benchmark_suite(steps=${STEPS:-12}, rounds=${ROUNDS:-3}, impl='${IMPL:-triton}'))" ;;
  curves-*)  c=${s#curves-}; b=$($PY -c "from rtrainer.model import REFERENCE_BATCH as R; print(R['$c'])"); stage "loss_curves_$c" ${CURVES_LIMIT:-300} $PY tests/gpu_train_bench.py --arms $c:$b:torch,$c:$b:triton --rounds 1 --steps ${CURVE_STEPS:-200} --data data/python-docs --name "loss_curves_$c" --extra "--lr 6e-4 --warmup 20 ${CURVE_EXTRA:---vocab-size 50257}" ;;   # the python-docs shard is r50k: rb100m needs the wider vocabulary
  forward-variants)   stage forward_variants 150 $PY experiments/forward_variants.py ;;       # why four forwards trailed compile: writes $OUT/forward_variants.json
  attention-variants) stage attention_variants 360 $PY experiments/attention_variants.py ;;   # flash-attention forward variants vs cuDNN: $OUT/attention_variants.json
  moe-gluon-gemm) stage moe_gluon_gemm ${GLUON_GEMM_LIMIT:-300} $PY experiments/moe_gluon_gemm.py ;;   # a warp-specialized Gluon grouped GEMM (and its SwiGLU epilogue) vs cuBLAS at the moe4b capacity shapes: $OUT/moe_gluon_gemm.json
  moe-gemm-variants) stage moe_gemm_variants ${GEMMV_LIMIT:-240} $PY experiments/moe_gemm_variants.py ;;   # TMA / persistent Triton GEMMs and a SwiGLU epilogue vs cuBLAS at the moe4b expert shapes: $OUT/moe_gemm_variants.json
  graph-step) stage graph_step ${GRAPH_LIMIT:-420} $PY experiments/graph_step_check.py --config ${GRAPH_CONFIG:-rb100m} --rounds ${ROUNDS:-3} ;;   # the whole step captured in a CUDA graph vs eager, at a host-bound model: $OUT/graph_step_check.json
  graph-profile) stage graph_profile ${GPROF_LIMIT:-300} $PY experiments/graph_step_profile.py --configs ${GPROF_CONFIGS:-rb100m,prof183m,dense1b,moe4b} ;;   # the CUDA-graph step's kernels by family, its device idle time and its floor, per config: $OUT/graph_step_profile.json
  step-sync) stage step_sync ${SYNC_LIMIT:-400} $PY experiments/step_sync_check.py --config ${SYNC_CONFIG:-rb100m} --rounds ${ROUNDS:-3} ;;   # the trainer's per-step host sync and Python's gc, at a host-bound model: $OUT/step_sync_check.json
  moe-profile) stage moe_profile 150 $PY experiments/moe_profile.py ;;   # a MoE layer step's kernels, GEMMs and the rest: $OUT/moe_profile.json
  zero-rows-power) stage zero_rows_power 120 $PY experiments/zero_rows_power.py ;;   # the moe4b gate_up product with part of each group zero (capacity's empty slots): time, power, clock: $OUT/zero_rows_power.json
  moe-energy) stage moe_energy ${ENERGY_LIMIT:-300} $PY experiments/moe_energy.py ;;   # the moe4b layer step and its expert GEMMs back to back under NVML's energy counter, and the layer by median_ms: $OUT/moe_energy.json
  moe-overlap) stage moe_overlap 150 $PY experiments/moe_overlap.py ;;   # a copy on spare SMs under the power-bound gate_up GEMM, against the two in sequence: $OUT/moe_overlap.json
  moe-layer-variants) stage moe_layer_variants ${LAYERV_LIMIT:-260} $PY experiments/moe_layer_variants.py ;;   # the moe4b layer under tile configs of 03a's Gluon GEMM vs torch.compile: $OUT/moe_layer_variants.json
  attention-gluon) stage attention_gluon ${GLUON_LIMIT:-300} $PY experiments/attention_gluon.py ;;   # Gluon forward, dQ and dK/dV with hand-placed wgmma waits, checked, then timed vs rtrainer (and cuDNN): $OUT/attention_gluon.json
  grad-release) stage grad_release ${RELEASE_LIMIT:-300} $PY experiments/grad_release_check.py ;;   # free vs keep the fp32 gradient buffers between steps, and expandable segments: $OUT/grad_release_check.json
  attention-long-forward) stage attention_long_forward 150 $PY experiments/attention_long_forward.py ;;   # the two forward tiles at T 2048-8192, paired, timed as the benchmark does: $OUT/attention_long_forward.json
  attention-configs) stage attention_configs ${CONFIGS_LIMIT:-300} $PY experiments/attention_configs.py ;;   # block-size / warps / stages / register-cap sweep of the three kernels: $OUT/attention_configs.json
  attention-ws) stage attention_ws ${WS_LIMIT:-420} $PY experiments/attention_ws.py ;;   # warp-specialized Gluon forward, dQ and dK/dV (a loader warp, two consumer warpgroups), checked, then timed vs rtrainer and cuDNN: $OUT/attention_ws.json
  tma-reduce) stage tma_reduce 120 $PY experiments/tma_reduce.py ;;   # a TMA reduce-add from Gluon, checked against float64 (experiments/tma_reduce.md)
  attention-dq-fused) stage attention_dq_fused ${FUSED_LIMIT:-420} $PY experiments/attention_dq_fused.py ;;   # head-dim-64 dK/dV that also reduce-adds dQ, checked against float64, timed vs the two-kernel backward and cuDNN: $OUT/attention_dq_fused.json
  attention-ws-profile) stage attention_ws_profile ${NCU_LIMIT:-300} bash -c "ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats $PY experiments/attention_ws_profile.py > $OUT/ncu_attention.txt 2>&1; tail -5 $OUT/ncu_attention.txt" ;;   # Nsight Compute sections of the Triton, the Hopper (02a) and cuDNN's forward, dQ and dK/dV, and cuDNN's backward, at dense1b or PROFILE_SHAPE: $OUT/ncu_attention.txt
  attention-ws-stalls) stage attention_ws_stalls ${NCU_LIMIT:-300} bash experiments/ncu_stalls.sh ;;   # warp-stall breakdown and tensor-pipe activity of the same kernels, at dense1b or PROFILE_SHAPE (T8192, say): $OUT/ncu_stalls.csv
  attention-hopper) stage attention_hopper ${HOPPER_LIMIT:-200} $PY experiments/attention_hopper_bench.py ;;   # forward + backward through the package, Hopper kernels on and off, against cuDNN: data/results/attention_hopper.json
  attention-ds) stage attention_ds ${DS_LIMIT:-300} $PY experiments/attention_ds_variants.py ;;   # dQ from a stored dS against the recomputing backward, and both against cuDNN: data/results/attention_ds_variants.json
  attention-math) stage attention_math ${MATH_LIMIT:-480} $PY experiments/attention_math_variants.py ;;   # instruction-count forward and atomic-dQ backward variants: $OUT/attention_math_variants.json
  optimizer-full) stage bench_optimizer_full ${OPT_LIMIT:-150} $PY -c "from rtrainer.optimizer import benchmark_suite; benchmark_suite()" ;;
  act-ckpt)  stage act_ckpt ${ACT_LIMIT:-560} $PY tests/gpu_train_bench.py --arms dense1b:16:triton:none,dense1b:16:triton:selective,dense1b:16:triton:full,dense1b:32:triton:full --rounds ${ROUNDS:-1} --steps ${STEPS:-10} --name activation_checkpointing ;;   # --activation-checkpointing none/selective/full at the reference batch, and full at twice it: tokens/s and peak memory, data/results/activation_checkpointing.json
  act-ckpt-3b) stage act_ckpt_3b ${ACT_LIMIT:-300} $PY tests/gpu_train_bench.py --arms dense1b:16:triton:none,dense1b:16:triton:full,dense1b:64:triton:full --rounds 1 --steps ${STEPS:-6} --name activation_checkpointing_3b --extra "--d-model 3072 --n-heads 24 --n-kv-heads 24 --head-dim 128 --d-ff 8192" ;;   # dense1b widened to 3.03B parameters: none and full at B16, full at B64: data/results/activation_checkpointing_3b.json
  small-batch) for T in 512 1024; do stage "small_batch_t$T" ${SMALL_LIMIT:-290} $RT versus --config rb100m --batches 1,2,4 --seq-len $T --tiers eager,default,reduce-overhead --cuda-graph --keep-arms --rounds ${ROUNDS:-3} --steps 20 --warmup 5 --timeout 240 --save-as "versus_rb100m_small_t$T"; done ;;   # rb100m from 1x512 to 4x1024: data/results/versus_rb100m_small_t{512,1024}.json; --keep-arms: each arm compiles once per batch size, all at once
  ce-variants) stage ce_variants ${CE_LIMIT:-240} $PY experiments/cross_entropy_variants.py ;;   # the cross-entropy kernel against persistent, L2-hinted and one-read variants at the rb100m and prof183m chunks, checked against float64: $OUT/cross_entropy_variants.json
  logits-ab-*) c=${s#logits-ab-}; stage "logits_ab_$c" ${LOGITS_AB_LIMIT:-300} $PY experiments/logits_path_ab.py --config $c --rounds ${AB_ROUNDS:-3} ${VBATCH:+--batch-size $VBATCH} ;;   # the default trainer's step with the Hopper logits path (partials) and without (cuBLAS), alternated processes: $OUT/logits_path_ab.json
  ce-lse) stage ce_lse ${CE_LSE_LIMIT:-240} $PY experiments/ce_lse_epilogue.py ;;   # the logits GEMM (03a's Gluon GEMM) writing each row's max and sum of exponentials per column tile, then a 2-pass cross-entropy, against cuBLAS + the 3-pass kernel, checked against float64: $OUT/ce_lse_epilogue.json
  attention-host) stage attention_host ${HOST_LIMIT:-200} $PY experiments/attention_host_cost.py ;;   # host microseconds of an attention step and of its parts (launches, descriptors, a cProfile): $OUT/attention_host_cost.json
  attention-host-ab) stage attention_host_ab ${HOST_AB_LIMIT:-240} $PY experiments/attention_host_ab.py ${AB_BEFORE:-.gpu_out/ab_before} . --rounds ${AB_ROUNDS:-4} ;;   # host us a step, the tree AB_BEFORE (an rtrainer/ carried under .gpu_out) against this one, alternated processes: $OUT/attention_host_ab.json
  attention-sustained) nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 50 > "$OUT/gpu_clocks.csv" 2>&1 & smi=$!; stage attention_sustained ${SUSTAINED_LIMIT:-240} $PY experiments/attention_sustained.py; kill $smi ;;   # flash vs cuDNN back to back, as a CUDA graph, and host ms per step: $OUT/attention_sustained.json; SM clock and power every 50 ms: $OUT/gpu_clocks.csv
  eager-host) stage eager_host ${HOST_LIMIT:-120} $PY experiments/eager_host_time.py --batch-size ${HOST_B:-1} --seq-len ${HOST_T:-512} ;;   # where the eager trainer's host time goes at a small batch: $OUT/eager_host_time.{json,txt}
  memory-budget) stage memory_budget ${BUDGET_LIMIT:-400} bash -c "$RT train dense1b --data synthetic --batch-size 32 --seq-len 1024 --steps 6 --log-every 3 --eval-every 0 --no-checkpoints --no-progress --memory-budget ${BUDGET_GIB:-40} --out-dir $LOGS/memory_budget_run && cat $LOGS/memory_budget_run/metrics.jsonl" ;;   # dense1b B32 under a budget: the split it picks (its log line) and the steps' peak_memory_gib (metrics.jsonl), in the stage log. Counted (training chapter, step_gib), a micro-batch of 32 peaks near 62 GiB, of 16 near 41.8 (measured, eager) plus the 5.4 GiB of fp32 gradients a second micro-batch finds, of 8 near 30: 40 GiB halves twice, to 8 x 4; 48 might stop at 16 x 2
  init-*)    c=${s#init-}; stage "init_$c" ${INIT_LIMIT:-300} $PY -c "from rtrainer.training import measure_init_checkpoint; measure_init_checkpoint('$c')" ;;   # init-moe4b: the step-0 checkpoint's size and its build, save and load times: data/results/init_checkpoint.json
  *) echo "unknown stage $s"; exit 2 ;;
esac; done

tar czf "$OUT/results.tgz" data/results 2>/dev/null
echo; echo "=== summary ($((SECONDS-start_all)) s)"; cat "$SUMMARY"
grep -hE "^(rb100m|dense1b|prof183m|moe4b)|ratio" "$LOGS"/train.log "$LOGS"/e2e_*.log "$LOGS"/loss_curves_*.log 2>/dev/null | tail -n 12
