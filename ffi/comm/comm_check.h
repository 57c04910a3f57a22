// Error plumbing for the NVLink transport (ffi/comm): every CUDA and NCCL
// return code is checked and turned into a message that names the call and its
// file:line. Nothing throws; an empty string means success.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <string>

namespace mok::comm {

inline std::string call_site(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line);
}

inline std::string cuda_message(const char* call, cudaError_t err, const char* file, int line) {
  return call_site(file, line) + ": " + call + " failed: " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ", cudaError_t " + std::to_string(static_cast<int>(err)) + ")";
}

inline std::string nccl_message(const char* call, ncclResult_t res, const char* file, int line) {
  std::string msg = call_site(file, line) + ": " + call + " failed: " + ncclGetErrorString(res) +
                    " (ncclResult_t " + std::to_string(static_cast<int>(res)) + ")";
  // NCCL keeps one process-wide "last error" text (the comm argument is ignored in 2.28).
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') msg += "; NCCL says: " + std::string(last);
  return msg;
}

// Appends `msg` to `all` (one message a line); used where cleanup carries on
// after a failure so that every failure is reported.
inline void append_error(std::string& all, const std::string& msg) {
  if (msg.empty()) return;
  if (!all.empty()) all += "\n";
  all += msg;
}

// Keeps the calling thread's current device: code that switches devices makes a
// guard first and reports what restore() returns, on every path. The destructor
// sets the device back only where restore() was not called (an exception passing
// through); it cannot return an error, so it prints a failure to stderr.
class DeviceGuard {
 public:
  DeviceGuard() : get_err_(cudaGetDevice(&saved_)) {}
  ~DeviceGuard() {
    if (restored_) return;
    // No allocation here: the destructor may run while a std::bad_alloc unwinds.
    const cudaError_t err = get_err_ != cudaSuccess ? get_err_ : cudaSetDevice(saved_);
    if (err != cudaSuccess) {
      std::fprintf(stderr,
                   "mok::comm::DeviceGuard: the calling thread's current device was not "
                   "restored to %d: %s (%s)\n",
                   saved_, cudaGetErrorName(err), cudaGetErrorString(err));
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // Sets the current device back to the one the guard found: "" on success, else
  // what failed (cudaGetDevice when the guard was made, or cudaSetDevice now).
  // Once called, later calls and the destructor do nothing.
  std::string restore() {
    if (restored_) return "";
    restored_ = true;
    if (get_err_ != cudaSuccess) {
      return cuda_message("cudaGetDevice(&saved_)", get_err_, __FILE__, __LINE__) +
             "; the calling thread's current device was not restored";
    }
    const cudaError_t err = cudaSetDevice(saved_);
    if (err != cudaSuccess) {
      return cuda_message("cudaSetDevice(saved_)", err, __FILE__, __LINE__) +
             "; the calling thread's current device was not restored to " +
             std::to_string(saved_);
    }
    return "";
  }

 private:
  int saved_ = 0;
  cudaError_t get_err_;
  bool restored_ = false;
};

// Runs fn (returning std::string, "" on success) and restores the calling
// thread's current device after it: fn may switch devices and return early on
// any path. Returns fn's message with a failure to restore appended.
template <typename Fn>
std::string keeping_current_device(Fn&& fn) {
  DeviceGuard guard;
  std::string err = fn();
  append_error(err, guard.restore());
  return err;
}

}  // namespace mok::comm

// Return the message from the enclosing function (returning std::string).
#define MOK_COMM_CUDA_RETURN(expr)                                                     \
  do {                                                                                 \
    cudaError_t _mok_comm_err = (expr);                                                \
    if (_mok_comm_err != cudaSuccess)                                                  \
      return ::mok::comm::cuda_message(#expr, _mok_comm_err, __FILE__, __LINE__);      \
  } while (0)

#define MOK_COMM_NCCL_RETURN(expr)                                                     \
  do {                                                                                 \
    ncclResult_t _mok_comm_res = (expr);                                               \
    if (_mok_comm_res != ncclSuccess)                                                  \
      return ::mok::comm::nccl_message(#expr, _mok_comm_res, __FILE__, __LINE__);      \
  } while (0)

// Record the message in `all` (a std::string) and carry on.
#define MOK_COMM_CUDA_COLLECT(all, expr)                                               \
  do {                                                                                 \
    cudaError_t _mok_comm_err = (expr);                                                \
    if (_mok_comm_err != cudaSuccess)                                                  \
      ::mok::comm::append_error(                                                       \
          (all), ::mok::comm::cuda_message(#expr, _mok_comm_err, __FILE__, __LINE__)); \
  } while (0)

#define MOK_COMM_NCCL_COLLECT(all, expr)                                               \
  do {                                                                                 \
    ncclResult_t _mok_comm_res = (expr);                                               \
    if (_mok_comm_res != ncclSuccess)                                                  \
      ::mok::comm::append_error(                                                       \
          (all), ::mok::comm::nccl_message(#expr, _mok_comm_res, __FILE__, __LINE__)); \
  } while (0)

#define MOK_COMM_RETURN_IF_MESSAGE(expr)      \
  do {                                        \
    std::string _mok_comm_msg = (expr);       \
    if (!_mok_comm_msg.empty()) return _mok_comm_msg; \
  } while (0)
