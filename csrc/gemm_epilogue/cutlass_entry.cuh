// The C entry points of every generated CUTLASS gemm_epilogue kernel library, and the status codes
// xaccel_run returns. codegen/gemm_epilogue/cutlass_kernels.py loads each library with ctypes and
// reads a failure's message from xaccel_status_message, so the codes are defined here only.
// Each generated library is one translation unit that includes this header once.
#pragma once

#include <cstddef>
#include <cstdint>

enum XaccelStatus : int {
  kXaccelOk = 0,
  kXaccelCannotImplement = 1,  // CUTLASS cannot implement these sizes or strides
  kXaccelWorkspaceTooSmall = 2,
  kXaccelInitializeFailed = 3,  // e.g. building the TMA descriptors
  kXaccelLaunchFailed = 4,
};

extern "C" {

// Bytes of device workspace a call needs (0 for the plain persistent schedule).
size_t xaccel_workspace_size(int M, int N, int K, int sm_count);

// D (and the chain's extra outputs, outs[1:]) = epilogue(A @ op(B), operands) on `stream`:
// a [M, K] with row stride lda, b with row stride ldb, outs[k] [M, N] with row stride ldd, ops[j]
// the operands (a full [M, N] operand with row stride op_lds[j]); swizzle and raster steer the
// persistent tile scheduler (raster 0: CUTLASS's heuristic, 1: along M, 2: along N).
int xaccel_run(const void* a, int64_t lda, const void* b, int64_t ldb, void* const* outs, int64_t ldd,
               const void* const* ops, const int64_t* op_lds, int M, int N, int K, int sm_count, int swizzle,
               int raster, void* workspace, size_t workspace_bytes, void* stream);

const char* xaccel_status_message(int status) {
  switch (status) {
    case kXaccelOk: return "ok";
    case kXaccelCannotImplement: return "CUTLASS cannot implement these sizes or strides";
    case kXaccelWorkspaceTooSmall: return "workspace too small";
    case kXaccelInitializeFailed: return "initialisation (TMA descriptors) failed";
    case kXaccelLaunchFailed: return "launch failed";
    default: return "unknown status";
  }
}

}  // extern "C"
