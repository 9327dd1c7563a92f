#!/usr/bin/env bash
# Everything the GPU path claims, checked in one command on a machine with an NVIDIA GPU and
# no Ray: install the offline Ray bundle, run tests/test_gpu.py (and, on that machine's torch,
# the CPU tests of the captured step's parts and of AMP), then the GPU benchmark. Each part
# has a cap that keeps the whole under the device tool's 10 minutes a command.
#
#   make gpu-bundle                      # here: build/gpu-wheels + data/mnist-gz (ignored)
#   bash benchmarks/gpu_check.sh         # there, from the checkout (docs/gpu.md: the command)
#
# Writes benchmarks/results/gpu.json and gpu.md, and copies them with the logs into $OUT
# when it is set. Exit status 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
say() { printf '[gpu_check %4ds] %s\n' $((SECONDS - START)) "$*"; }
DATA=$(realpath "${1:-data/mnist-gz}")
BUNDLE=${GPU_BUNDLE:-build/gpu-wheels}
RESULTS=benchmarks/results
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS" "$LOGS"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} PYTHONUNBUFFERED=1
export RAYTRAIN_MNIST_DATA=$DATA

[ -f "$DATA/MNIST/raw/t10k-labels-idx1-ubyte.gz" ] || [ -f "$DATA/MNIST/raw/t10k-labels-idx1-ubyte" ] \
  || { say "no MNIST in $DATA (run 'make gpu-bundle' and carry data/mnist-gz)"; exit 2; }
say "installing the Ray bundle from $BUNDLE"
# shellcheck disable=SC1091
source "$BUNDLE/install.sh" || { say "bundle install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "devices", torch.cuda.device_count())'

say "tests: tests/test_gpu.py tests/test_device_batches.py tests/test_amp.py"
timeout -s INT -k 20 285 python3 -m pytest tests/test_gpu.py tests/test_device_batches.py \
  tests/test_amp.py -v -p no:cacheprovider \
  --junitxml="$LOGS/pytest-gpu.xml" 2>&1 | tee "$LOGS/pytest-gpu.log"
TESTS=${PIPESTATUS[0]}
say "tests exited $TESTS"

say "benchmark: plain over 5 seeds, plain-eager, fit-1, fit-2-shared, fit-1-warm (one epoch)"
timeout -s INT -k 20 255 python3 -m benchmarks.gpu --data-dir "$DATA" --junit "$LOGS/pytest-gpu.xml" \
  --out "$RESULTS" 2>&1 | tee "$LOGS/bench-gpu.log"
BENCH=${PIPESTATUS[0]}
say "benchmark exited $BENCH"

cp "$RESULTS/gpu.json" "$RESULTS/gpu.md" "$LOGS/" 2>/dev/null
# What the workers wrote, for a failure that happened inside Ray.
for f in /tmp/ray/session_*/logs/worker-*.err; do
  [ -s "$f" ] && { echo "== $f"; tail -n 30 "$f"; }
done 2>/dev/null | tail -c 300000 > "$LOGS/ray-worker-err-tails.txt"
say "done: tests $TESTS, benchmark $BENCH; results in $RESULTS and $LOGS"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
