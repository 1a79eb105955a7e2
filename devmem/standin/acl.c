/*
 * Ascend ACL's front of the stand-in (see core.c): the symbols of acl/acl_rt.h that kvpool-devmem
 * calls, plus aclrtMalloc, aclrtFree and aclrtMemcpy for tests. Error codes as
 * acl/acl_base_rt.h and acl/error_codes/rt_error_codes.h define them.
 */
#include <stdint.h>
#include <string.h>

#include "core.h"

enum {
  ACL_SUCCESS = 0,
  ACL_ERROR_INVALID_PARAM = 100000,
  ACL_ERROR_BAD_ALLOC = 200000,
  ACL_ERROR_RT_PARAM_INVALID = 107000,
  ACL_ERROR_RT_INVALID_DEVICEID = 107001,
  ACL_ERROR_RT_CONTEXT_NULL = 107002,
  ACL_ERROR_RT_AICORE_EXCEPTION = 507015,
  ACL_ERROR_FAILURE = 500000,
};

typedef struct {
  struct {
    uint32_t id, type;
  } location;
  uint32_t pageSize;
  uint32_t rsv[4];
} aclrtPtrAttributes;

static int acl_rc(int rc) {
  switch (rc) {
    case OK: return ACL_SUCCESS;
    case E_VALUE: case E_ALIGN: case E_INJECTED: return ACL_ERROR_INVALID_PARAM;
    case E_ALLOC: return ACL_ERROR_BAD_ALLOC;
    case E_DEVICE: return ACL_ERROR_RT_INVALID_DEVICEID;
    case E_CONTEXT: return ACL_ERROR_RT_CONTEXT_NULL;
    case E_EXEC: return ACL_ERROR_RT_AICORE_EXCEPTION;
    case E_PINNED_TWICE: case E_NOT_PINNED: return ACL_ERROR_RT_PARAM_INVALID;
    default: return ACL_ERROR_FAILURE;
  }
}

/* Calls that need the thread's current context. */
static int need_context(void) {
  if (standin_device() >= 0) return OK;
  say("%s", "no current context on this thread (call aclrtSetDevice first)");
  return E_CONTEXT;
}

EXPORT const char *kvpool_devmem_standin_backend(void) { return "acl"; }
EXPORT const char *aclGetRecentErrMsg(void) { return standin_message(); }

EXPORT int aclrtSetDevice(int32_t d) { return acl_rc(set_device(d)); }
EXPORT int aclrtResetDevice(int32_t d) {
  standin_clear_device(d);
  return ACL_SUCCESS;
}
EXPORT int aclrtGetDevice(int32_t *d) {
  if (!d) return acl_rc(E_VALUE);
  int rc = need_context();
  if (rc == OK) *d = standin_device();
  return acl_rc(rc);
}

EXPORT int aclrtMalloc(void **p, size_t n, int policy) {
  (void)policy;
  int rc = need_context();
  return acl_rc(rc != OK ? rc : dev_malloc(p, n, standin_device(), 0));
}
EXPORT int aclrtFree(void *p) { return acl_rc(dev_free(p)); }

EXPORT int aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t n, int kind) {
  if ((kind != 1 && kind != 2) || n > dst_max) return acl_rc(E_VALUE);
  return acl_rc(copy_sync(dst, src, n, kind == 1));
}

EXPORT int aclrtMemcpyAsync(void *dst, size_t dst_max, const void *src, size_t n, int kind, void *stream) {
  int rc = need_context();
  if (rc != OK) return acl_rc(rc);
  if ((kind != 1 && kind != 2) || n > dst_max) return acl_rc(E_VALUE);
  return acl_rc(copy_async(dst, src, n, kind == 1, stream));
}

EXPORT int aclrtCreateStream(void **s) {
  int rc = need_context();
  if (rc != OK || !s) return acl_rc(rc != OK ? rc : E_VALUE);
  *s = stream_create(standin_device());
  return *s ? ACL_SUCCESS : acl_rc(E_ALLOC);
}

EXPORT int aclrtDestroyStream(void *s) {
  if (!s) return acl_rc(E_VALUE);
  stream_free(s);
  return ACL_SUCCESS;
}

EXPORT int aclrtSynchronizeStream(void *s) {
  int rc = need_context();
  if (rc != OK || !s) return acl_rc(rc != OK ? rc : E_VALUE);
  return acl_rc(stream_sync(s));
}

EXPORT int aclrtHostRegister(void *p, uint64_t n, int type, void **dev) {
  if (type != 0 || !dev) return acl_rc(E_VALUE);
  int rc = host_register(p, (size_t)n, 4096);
  /* The mapped device address; CANN says it is not for memory copies. */
  if (rc == OK) *dev = p;
  return acl_rc(rc);
}
EXPORT int aclrtHostUnregister(void *p) { return acl_rc(host_unregister(p)); }

EXPORT int aclrtPointerGetAttributes(const void *p, aclrtPtrAttributes *attr) {
  if (!attr) return acl_rc(E_VALUE);
  memset(attr, 0, sizeof *attr);
  int device = 0;
  int kind = classify(p, &device);
  /* ACL: HOST 0, DEVICE 1, UNREGISTERED 2, MANAGED 3. */
  attr->location.type = kind == 2 ? 1 : kind == 1 ? 0 : 2;
  attr->location.id = kind == 2 ? (uint32_t)device : 0;
  attr->pageSize = 4096;
  return ACL_SUCCESS;
}
