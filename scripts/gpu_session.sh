#!/usr/bin/env bash
# Everything the GPU checks need, in one call on a fresh CUDA machine with no network:
#   bash scripts/gpu_session.sh "LANE" ["LANE" ...]
# A lane is a space-separated list of steps run one after another; lane i runs on GPU i, all lanes
# at once (on a one-GPU machine, one after another on GPU 0). Steps:
#   check graphs e2e compile sanitize sweep gluon bench host unet compare train planner tune multi (multi takes every GPU)
# e.g.  bash scripts/gpu_session.sh "sanitize check sweep" "compare planner"
# SHARE_GPU=1 runs every lane at once on GPU 0 (for steps that time nothing: check, sanitize), and
# CHECK_SHARDS=N splits check_gpu.py's list over N processes, e.g.
#   SHARE_GPU=1 CHECK_SHARDS=3 bash scripts/gpu_session.sh check sanitize sanitize=gluon
# sweep=ONLY, bench=ONLY and check=ONLY pass --only ONLY to those steps, host=PARTS --parts PARTS to bench_host.py (comma-separated case names or substrings;
# compile=ONLY bench_compile.py's (COMPILE_PRESETS its presets, COMPILE_RUNS cold,warm or one of them);
# e2e=ONLY picks bench_e2e.py's configurations (E2E_PRESETS=sd15:512,... its presets, E2E_ROUNDS its rounds); TRAIN_ARGS="--sizes 768 ..." go to bench_train_step.py; for sweep and bench also fwd / bwd, and parts joined by +, e.g. sweep=bwd+x77);
# sanitize=bwd checks the backward kernels only, sanitize=gluon the Gluon Hopper forward.
# Each step is cut off after STEP_TIMEOUT seconds (default 540), and none runs past BUDGET_S seconds
# from the start (default 570: the lent machines allow 600 per call). Logs and results go to /tmp/gpu_session
# and, after every step, into one archive, $OUT/results.tgz (the lent machines return at most 8 files),
# with the generated images left out. Expects the wheels of sdpatch and diffusers in .whl/ (see
# docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-out}
W=/tmp/gpu_session
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# FlashAttention-4, bench_kernels' optional peer: its wheels come in .fa4/ (ignored, carried), the
# ~92 MB CuTe DSL libraries wheel in two halves (split -b 46000000: *.part-aa, *.part-ab) over two
# back-to-back calls while the machine stays warm. Once both halves are in /tmp/fa4 they are joined
# and everything installed to /tmp/fa4site; its cutlass package sits in nvidia_cutlass_dsl/dsl_packages,
# whose .pth a --target install does not read.
if [ -d .fa4 ]; then mkdir -p /tmp/fa4 && cp .fa4/* /tmp/fa4/; fi
for a in /tmp/fa4/*.part-aa; do
  [ -e "$a" ] && [ -e "${a%-aa}-ab" ] && cat "$a" "${a%-aa}-ab" > "${a%.part-aa}" && rm "$a" "${a%-aa}-ab"
done
if ! ls /tmp/fa4/*.part-a? >/dev/null 2>&1 && ls /tmp/fa4/*.whl >/dev/null 2>&1 && [ ! -d /tmp/fa4site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4site /tmp/fa4/*.whl
fi
[ -d /tmp/fa4site ] && PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
# Run from outside the checkout, so that the wheel's sdpatch is the one imported, not the source tree.
REPO=$(pwd)
OUT=$(cd "$OUT" && pwd)
cd "$W" || exit 1
# NVLink multicast stays off: the lent machines' GPUs are shared (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$W/gpus.txt"
python3 -c "import torch, triton, diffusers, sdpatch; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'sdpatch', sdpatch.__file__)" | tee -a "$W/gpus.txt"
# The host's time to enqueue a small kernel (scripts/_bench.py): what bounds eager steps, and what
# differs between the lent hosts of one card model.
python3 -c "import sys; sys.path.insert(0, '$REPO/scripts'); from _bench import host_launch_us; print(f'host: {host_launch_us():.2f} us to enqueue a small kernel')" | tee -a "$W/gpus.txt"
ngpu=$(nvidia-smi --list-gpus | wc -l)

collect() {  # everything small under $W, atomically, so that a cut-off call still returns it
  tar -czf "$OUT/.results.tgz" -C "$W" --exclude='*/images' --exclude='gpus[0-9]*/*.png' --exclude='warmup.png' . \
    && mv "$OUT/.results.tgz" "$OUT/results.tgz"
}

step() {  # step NAME[=ONLY]: run one step on the GPUs this lane sees
  local s=${1%%=*} only= rc=0 left=$(( END - $(date +%s) ))
  [ "$s" = "$1" ] || only=${1#*=}
  [ "$left" -lt "$STEP_TIMEOUT" ] || left=$STEP_TIMEOUT
  if [ "$left" -lt 20 ]; then echo "=== $s: skipped, no time left"; return 1; fi
  local t="timeout -k 5 $left"
  echo "=== $s (GPU ${CUDA_VISIBLE_DEVICES:-all}) $(date +%T)"
  case $s in
    check)  # CHECK_SHARDS=N processes share the list (its time is mostly compiling, one CPU core each)
      local n=${CHECK_SHARDS:-1} pids=() i
      for (( i = 0; i < n; i++ )); do
        $t python3 "$REPO/scripts/check_gpu.py" ${only:+--only "$only"} --shard "$i/$n" > "$W/check_gpu.$i.log" 2>&1 & pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=1; done
      cat "$W"/check_gpu.*.log > "$W/check_gpu.log"; grep -h "failed\|passed" "$W"/check_gpu.*.log | tail -n "$n" ;;
    sanitize)  # memcheck and racecheck on the kernels at edge shapes; zero errors expected. A plain run
      # first fills Triton's kernel cache: compiling under the sanitizer took over 150 s and ran out of time.
      # A plain run cut off here has only filled less of the cache: its 124 is no failure. Then the two
      # tools at once, each with the time left.
      local args= tag=; [ "$only" = bwd ] && args=--backward-only; [ "$only" = gluon ] && args=--gluon; tag=${only:+_$only}
      timeout -k 5 $(( left * 2 / 5 )) python3 "$REPO/scripts/sanitize_kernels.py" $args > "$W/sanitize${tag}_plain.log" 2>&1 || [ $? -eq 124 ] || rc=1
      local t_left=$(( END - $(date +%s) )) tools=(); [ "$t_left" -lt "$left" ] || t_left=$left
      for tool in memcheck racecheck; do
        timeout -k 5 "$t_left" compute-sanitizer --tool $tool --error-exitcode 3 python3 "$REPO/scripts/sanitize_kernels.py" $args \
          > "$W/sanitize${tag}_$tool.log" 2>&1 & tools+=($!)
      done
      for p in "${tools[@]}"; do wait "$p" || rc=$?; done ;;
    sweep) $t python3 "$REPO/scripts/sweep_configs.py" ${only:+--only "$only"} --json "$W/sweep${only:+_$only}.json" > "$W/sweep${only:+_$only}.log" 2>&1 || rc=$? ;;
    gluon)  # gluon=fwd / gluon=bwd: the Gluon Hopper kernels' tile sweeps (sweep_gluon_fwd.py, sweep_gluon_bwd.py);
      # GLUON_CASES="hd40 4096,hd64 4096": those cases only
      $t python3 "$REPO/scripts/sweep_gluon_${only:-fwd}.py" ${GLUON_CASES:+--only "$GLUON_CASES"} --json "$W/sweep_gluon_${only:-fwd}.json" > "$W/gluon_${only:-fwd}.log" 2>&1 || rc=$? ;;
    bench) $t python3 "$REPO/scripts/bench_kernels.py" ${only:+--only "$only"} --json "$W/bench_kernels.json" > "$W/bench_kernels.log" 2>&1 || rc=$? ;;
    graphs) $t python3 "$REPO/scripts/check_graphs.py" --json "$W/check_graphs.json" > "$W/check_graphs.log" 2>&1 || rc=$? ;;
    e2e) $t python3 "$REPO/scripts/bench_e2e.py" ${only:+--only "$only"} --presets "${E2E_PRESETS:-sd15:512,sd15:1024,sdxl:1024}" --rounds "${E2E_ROUNDS:-2}" \
           --json "$W/bench_e2e.json" > "$W/bench_e2e.log" 2>&1 || rc=$? ;;
    compile) $t python3 "$REPO/scripts/bench_compile.py" ${only:+--only "$only"} --presets "${COMPILE_PRESETS:-sd15:512}" \
               --runs "${COMPILE_RUNS:-cold,warm}" --json "$W/bench_compile.json" > "$W/bench_compile.log" 2>&1 || rc=$? ;;
    host) $t python3 "$REPO/scripts/bench_host.py" ${only:+--parts "$only"} --json "$W/bench_host.json" > "$W/bench_host.log" 2>&1 || rc=$? ;;
    unet) $t python3 "$REPO/scripts/bench_unet.py" --json "$W/bench_unet.json" > "$W/bench_unet.log" 2>&1 || rc=$? ;;
    compare) $t python3 -m sdpatch compare --model sd15 --sizes 512,1024,2048 --backends stock,naive,sliced,sdpa,triton,chunked \
               --steps 3 --seed 0 --out "$W/compare" --overwrite > "$W/compare.log" 2>&1 || rc=$? ;;
    train) $t python3 "$REPO/scripts/bench_train_step.py" ${TRAIN_ARGS:-} --json "$W/bench_train.json" > "$W/bench_train.log" 2>&1 || rc=$? ;;
    planner)  # the --vram-budget estimator, with and without expandable segments, and the planned compare column;
      # planner=small: issue 29's small-card targets alone; planner=small:MODELS[:SIZES] those presets' (and
      # sizes') only, e.g. "planner=small:sdxl" "planner=small:sd15" as two lanes on two GPUs; planner=fp8 the fp8 case
      if [ "$only" = fp8 ]; then  # planner=fp8: the fp8-storage case (check_planner.py --fp8)
        $t python3 "$REPO/scripts/check_planner.py" --small-cards --fp8 --models sdxl --json "$W/check_planner_fp8.json" \
          > "$W/check_planner_fp8.log" 2>&1 || rc=$?
        echo "=== $s: exit $rc $(date +%T)"; tail -n 25 "$W/check_planner_fp8.log"; collect; return $rc
      fi
      if [ "${only%%:*}" = small ]; then
        local models= sizes= tag=; IFS=: read -r _ models sizes <<< "$only"; tag=${models:+_${models//,/_}}
        $t python3 "$REPO/scripts/check_planner.py" --small-cards ${models:+--models "$models"} ${sizes:+--sizes "$sizes"} \
          --json "$W/check_planner_small$tag.json" > "$W/check_planner_small$tag.log" 2>&1 || rc=$?
        echo "=== $s: exit $rc $(date +%T)"; tail -n 25 "$W/check_planner_small$tag.log"; collect; return $rc
      fi
      $t python3 "$REPO/scripts/check_planner.py" --json "$W/check_planner.json" > "$W/check_planner.log" 2>&1 || rc=$?
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $t python3 "$REPO/scripts/check_planner.py" --json "$W/check_planner_expandable.json" \
        > "$W/check_planner_expandable.log" 2>&1 || rc=$?
      $t python3 -m sdpatch compare --model sd15 --sizes 1024,2048 --backends stock,auto --vram-budget 3 --steps 3 --seed 0 \
        --out "$W/compare_budget" --overwrite > "$W/compare_budget.log" 2>&1 || rc=$? ;;
    tune) $t python3 "$REPO/scripts/collect_tuned_configs.py" --out "$W/tuned.json" > "$W/tune.log" 2>&1 || rc=$? ;;  # then sdpatch/kernels/tuned/sm_XY.json
    multi) OUT="$W/multi" $t bash "$REPO/scripts/bench_multi_gpu.sh" > "$W/multi.log" 2>&1 || rc=$? ;;
    *) echo "unknown step $s"; rc=2 ;;
  esac
  echo "=== $s: exit $rc $(date +%T)"
  tail -n 25 "$W"/*"$s"*.log 2>/dev/null
  collect
  return $rc
}

lane() {  # lane GPU STEPS...
  local gpu=$1 rc=0; shift
  for s in "$@"; do CUDA_VISIBLE_DEVICES=$gpu step "$s" || rc=1; done
  return $rc
}

rc=0
if [ "$#" -eq 1 ] && [ "$1" = multi ]; then
  step multi || rc=1
elif [ "$ngpu" -ge "$#" ] || [ -n "${SHARE_GPU:-}" ]; then  # SHARE_GPU=1: every lane at once on GPU 0 (no timing steps)
  pids=(); i=0
  for l in "$@"; do lane $(( ${SHARE_GPU:+0*}i )) $l > "$W/lane$i.txt" 2>&1 & pids+=($!); i=$((i + 1)); done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$W"/lane*.txt
else
  for l in "$@"; do lane 0 $l || rc=1; done
fi
collect
exit $rc
