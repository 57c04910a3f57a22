#!/usr/bin/env bash
# GPU CI for mok_jax, for a CUDA machine without internet (scripts/gpu_ci.sh OUTDIR).
# Bring the wheels it lacks in .whl/ (nvidia-cutlass: `pip download --no-deps -d .whl
# nvidia-cutlass==4.2.0.0`) and the commit id in .whl/COMMIT.
#
# Builds and installs the extension (no build isolation: scikit-build-core,
# nanobind, jax and jaxlib must be installed; extra wheels may be carried in
# .whl/), runs the test suite on the CPU and the gpu/multigpu-marked tests on
# the GPUs, then the benchmark. Logs and JSON go to OUTDIR.
set -uo pipefail
OUTDIR=$(realpath -m "${1:-${OUT:-gpu_ci_out}}")
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
# NVLink multicast stays off in every process (shared machines: a program using it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
step() {  # step NAME CMD...: runs CMD, logs to OUTDIR/NAME.log, remembers failures
  local name=$1; shift
  echo "== $name: $*"
  local t0=$(date +%s)
  "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -n 25 "$OUTDIR/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

# The tree arrives without .git: the commit can travel as .whl/COMMIT.
if [ -f .whl/COMMIT ]; then export MOK_GIT_COMMIT=$(cat .whl/COMMIT); fi
ROOT=$PWD
extra_wheels=$(ls .whl/*.whl 2>/dev/null | grep -v '/mok_jax-')  # never a stale mok_jax
if [ -n "$extra_wheels" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mok_site $extra_wheels || exit 1
  export PYTHONPATH=/tmp/mok_site${PYTHONPATH:+:$PYTHONPATH}
fi

{ nvidia-smi; nvcc --version; $PY -c 'import jax; print(jax.__version__, jax.devices())'; \
  echo "commit: ${MOK_GIT_COMMIT:-unknown}"; } > "$OUTDIR/machine.txt" 2>&1

# Steps to run (default: build sass gpu memcheck bench suite cpu; also `train`, meshes in
# MOK_TRAIN_MESHES: "1gpu ep2", also e.g. "ep8 dp2ep4"; MOK_PYTEST_ARGS: what the gpu step selects; MOK_BENCH_TORCH=0:
# no torch baselines). Step time
# limits: MOK_TIMEOUT_SASS, MOK_TIMEOUT_GPU, MOK_TIMEOUT_MEMCHECK, MOK_TIMEOUT_BENCH, MOK_TIMEOUT_TRAIN (s).
# MOK_SANITIZER_REPEAT=N: each persistent case's step N times a synccheck or racecheck
# process (default 1; every run's bits compared with the kernel chain's).
# `build` leaves the wheel in MOK_WHEEL_DIR (default OUTDIR/wheel; e.g. /tmp/wheel to
# keep it out of OUTDIR when only OUTDIR's logs should be copied back).
STEPS=" ${MOK_GPU_CI_STEPS:-build sass gpu memcheck bench suite cpu} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

if want build; then
  step build $PY -m pip wheel -v --no-build-isolation --no-deps -w "${MOK_WHEEL_DIR:-$OUTDIR/wheel}" . || exit 1
  $PY -m pip install -q --no-deps --force-reinstall "${MOK_WHEEL_DIR:-$OUTDIR/wheel}"/mok_jax-*.whl || exit 1
fi

# Run from outside the source tree so that the installed package is imported.
cd tests
if want sass; then  # the persistent kernels' wgmma K loops move no accumulators (cuobjdump)
  step sass timeout ${MOK_TIMEOUT_SASS:-300} $PY ../scripts/sass_k_loops.py
fi
if want gpu; then
  step tests_gpu timeout ${MOK_TIMEOUT_GPU:-900} $PY -m pytest -q -p no:cacheprovider -m "gpu or multigpu" -rs ${MOK_PYTEST_ARGS:-.}
fi
if want memcheck; then  # every kernel of the layer (the SwiGLU-epilogue GEMM included) under memcheck
  step memcheck env XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOK_TIMEOUT_MEMCHECK:-600} \
    compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all \
    $PY ../scripts/memcheck_case.py
  # The persistent kernels (TMA, mbarriers, a producer warp group) under synccheck
  # and racecheck (memcheck saw them above), one case per process: over all cases
  # in one process both tools ended in a segmentation fault of the host process
  # (2026-12-04, no report).
  cases=$(sed -n 's/^PERSISTENT_CASES = \([0-9][0-9]*\)$/\1/p' ../scripts/memcheck_case.py)
  [ -n "$cases" ] || { echo "== no PERSISTENT_CASES in scripts/memcheck_case.py"; status=1; }
  for tool in synccheck racecheck; do
    for i in $(seq 0 $(( ${cases:-0} - 1 ))); do
      step persistent_${tool}_$i env XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout ${MOK_TIMEOUT_MEMCHECK:-600} compute-sanitizer --tool $tool --error-exitcode 3 \
        --kernel-name kns=_persistent $PY ../scripts/memcheck_case.py --persistent-case $i \
        --repeat ${MOK_SANITIZER_REPEAT:-1}
    done
  done
fi
cd /tmp
if want bench; then
  step bench timeout ${MOK_TIMEOUT_BENCH:-1200} $PY -m mok_jax.bench $( [ "${MOK_BENCH_TORCH:-1}" = 1 ] && echo --torch) --queue 10 --json "$OUTDIR/bench.json" ${MOK_BENCH_ARGS:-}
fi
cd - > /dev/null
if want suite; then  # the whole suite with the GPU as default device
  step tests_suite_gpu timeout 1200 $PY -m pytest -q -p no:cacheprovider -m "not multigpu" -x .
fi
if want cpu; then
  step tests_cpu env JAX_PLATFORMS=cpu timeout 1200 $PY -m pytest -q -p no:cacheprovider \
    -m "not gpu and not multigpu" .
fi
if want train; then  # the h200 preset: tokens/s and MFU on one GPU, then EP=2 on two
  train_args=${MOK_TRAIN_ARGS:---steps 300 --eval-every 300 --log-every 25}
  ngpus=$(nvidia-smi -L | wc -l)
  for mesh in ${MOK_TRAIN_MESHES:-1gpu ep2}; do  # entries: 1gpu, epN, dpMepN
    case $mesh in
      1gpu) n=1; mesh_args="" ;;
      ep[1-9]|ep[1-9][0-9]) n=${mesh#ep}; mesh_args="--dp 1 --ep $n" ;;
      dp[1-9]ep[1-9]|dp[1-9]ep[1-9][0-9]|dp[1-9][0-9]ep[1-9]) dp=${mesh#dp}; dp=${dp%%ep*}; ep=${mesh##*ep}; n=$((dp * ep))
                        mesh_args="--dp $dp --ep $ep" ;;
      *) echo "unknown MOK_TRAIN_MESHES entry $mesh"; status=1; continue ;;
    esac
    if [ "$n" -gt "$ngpus" ]; then echo "== train_$mesh: needs $n GPUs, have $ngpus"; continue; fi
    step train_$mesh env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) \
      timeout ${MOK_TIMEOUT_TRAIN:-900} \
      $PY "$ROOT/examples/train_moe_lm.py" --preset h200 --no-checkpoint --no-progress \
      $mesh_args --out "$OUTDIR/train_$mesh" $train_args
  done
fi
exit $status
