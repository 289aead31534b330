// Host entry points of the megakernel shared library, called through ctypes (loader.py).
// All return a cudaError_t as int (0 = success) unless stated otherwise.
#pragma once
#include <cuda_runtime.h>

#include "runtime.cuh"

// Launch `num_sms` persistent CTAs on `stream` of `device`. Cooperative launch guarantees all
// CTAs are co-resident (or fails with cudaErrorCooperativeLaunchTooLarge); a plain launch could
// leave a CTA unscheduled while others spin on its counters, i.e. a deadlock.
extern "C" int mpk_launch(const mpk::Params* p, int num_sms, int device, void* stream) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  // The smem opt-in is per device; set it once (launch overhead matters for run(1) loops).
  static bool smem_set[64] = {};
  if (device < 0 || device >= 64 || !smem_set[device]) {
    e = cudaFuncSetAttribute(mpk_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             DYN_SMEM_BYTES);
    if (e != cudaSuccess) return (int)e;
    if (device >= 0 && device < 64) smem_set[device] = true;
  }
  mpk::Params params = *p;  // the launch copies the arguments before returning
  void* args[] = {&params};
  e = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(mpk_megakernel), dim3(num_sms),
                                  dim3(mpk::RUNTIME_THREADS), args, DYN_SMEM_BYTES,
                                  reinterpret_cast<cudaStream_t>(stream));
  return (int)e;
}

// How many megakernel CTAs fit on one SM (must be >= 1), and the kernel's register count,
// local (spill/stack) bytes and static shared memory, as the driver sees the loaded binary.
extern "C" int mpk_kernel_info(int device, int* blocks_per_sm, int* registers, int* local_bytes,
                               int* static_smem) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return (int)e;
  e = cudaFuncSetAttribute(mpk_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           DYN_SMEM_BYTES);
  if (e != cudaSuccess) return (int)e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, mpk_megakernel,
                                                    mpk::RUNTIME_THREADS, DYN_SMEM_BYTES);
  if (e != cudaSuccess) return (int)e;
  cudaFuncAttributes attr;
  e = cudaFuncGetAttributes(&attr, mpk_megakernel);
  if (e != cudaSuccess) return (int)e;
  *registers = attr.numRegs;
  *local_bytes = (int)attr.localSizeBytes;
  *static_smem = (int)attr.sharedSizeBytes;
  return 0;
}

extern "C" const char* mpk_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

// ABI checks: the loader refuses a library whose layout differs from the Python side's.
extern "C" int mpk_abi_version() { return MPK_ABI_VERSION; }
extern "C" int mpk_record_words() { return REC_WORDS; }
extern "C" int mpk_params_bytes() { return (int)sizeof(mpk::Params); }
extern "C" int mpk_error_words() { return ERR_WORDS; }
extern "C" int mpk_num_threads() { return mpk::RUNTIME_THREADS; }
extern "C" int mpk_smem_bytes() { return DYN_SMEM_BYTES; }
// 1 when built with MPK_PROFILE (Params::profile is written), else 0.
extern "C" int mpk_profile_enabled() {
#ifdef MPK_PROFILE
  return 1;
#else
  return 0;
#endif
}

// Kind names by kind id (for profilers and error messages); nullptr past the end.
extern "C" int mpk_num_kinds() { return MPK_NUM_KINDS; }
extern "C" const char* mpk_kind_name(int kind) {
  return kind >= 0 && kind < MPK_NUM_KINDS ? MPK_KIND_NAMES[kind] : nullptr;
}
