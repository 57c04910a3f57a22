#!/usr/bin/env bash
# Builds scripts/nccl_smoke/build/nccl_smoke: the NVLink transport smoke test
# (smoke.cu + ffi/comm/nvlink_comm.cc + ffi/comm/nvlink_kernels.cu) for sm_90a,
# against NCCL 2.28.9's headers and its libnccl.so.2 (rpath set to its folder).
#
# usage: bash scripts/nccl_smoke/build.sh [NCCL_HOME]
#   NCCL_HOME holds include/nccl.h, include/nccl_device.h and lib/libnccl.so.2,
#   e.g. site-packages/nvidia/nccl of the nvidia-nccl-cu13==2.28.9 wheel.
#   Default: $NCCL_HOME, else that package as python3 finds it.
# env:
#   NVCC=path            compiler (default: nvcc on PATH)
#   PTXAS_VERBOSE=1      print registers / stack / spills of every kernel
#   OUT_DIR=dir          where the binary goes (default scripts/nccl_smoke/build)
#   ALLOW_NCCL_VERSION=any  build against headers other than 2.28.9 (the
#                        program still refuses a runtime library that differs
#                        from the headers it was built with)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

die() { echo "build.sh: $*" >&2; exit 2; }

nccl_home="${1:-${NCCL_HOME:-}}"
if [[ -z "$nccl_home" ]]; then
  nccl_home="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  [[ -n "$nccl_home" ]] || die "no NCCL_HOME given and python3 cannot import nvidia.nccl"
fi
nccl_home="$(cd "$nccl_home" && pwd)" || die "NCCL_HOME $nccl_home is not a directory"
hdr="$nccl_home/include/nccl.h"
lib="$nccl_home/lib/libnccl.so.2"
[[ -f "$hdr" ]] || die "$hdr not found"
[[ -f "$nccl_home/include/nccl_device.h" ]] || die "$nccl_home/include/nccl_device.h not found (NCCL < 2.28 has no device API)"
[[ -f "$lib" ]] || die "$lib not found"

code="$(sed -n 's/^#define NCCL_VERSION_CODE \([0-9][0-9]*\).*/\1/p' "$hdr")"
if [[ "$code" != "22809" && "${ALLOW_NCCL_VERSION:-}" != "any" ]]; then
  die "$hdr is NCCL_VERSION_CODE '$code', not 22809 (2.28.9); set ALLOW_NCCL_VERSION=any to build anyway"
fi

nvcc="${NVCC:-nvcc}"
command -v "$nvcc" >/dev/null || die "$nvcc not found"
out="${OUT_DIR:-$here/build}"
mkdir -p "$out"

flags=(-std=c++17 -O3 -arch=sm_90a -lineinfo -Xcompiler -Wall,-Wextra)
if [[ "${PTXAS_VERBOSE:-0}" == "1" ]]; then flags+=(-Xptxas -v); fi

set -x
"$nvcc" "${flags[@]}" \
  -I"$repo/ffi/comm" -isystem "$nccl_home/include" \
  "$here/smoke.cu" "$repo/ffi/comm/nvlink_comm.cc" "$repo/ffi/comm/nvlink_kernels.cu" \
  -L"$nccl_home/lib" -Xlinker -l:libnccl.so.2 -Xlinker -rpath -Xlinker "$nccl_home/lib" \
  -o "$out/nccl_smoke"
{ set +x; } 2>/dev/null
echo "build.sh: built $out/nccl_smoke (NCCL headers $code from $nccl_home)"
