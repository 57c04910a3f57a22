# Finds the XLA FFI headers that ship with jaxlib (jax.ffi.include_dir()).
# Defines the imported target XlaFfi::headers.
find_package(Python REQUIRED COMPONENTS Interpreter)
# -DXLA_FFI_INCLUDE_DIR=... names the headers' directory; else jaxlib's.
set(XLA_FFI_INCLUDE_DIR "" CACHE PATH "XLA FFI headers (default: jax.ffi.include_dir())")
if(NOT XLA_FFI_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "from jax import ffi; print(ffi.include_dir())"
    OUTPUT_VARIABLE _xla_ffi_dir
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _xla_ffi_rc
    ERROR_VARIABLE _xla_ffi_err)
else()
  set(_xla_ffi_dir "${XLA_FFI_INCLUDE_DIR}")
  set(_xla_ffi_rc 0)
endif()
if(NOT _xla_ffi_rc EQUAL 0 OR NOT EXISTS "${_xla_ffi_dir}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR
    "mok_jax needs the XLA FFI headers from jaxlib; `python -c 'from jax import ffi; "
    "print(ffi.include_dir())'` failed with:\n${_xla_ffi_err}\n"
    "Install jax and jaxlib (0.11.2, or 0.10.2 on Python 3.11) into the build environment.")
endif()
message(STATUS "XLA FFI headers: ${_xla_ffi_dir}")
mok_stable_copy("${_xla_ffi_dir}" xla_ffi _xla_ffi_dir)
add_library(XlaFfi::headers INTERFACE IMPORTED)
target_include_directories(XlaFfi::headers INTERFACE "${_xla_ffi_dir}")
