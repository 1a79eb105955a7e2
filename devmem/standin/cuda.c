/*
 * The CUDA runtime's front of the stand-in (see core.c): the symbols of cuda_runtime_api.h that
 * kvpool-devmem calls, plus cudaMalloc, cudaMallocManaged, cudaFree and cudaMemcpy for tests.
 */
#include <pthread.h>
#include <string.h>

#include "core.h"

static __thread int t_last;

enum {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorIllegalAddress = 700,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorUnknown = 999,
};

struct cudaPointerAttributes {
  int type, device;
  void *devicePointer, *hostPointer;
  long reserved[8];
};

static int cuda_rc(int rc) {
  int code;
  switch (rc) {
    case OK: return cudaSuccess;
    case E_VALUE: case E_ALIGN: case E_INJECTED: code = cudaErrorInvalidValue; break;
    case E_ALLOC: code = cudaErrorMemoryAllocation; break;
    case E_DEVICE: case E_CONTEXT: code = cudaErrorInvalidDevice; break;
    case E_EXEC: code = cudaErrorIllegalAddress; break;
    case E_PINNED_TWICE: code = cudaErrorHostMemoryAlreadyRegistered; break;
    case E_NOT_PINNED: code = cudaErrorHostMemoryNotRegistered; break;
    default: code = cudaErrorUnknown;
  }
  t_last = code;
  return code;
}

EXPORT const char *kvpool_devmem_standin_backend(void) { return "cuda"; }

EXPORT const char *cudaGetErrorString(int e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "unknown error";
  }
}

EXPORT int cudaGetLastError(void) {
  int e = t_last;
  t_last = 0;
  return e;
}

EXPORT int cudaSetDevice(int d) { return cuda_rc(set_device(d)); }

EXPORT int cudaGetDevice(int *d) {
  if (!d) return cuda_rc(E_VALUE);
  *d = standin_device();
  return cudaSuccess;
}

EXPORT int cudaMalloc(void **p, size_t n) { return cuda_rc(dev_malloc(p, n, standin_device(), 0)); }
EXPORT int cudaMallocManaged(void **p, size_t n, unsigned flags) {
  (void)flags;
  return cuda_rc(dev_malloc(p, n, standin_device(), 1));
}
EXPORT int cudaFree(void *p) { return cuda_rc(dev_free(p)); }

EXPORT int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
  if (kind != 1 && kind != 2) return cuda_rc(E_VALUE);
  return cuda_rc(copy_sync(dst, src, n, kind == 1));
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
  if (kind != 1 && kind != 2) return cuda_rc(E_VALUE);
  return cuda_rc(copy_async(dst, src, n, kind == 1, stream));
}

EXPORT int cudaStreamCreateWithFlags(void **s, unsigned flags) {
  (void)flags;
  if (!s) return cuda_rc(E_VALUE);
  *s = stream_create(standin_device());
  return *s ? cudaSuccess : cuda_rc(E_ALLOC);
}

EXPORT int cudaStreamDestroy(void *s) {
  if (!s) return cuda_rc(E_VALUE);
  stream_free(s);
  return cudaSuccess;
}

EXPORT int cudaStreamSynchronize(void *s) {
  if (!s) return cuda_rc(E_VALUE);
  return cuda_rc(stream_sync(s));
}

EXPORT int cudaEventCreateWithFlags(void **e, unsigned flags) {
  (void)flags;
  if (!e) return cuda_rc(E_VALUE);
  *e = event_new();
  return *e ? cudaSuccess : cuda_rc(E_ALLOC);
}

EXPORT int cudaEventRecord(void *e, void *s) { return cuda_rc(event_record(e, s)); }
EXPORT int cudaEventSynchronize(void *e) { return e ? cuda_rc(event_wait(e)) : cuda_rc(E_VALUE); }

EXPORT int cudaEventDestroy(void *e) {
  if (!e) return cuda_rc(E_VALUE);
  event_free(e);
  return cudaSuccess;
}

EXPORT int cudaHostRegister(void *p, size_t n, unsigned flags) {
  (void)flags;
  return cuda_rc(host_register(p, n, 0));
}
EXPORT int cudaHostUnregister(void *p) { return cuda_rc(host_unregister(p)); }

EXPORT int cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *p) {
  if (!attr) return cuda_rc(E_VALUE);
  memset(attr, 0, sizeof *attr);
  int device = -2;
  attr->type = classify(p, &device);
  attr->device = attr->type == 2 ? device : attr->type == 0 ? -2 : standin_device();
  if (attr->type == 2) attr->devicePointer = (void *)p;
  if (attr->type == 1 || attr->type == 3) attr->hostPointer = attr->devicePointer = (void *)p;
  return cudaSuccess;
}

