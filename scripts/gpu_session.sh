#!/usr/bin/env bash
# Everything the GPU checks need, in one call on a fresh CUDA machine with no network:
#   bash scripts/gpu_session.sh [step ...]     (steps: check sanitize bench unet profile compare train planner; default all;
#   they take 20+ minutes together, so split them over calls of under 10 minutes)
# Expects the wheels of sdpatch and diffusers in .whl/ (see docs/benchmarks.md), writes to $OUT.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
steps=${*:-check sanitize bench unet compare train planner}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, diffusers, sdpatch; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'sdpatch', sdpatch.__file__)"
rc=0
for s in $steps; do
  echo "=== $s"
  case $s in
    check) python3 scripts/check_gpu.py 2>&1 | tee "$OUT/check_gpu.log" || rc=1 ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 scripts/sanitize_kernels.py 2>&1 | tail -30 | tee "$OUT/sanitize_$tool.log" || rc=1
      done ;;
    bench) python3 scripts/bench_kernels.py ${BENCH_ONLY:+--only "$BENCH_ONLY"} --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log" || rc=1 ;;
    profile) python3 scripts/profile_unet.py 2>&1 | tee "$OUT/profile_unet.log" || rc=1 ;;
    unet) python3 scripts/bench_unet.py --json "$OUT/bench_unet.json" 2>&1 | tee "$OUT/bench_unet.log" || rc=1 ;;
    compare) python3 -m sdpatch compare --model sd15 --sizes 512,1024,2048 --backends stock,naive,sliced,sdpa,triton,chunked --steps 3 --seed 0 --out "$OUT/compare" 2>&1 | tee "$OUT/compare.log" || rc=1 ;;
    train) python3 scripts/bench_train_step.py --json "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" || rc=1 ;;
    planner)  # the --vram-budget estimator, with and without expandable segments, and the planned compare column
      python3 scripts/check_planner.py --json "$OUT/check_planner.json" 2>&1 | tee "$OUT/check_planner.log" || rc=1
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/check_planner.py --json "$OUT/check_planner_expandable.json" 2>&1 | tee "$OUT/check_planner_expandable.log" || rc=1
      python3 -m sdpatch compare --model sd15 --sizes 1024,2048 --backends stock,auto --vram-budget 3 --steps 3 --seed 0 --out "$OUT/compare_budget" 2>&1 | tee "$OUT/compare_budget.log" || rc=1 ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
exit $rc
