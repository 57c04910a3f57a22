#!/usr/bin/env bash
# Same-call A/B of the training example: this tree's Python against a base commit's,
# one run after another on the same machine: both on one extension, or (with
# MOK_BASE_WHEEL) each on its own.
#
#   scripts/train_ab.sh OUTDIR BASE_DIR
#
# BASE_DIR holds the base commit's Python, made where git is (the GPU machine's
# copy of the tree has no .git):
#   mkdir -p .ab/base && git archive BASE mok_jax examples | tar -x -C .ab/base
# (.ab/ is git-ignored: copy it to the GPU machine with the tree.) The extension is
# this tree's mok_jax/_mok*.so, or, with MOK_WHEEL=path/to/mok_jax-*.whl, the
# one installed from that wheel; it is copied into BASE_DIR/mok_jax too, so the
# comparison is of the Python alone (the C++ must not have changed in between).
# With MOK_BASE_WHEEL=path/to/base's mok_jax-*.whl the base runs on its own
# extension instead: an A/B of the C++ too (the wheels must be of the same
# Python version; the base tree's Python must match its wheel's FFI signatures).
#
# RUNS: one run per line, "TAG ROOT [NAME=VALUE ...] ARGS...", ROOT "new" (this tree)
# or "base", NAME=VALUE words before the arguments set that run's environment
# (e.g. an XLA flag: "no_cmdbuf new XLA_FLAGS=--xla_gpu_enable_command_buffer= --dp 1");
# TRAIN_ARGS: the arguments every run shares. OUTDIR gets summary.txt (each
# run's closing line) and log_TAG.json (its full log). The default RUNS follow
# the runs behind docs/ledger.md, 2026-12-01 (53b3291, the bf16 weight copies).
set -uo pipefail
OUTDIR=$(realpath -m "${1:?usage: train_ab.sh OUTDIR BASE_DIR}")
BASE=$(realpath "${2:?usage: train_ab.sh OUTDIR BASE_DIR}")
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TRAIN_ARGS=${TRAIN_ARGS:-"--preset h200 --steps 100 --eval-every 100 --eval-batches 4 \
--log-every 10 --no-checkpoint --no-progress --pgle"}
RUNS=${RUNS:-"one_new new --dp 1
one_base base --dp 1
one_new2 new --dp 1
dp2_new new --dp 2 --batch 64"}
mkdir -p "$OUTDIR"
S=$OUTDIR/summary.txt

if [ -n "${MOK_WHEEL:-}" ]; then
  rm -rf /tmp/mok_ab_wheel
  $PY -m pip install -q --no-deps --no-index --target /tmp/mok_ab_wheel "$MOK_WHEEL" || exit 1
  cp /tmp/mok_ab_wheel/mok_jax/_mok*.so mok_jax/ || exit 1
fi
so=$(ls mok_jax/_mok*.so 2>/dev/null | tr '\n' ' ')
[ -n "$so" ] || { echo "no mok_jax/_mok*.so in the tree: pass MOK_WHEEL" >&2; exit 1; }
[ -f "$BASE/examples/train_moe_lm.py" ] || { echo "$BASE has no examples/train_moe_lm.py" >&2; exit 1; }
if [ -n "${MOK_BASE_WHEEL:-}" ]; then
  rm -rf /tmp/mok_ab_base_wheel
  $PY -m pip install -q --no-deps --no-index --target /tmp/mok_ab_base_wheel "$MOK_BASE_WHEEL" \
    || exit 1
  cp /tmp/mok_ab_base_wheel/mok_jax/_mok*.so "$BASE/mok_jax/" || exit 1
else
  cp $so "$BASE/mok_jax/" || exit 1
fi

echo "train_ab: $(date -u); base $BASE; extension(s) $so; base wheel ${MOK_BASE_WHEEL:-same}; args: $TRAIN_ARGS" > "$S"
status=0
while read -r tag root args; do
  [ -n "$tag" ] || continue
  case $root in new) dir=$PWD ;; base) dir=$BASE ;; *) echo "bad ROOT $root" >&2; exit 1 ;; esac
  envs=()
  read -r -a words <<< "$args"
  while [ ${#words[@]} -gt 0 ] && [[ "${words[0]}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
    envs+=("${words[0]}")
    words=("${words[@]:1}")
  done
  rm -rf "/tmp/mok_ab_$tag"
  echo "== $tag ($root): $args" | tee -a "$S"
  env "${envs[@]}" PYTHONPATH="$dir" $PY "$dir/examples/train_moe_lm.py" $TRAIN_ARGS \
    "${words[@]}" --out "/tmp/mok_ab_$tag" > "/tmp/mok_ab_$tag.txt" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { status=1; tail -n 20 "/tmp/mok_ab_$tag.txt" >> "$S"; }
  echo "rc=$rc $(grep -E '^done' /tmp/mok_ab_$tag.txt)" | tee -a "$S"
  cp "/tmp/mok_ab_$tag/log.json" "$OUTDIR/log_$tag.json" 2>/dev/null
done <<< "$RUNS"
exit $status
