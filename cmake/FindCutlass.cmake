# Finds the CUTLASS/CuTe headers shipped in the `nvidia-cutlass` Python package
# (cutlass_library/source/include and tools/util/include). The package is
# located without importing it, so its Python dependencies need not be present.
# Defines the imported target Cutlass::headers.
find_package(Python REQUIRED COMPONENTS Interpreter)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u; s = u.find_spec('cutlass_library'); print(s.submodule_search_locations[0] if s else '')"
  OUTPUT_VARIABLE _cutlass_pkg
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _cutlass_rc)
set(CUTLASS_INCLUDE_DIR "${_cutlass_pkg}/source/include")
set(CUTLASS_UTIL_INCLUDE_DIR "${_cutlass_pkg}/source/tools/util/include")
if(_cutlass_rc EQUAL 0 AND EXISTS "${CUTLASS_INCLUDE_DIR}/cutlass/cutlass.h"
   AND EXISTS "${CUTLASS_UTIL_INCLUDE_DIR}/cutlass/util/packed_stride.hpp")
  set(Cutlass_FOUND TRUE)
  message(STATUS "CUTLASS headers: ${CUTLASS_INCLUDE_DIR}")
  mok_stable_copy("${CUTLASS_INCLUDE_DIR}" cutlass CUTLASS_INCLUDE_DIR)
  mok_stable_copy("${CUTLASS_UTIL_INCLUDE_DIR}" cutlass_util CUTLASS_UTIL_INCLUDE_DIR)
  add_library(Cutlass::headers INTERFACE IMPORTED)
  target_include_directories(Cutlass::headers INTERFACE
    "${CUTLASS_INCLUDE_DIR}" "${CUTLASS_UTIL_INCLUDE_DIR}")
else()
  set(Cutlass_FOUND FALSE)
  if(Cutlass_FIND_REQUIRED)
    message(FATAL_ERROR
      "The CUDA build of mok_jax needs the CUTLASS headers of the `nvidia-cutlass` "
      "package (pip install nvidia-cutlass), or build CPU-only with "
      "-C cmake.define.MOK_ENABLE_CUDA=OFF.")
  endif()
endif()
