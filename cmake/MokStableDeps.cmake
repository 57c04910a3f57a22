# mok_stable_copy(<source dir> <name> <out var>): a copy of a dependency's files under
# ${CMAKE_BINARY_DIR}/deps/<name>, updated file by file only where the content
# differs (files gone from the source are removed), and its path in <out var>.
#
# pip builds every install in a new isolated environment (/tmp/pip-build-env-*),
# so the headers and the compiler that the build environment brings (nanobind,
# jaxlib's XLA FFI headers, CUTLASS, NCCL's headers, the CUDA toolkit of
# nvidia-cuda-nvcc) have a new path and new timestamps every time. Compiling from
# these copies keeps every command line and header timestamp of a second build of
# the same sources equal to the first's, so the reused build directory
# (tool.scikit-build build-dir) recompiles nothing.
function(mok_stable_copy source name out_var)
  set(dest "${CMAKE_BINARY_DIR}/deps/${name}")
  file(GLOB_RECURSE _new LIST_DIRECTORIES false RELATIVE "${source}" "${source}/*")
  list(FILTER _new EXCLUDE REGEX "(^|/)__pycache__/")
  set(_dirs "")
  foreach(f IN LISTS _new)
    get_filename_component(d "${dest}/${f}" DIRECTORY)
    list(APPEND _dirs "${d}")
  endforeach()
  list(REMOVE_DUPLICATES _dirs)
  if(_dirs)
    file(MAKE_DIRECTORY ${_dirs})
  endif()
  foreach(f IN LISTS _new)
    file(COPY_FILE "${source}/${f}" "${dest}/${f}" ONLY_IF_DIFFERENT RESULT _rc)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "copying ${source}/${f} into the build tree failed: ${_rc}")
    endif()
  endforeach()
  if(EXISTS "${dest}")
    file(GLOB_RECURSE _old LIST_DIRECTORIES false RELATIVE "${dest}" "${dest}/*")
    if(_new)
      list(REMOVE_ITEM _old ${_new})
    endif()
    foreach(f IN LISTS _old)
      file(REMOVE "${dest}/${f}")
    endforeach()
  endif()
  set(${out_var} "${dest}" PARENT_SCOPE)
endfunction()
