#!/usr/bin/env bash
# The --use-gpu path on a machine with NVIDIA GPUs: NCCL, SyncBatchNorm, fp16 and bf16 AMP.
# Prints throughput and accuracy per configuration; finishes in a few minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh /path/to/mnist-root
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?usage: gpu_check.sh DATA_DIR (holding MNIST/raw)}
PY=${PYTHON:-python}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
[ "$GPUS" -ge 1 ] || { echo "gpu_check: no CUDA device visible" >&2; exit 1; }
WORKERS=$(( GPUS >= 2 ? 2 : 1 ))   # SyncBatchNorm (auto) needs more than one GPU worker
OUT=$(mktemp -d)
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
for AMP in off fp16 bf16; do
  $PY -m raytrain_mnist.fit --use-gpu --num-workers "$WORKERS" --backend nccl --amp "$AMP" \
      --epochs 2 --dataset mnist --data-dir "$DATA" --storage-path "$OUT" --name "gpu-$AMP"
  $PY - "$OUT/gpu-$AMP/summary.json" "$AMP" "$WORKERS" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"GPU_CHECK amp={sys.argv[2]} workers={sys.argv[3]} "
      f"images_per_s={s['history'][-1]['images_per_s']:.0f} val_accuracy={s['val_accuracy']:.4f} "
      f"wall_s={s['wall_time_s']:.1f}")
PY
done
