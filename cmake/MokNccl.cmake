# Decides whether the fused EP transport (mok_jax._mok_comm) is built. It needs
# the CUDA build and NCCL >= 2.28 headers with the device API (nccl_device.h)
# plus libnccl.so.2, from the same NCCL that runs (the device API structs differ
# between releases; the module refuses a runtime library other than its headers').
#   MOK_ENABLE_NCCL=AUTO  build it when NCCL 2.28.x is found (default)
#   MOK_ENABLE_NCCL=ON    require it;  OFF: never
# Where: -DNCCL_HOME=... (holds include/ and lib/), else $NCCL_HOME, else the
# nvidia-nccl-cu13 package that the configuring Python imports (the one JAX loads).
set(MOK_ENABLE_NCCL "AUTO" CACHE STRING "Build the fused EP transport: AUTO, ON or OFF")
set(MOK_WITH_NCCL OFF)
if(MOK_WITH_CUDA AND NOT MOK_ENABLE_NCCL STREQUAL "OFF")
  if(NOT NCCL_HOME AND DEFINED ENV{NCCL_HOME})
    set(NCCL_HOME "$ENV{NCCL_HOME}")
  endif()
  if(NOT NCCL_HOME)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import nvidia.nccl as n; print(list(n.__path__)[0])"
      OUTPUT_VARIABLE NCCL_HOME OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  set(_nccl_code "")
  if(NCCL_HOME AND EXISTS "${NCCL_HOME}/include/nccl.h")
    file(STRINGS "${NCCL_HOME}/include/nccl.h" _nccl_line REGEX "^#define NCCL_VERSION_CODE")
    string(REGEX MATCH "[0-9]+" _nccl_code "${_nccl_line}")
  endif()
  # The device API structs are written against 2.28 (ffi/comm/nvlink_comm.h); other
  # releases change them, so AUTO builds the transport for 2.28.x only.
  if(NCCL_HOME AND EXISTS "${NCCL_HOME}/include/nccl_device.h"
     AND EXISTS "${NCCL_HOME}/lib/libnccl.so.2" AND _nccl_code MATCHES "^228[0-9][0-9]$")
    set(MOK_WITH_NCCL ON)
    mok_stable_copy("${NCCL_HOME}/include" nccl_include MOK_NCCL_INCLUDE_DIR)
    set(MOK_NCCL_LIBRARY "${NCCL_HOME}/lib/libnccl.so.2")
    message(STATUS "mok_jax fused EP transport: NCCL ${_nccl_code} at ${NCCL_HOME}")
  elseif(MOK_ENABLE_NCCL STREQUAL "ON")
    message(FATAL_ERROR "MOK_ENABLE_NCCL=ON but no NCCL 2.28.x with nccl_device.h and "
                        "libnccl.so.2 was found (NCCL_HOME='${NCCL_HOME}', "
                        "NCCL_VERSION_CODE '${_nccl_code}')")
  else()
    message(STATUS "NCCL 2.28.x with the device API not found (NCCL_HOME='${NCCL_HOME}', "
                   "version '${_nccl_code}'): fused EP transport not built")
  endif()
endif()
message(STATUS "mok_jax fused EP transport (_mok_comm): ${MOK_WITH_NCCL}")
