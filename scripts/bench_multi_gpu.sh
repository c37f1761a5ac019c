#!/usr/bin/env bash
# Issue 9's GPU figures: images/s of `sdpatch generate --prompts-file` on 1 GPU and on 2 GPUs through
# `accelerate launch` (sd15 preset, 16 prompts, 512x512, 20 steps), their ratio (goal: >= 1.8), and
# whether both runs made the same images. Run on a machine with 2 GPUs (the lent nvidia-h200-x2):
#   bash scripts/bench_multi_gpu.sh        (about 3 minutes; writes to $OUT)
# Like scripts/gpu_session.sh it installs the wheels in .whl/ (sdpatch and diffusers, see
# docs/benchmarks.md) where there are any; torch, triton and accelerate must be there already.
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# NVLink multicast stays off: the lent machines' GPUs are shared (see the device notes).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, diffusers, accelerate, sdpatch; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'accelerate', accelerate.__version__, 'GPUs', torch.cuda.device_count())"

prompts="$OUT/prompts.txt"
python3 - "$prompts" <<'EOF'
import sys
subjects = ["a lighthouse", "a red fox", "a mountain lake", "an old library", "a city street at night",
            "a bowl of fruit", "a sailing ship", "a desert canyon", "a snowy village", "a robot",
            "a field of sunflowers", "a castle", "a jazz band", "a forest path", "a hot-air balloon", "a cat"]
with open(sys.argv[1], "w", encoding="utf-8") as f:
    f.write("# 16 prompts for scripts/bench_multi_gpu.sh\n")
    f.writelines(f"{s}, detailed photograph\n" for s in subjects)
EOF

size=(-m sd15 --height 512 --width 512 --steps 20)
# Triton compiles and autotunes each new shape once and keeps the result on disk: pay for it here,
# so that neither measured run does.
python3 -m sdpatch generate "warm-up" "${size[@]}" --steps 2 -o "$OUT/warmup.png" --overwrite >/dev/null

for n in 1 2; do
  echo "=== $n GPU(s)"
  multi=(); [ "$n" -gt 1 ] && multi=(--multi_gpu)
  python3 -m accelerate.commands.launch ${multi[@]+"${multi[@]}"} --num_processes "$n" --num_machines 1 \
      --mixed_precision no --dynamo_backend no -m sdpatch generate \
      --prompts-file "$prompts" "${size[@]}" --seed 0 -o "$OUT/gpus$n" --overwrite 2>&1 | tee "$OUT/gpus$n.log"
done

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np
from PIL import Image

out = Path(sys.argv[1])
reports = {n: json.loads((out / f"gpus{n}" / "sdpatch-report.json").read_text()) for n in (1, 2)}
for n, r in reports.items():
    t = r["totals"]
    peaks = ", ".join(f"GPU {p['device']}: {p['peak_reserved'] / 2**30:.2f} GiB" for p in r["processes"])
    print(f"{n} GPU(s): {t['images']} images, {t['images_per_second']:.3f} images/s while generating, "
          f"{t['wall_seconds']:.1f} s wall with loading; peak reserved {peaks}")
ratio = reports[2]["totals"]["images_per_second"] / reports[1]["totals"]["images_per_second"]
wall = reports[1]["totals"]["wall_seconds"] / reports[2]["totals"]["wall_seconds"]
print(f"2 GPUs / 1 GPU: {ratio:.2f}x images/s (goal >= 1.8), {wall:.2f}x wall time with loading")
names = sorted(p.name for p in (out / "gpus1").glob("*.png"))
assert names == sorted(p.name for p in (out / "gpus2").glob("*.png")), "the two runs made different files"
diff = max(int(np.abs(np.asarray(Image.open(out / "gpus1" / f), dtype=np.int16)
                      - np.asarray(Image.open(out / "gpus2" / f), dtype=np.int16)).max()) for f in names)
print(f"same {len(names)} files; largest pixel difference between the 1- and 2-GPU images: {diff}")
EOF
