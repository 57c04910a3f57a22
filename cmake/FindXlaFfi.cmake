# Finds the XLA FFI headers that ship with jaxlib (jax.ffi.include_dir()).
# Defines the imported target XlaFfi::headers.
find_package(Python REQUIRED COMPONENTS Interpreter)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "from jax import ffi; print(ffi.include_dir())"
  OUTPUT_VARIABLE XLA_FFI_INCLUDE_DIR
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _xla_ffi_rc
  ERROR_VARIABLE _xla_ffi_err)
if(NOT _xla_ffi_rc EQUAL 0 OR NOT EXISTS "${XLA_FFI_INCLUDE_DIR}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR
    "mok_jax needs the XLA FFI headers from jaxlib; `python -c 'from jax import ffi; "
    "print(ffi.include_dir())'` failed with:\n${_xla_ffi_err}\n"
    "Install jax and jaxlib >= 0.11.2 into the build environment.")
endif()
message(STATUS "XLA FFI headers: ${XLA_FFI_INCLUDE_DIR}")
mok_stable_copy("${XLA_FFI_INCLUDE_DIR}" xla_ffi XLA_FFI_INCLUDE_DIR)
add_library(XlaFfi::headers INTERFACE IMPORTED)
target_include_directories(XlaFfi::headers INTERFACE "${XLA_FFI_INCLUDE_DIR}")
