#!/bin/bash
# The GPU check of issue 10 (DEVELOPERS.md: one prepared script, within the device's
# 15 minutes): symmem.jit's per-call work (experiments.dispatch_overhead), then
# experiments.bench_models at the GPU geometry on the T5-style encoder-decoder and the
# annotated scanned Llama (GPU_CHECK_WORKLOADS="name:seconds ..." picks others, e.g.
# llama_scan:200; optionally the tests that pin JAX internals, on that machine's jax and CPU). Each stage has its own time limit and
# writes under $OUT as it goes, so a stage that runs long keeps what the earlier ones
# measured (the benchmark's rows are in the log as each shape ends).
#
#     OUT=/tmp/gpu_check bash experiments/gpu_check.sh      # where a GPU is
#     BENCH_ARGS="--quick --passes=1" DEVICE_LIMIT_ARGS="--lengths=32,64" \
#         PYTHON=.venv/bin/python bash experiments/gpu_check.sh
#                                                   # the same stages here, small (a smoke run)
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Every process grows its device memory as it uses it: the timing parent then leaves the
# measuring children (jax_symmem.measure) the whole card, and its own in-use figure is
# what symmem.jit's budget reads.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# One log for every stage (the device returns at most 8 files): $OUT/gpu_check.log, beside
# dispatch_overhead.json, device_limit.json and one bench_models_gpu_<workload>.json per
# workload.
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import sys, jax, jaxlib, flax, optax, chex, sympy; print(sys.version); \
print({m.__name__: m.__version__ for m in (jax, jaxlib, flax, optax, chex, sympy)}); \
print(jax.devices())"

echo "== per-call work of symmem.jit beside jax.jit"
timeout 60 $PY -m experiments.dispatch_overhead --out="$OUT/dispatch_overhead.json"

# No memory_budget on a device limited to 400 MiB: as written and unplanned where jax.jit
# fits, planned and within the limit where it runs out of memory (2026-12-07; untried on a
# GPU yet).
echo "== symmem.jit without a budget under the device's limit"
timeout 150 $PY -m experiments.device_limit ${DEVICE_LIMIT_ARGS:-} --out="$OUT/device_limit.json"

# Defaults sized for one 10-minute call. On 2026-12-04 each workload's stage spent 1-3 min
# before its first shape (planning, per-layer checkpointing's real peak at the longest shape)
# and about 1.5 min per shape; the scanned Llama has all three GPU rows (two sessions), T5 and
# the annotated scanned Llama (nn.remat: is per-layer recomputation skipped where memory
# allows?) one each, so they go first and get the time.
for w in ${GPU_CHECK_WORKLOADS:-t5:330 llama_scan_remat:240}; do
  name=${w%%:*}
  limit=${w##*:}
  echo "== bench_models $name (limit ${limit} s)"
  timeout "$limit" $PY -m experiments.bench_models ${BENCH_ARGS:---geometry=gpu --passes=10} \
      --workloads="$name" --out="$OUT/bench_models_gpu_$name.json"
  rc=$?
  echo "== $name: exit $rc"
  # A stage that failed (not one stopped at its limit) stops the benchmark stages: the
  # device time left is better spent on a rerun after the fix.
  if [ "$rc" != 0 ] && [ "$rc" != 124 ]; then break; fi
done

# Off by default (GPU_CHECK_HALF_FLOATS=<seconds>, about 90): does counting 16 bits match
# XLA:GPU's figure on the bfloat16-compute steps (on CPU XLA stores them as float32)?
if [ "${GPU_CHECK_HALF_FLOATS:-0}" != 0 ]; then
  echo "== bench_half_floats (limit ${GPU_CHECK_HALF_FLOATS} s)"
  timeout "$GPU_CHECK_HALF_FLOATS" $PY -m experiments.bench_half_floats \
      --out="$OUT/bench_half_floats_gpu.json"
  echo "== bench_half_floats: exit $?"
fi

# Off by default: .ci/newest_jax.sh runs the whole suite on a newer jax without a device.
if [ "${GPU_CHECK_TEST_LIMIT:-0}" != 0 ]; then
  echo "== tests that pin JAX internals, on this machine's jax (CPU)"
  JAX_PLATFORMS=cpu timeout "$GPU_CHECK_TEST_LIMIT" $PY -m pytest -q -p no:cacheprovider \
      -n 8 tests/test_jax_dims.py tests/test_tracing.py tests/test_body_remat.py \
      tests/test_xla_buffers.py 2>&1 | tail -30
fi
date -u
sleep 1   # the log's tee writes the last lines after this shell's own output
