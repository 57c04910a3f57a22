# Decides whether the CUDA handlers are built.
#   MOK_ENABLE_CUDA=ON    require nvcc (fail if missing)
#   MOK_ENABLE_CUDA=OFF   CPU-only build (fast local builds)
#   MOK_ENABLE_CUDA=AUTO  build CUDA when nvcc is found (default)
# The default architecture is sm_90a (Hopper with wgmma/TMA); override with
# -DCMAKE_CUDA_ARCHITECTURES=... Architectures must be set before enable_language.
#   MOK_CUDA_FROM_PYTHON=ON  compile with the CUDA toolkit of the configuring Python's
#                            nvidia-cuda-nvcc package (nvidia/cu13: bin/nvcc, include,
#                            lib), as `MOK_CUDA=13 pip install .` sets up
set(MOK_ENABLE_CUDA "AUTO" CACHE STRING "Build CUDA handlers: AUTO, ON or OFF")
option(MOK_CUDA_FROM_PYTHON "Use the nvidia-cuda-nvcc package's CUDA toolkit" OFF)
set(MOK_WITH_CUDA OFF)
if(MOK_CUDA_FROM_PYTHON AND NOT MOK_ENABLE_CUDA STREQUAL "OFF")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import nvidia.cu13 as cu; print(list(cu.__path__)[0])"
    OUTPUT_VARIABLE _mok_cuda_root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT _mok_cuda_root OR NOT EXISTS "${_mok_cuda_root}/bin/nvcc")
    message(FATAL_ERROR "MOK_CUDA_FROM_PYTHON=ON but ${Python_EXECUTABLE} has no "
                        "nvidia-cuda-nvcc package (nvidia/cu13/bin/nvcc)")
  endif()
  message(STATUS "mok_jax CUDA toolkit from Python packages: ${_mok_cuda_root}")
  mok_stable_copy("${_mok_cuda_root}" cuda _mok_cuda_root)
  set(CMAKE_CUDA_COMPILER "${_mok_cuda_root}/bin/nvcc")
  set(CUDAToolkit_ROOT "${_mok_cuda_root}")
  # The packages keep their libraries in lib/, where nvcc's own link line looks in
  # lib64/, and ship the runtime as libcudart.so.13 only (we link cudart_static).
  string(APPEND CMAKE_CUDA_FLAGS " -L${_mok_cuda_root}/lib")
  file(GLOB _mok_cudart "${_mok_cuda_root}/lib/libcudart.so*")
  if(_mok_cudart)
    list(GET _mok_cudart 0 _mok_cudart)
    set(CUDA_CUDART "${_mok_cudart}" CACHE FILEPATH "CUDA runtime of the Python packages")
  endif()
endif()
if(NOT MOK_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    enable_language(CUDA)
    set(MOK_WITH_CUDA ON)
  elseif(MOK_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MOK_ENABLE_CUDA=ON but no CUDA compiler (nvcc) was found")
  else()
    message(STATUS "nvcc not found: building the CPU handlers only")
  endif()
endif()
message(STATUS "mok_jax CUDA handlers: ${MOK_WITH_CUDA}")
