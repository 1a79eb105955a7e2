/*
 * kvpool's C ABI over HIXL (CANN's hixl::Hixl one-sided transfer engine).
 *
 * Two libraries implement it:
 *   - libkvpool_hixl_shim.so (kvpool_hixl_shim.cc): the real one, a thin layer over hixl::Hixl,
 *     built only where CANN is installed;
 *   - libkvpool_hixl_standin.so (standin.c): memcpy over POSIX shared memory between processes of
 *     one host, for tests. It checks the same rules HIXL states (register before connect, calls
 *     from a thread with the ACL context, requests freed once reported) but it is not HIXL.
 *
 * kvpool loads one of them at run time (dlopen) and refuses it unless kvpool_hixl_abi_version()
 * equals KVPOOL_HIXL_ABI_VERSION. Any change to a signature, a struct or a constant below bumps it.
 *
 * Shape (after hixl::Hixl and NIXL's plugin API): versioned entry points, opaque engine, memory
 * and request handles, status codes that are HIXL's own (103900...), a thread-local message for
 * the last failure. Every call except abi_version, backend and last_error must be made from the
 * thread that called create, or from a thread that called bind_thread (ACL contexts are per
 * thread; HIXL fails on a thread without one).
 */
#ifndef KVPOOL_HIXL_SHIM_H_
#define KVPOOL_HIXL_SHIM_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVPOOL_HIXL_ABI_VERSION 1u

/* Status codes: exactly hixl::Status (include/hixl/hixl_types.h). */
typedef uint32_t kvpool_hixl_status;
#define KVPOOL_HIXL_SUCCESS 0u
#define KVPOOL_HIXL_PARAM_INVALID 103900u
#define KVPOOL_HIXL_TIMEOUT 103901u
#define KVPOOL_HIXL_NOT_CONNECTED 103902u
#define KVPOOL_HIXL_ALREADY_CONNECTED 103903u
#define KVPOOL_HIXL_NOTIFY_FAILED 103904u
#define KVPOOL_HIXL_UNSUPPORTED 103905u
#define KVPOOL_HIXL_RESOURCE_EXHAUSTED 203900u
#define KVPOOL_HIXL_FAILED 503900u

/* hixl::MemType */
#define KVPOOL_HIXL_MEM_DEVICE 0u
#define KVPOOL_HIXL_MEM_HOST 1u

/* hixl::TransferOp */
#define KVPOOL_HIXL_READ 0u
#define KVPOOL_HIXL_WRITE 1u

/* hixl::TransferStatus */
#define KVPOOL_HIXL_XFER_WAITING 0u
#define KVPOOL_HIXL_XFER_COMPLETED 1u
#define KVPOOL_HIXL_XFER_TIMEOUT 2u
#define KVPOOL_HIXL_XFER_FAILED 3u

typedef struct kvpool_hixl_engine kvpool_hixl_engine;

/* One entry of hixl::Hixl::Initialize's option map. A key starting with "env:" is not passed to
 * HIXL: the library sets that environment variable (if it is not set yet) before initialising. */
typedef struct {
  const char *key;
  const char *value;
} kvpool_hixl_option;

/* hixl::TransferOpDesc, with fixed-width fields. */
typedef struct {
  uint64_t local_addr;
  uint64_t remote_addr;
  uint64_t len;
} kvpool_hixl_desc;

/* KVPOOL_HIXL_ABI_VERSION of the library. */
uint32_t kvpool_hixl_abi_version(void);

/* "hixl" for the real shim, "standin" for the shared-memory stand-in. */
const char *kvpool_hixl_backend(void);

/* Copies the message of the last failed call on this thread into buf (NUL-terminated, cut to
 * cap) and returns its full length; 0 when there is none. */
uint32_t kvpool_hixl_last_error(char *buf, uint32_t cap);

/* aclrtSetDevice(device_id) (skipped when negative), then hixl::Hixl::Initialize(local_engine,
 * options). local_engine is "ip", "ip:port" or "[v6]:port"; a port makes the engine listen.
 * The calling thread owns the ACL context from then on. */
kvpool_hixl_status kvpool_hixl_create(int32_t device_id, const char *local_engine,
                                      const kvpool_hixl_option *options, uint32_t n_options,
                                      kvpool_hixl_engine **out);

/* Finalize and free. Disconnect peers and deregister memory first. */
void kvpool_hixl_destroy(kvpool_hixl_engine *engine);

/* Give the calling thread the engine's ACL context (aclrtSetCurrentContext). */
kvpool_hixl_status kvpool_hixl_bind_thread(kvpool_hixl_engine *engine);

/* Memory HIXL accepts: aclrtMalloc(ACL_MEM_MALLOC_HUGE_ONLY) for device memory, aclrtMallocHost
 * for host memory. */
kvpool_hixl_status kvpool_hixl_malloc(kvpool_hixl_engine *engine, uint64_t len, uint32_t mem_type,
                                      uint64_t *addr);
kvpool_hixl_status kvpool_hixl_free(kvpool_hixl_engine *engine, uint64_t addr, uint32_t mem_type);

/* hixl::Hixl::RegisterMem / DeregisterMem. Register everything before connecting. */
kvpool_hixl_status kvpool_hixl_register_mem(kvpool_hixl_engine *engine, uint64_t addr, uint64_t len,
                                            uint32_t mem_type, uint64_t *handle);
kvpool_hixl_status kvpool_hixl_deregister_mem(kvpool_hixl_engine *engine, uint64_t handle);

/* hixl::Hixl::Connect / Disconnect with a remote engine name ("ip:port"). */
kvpool_hixl_status kvpool_hixl_connect(kvpool_hixl_engine *engine, const char *remote_engine,
                                       int32_t timeout_ms);
kvpool_hixl_status kvpool_hixl_disconnect(kvpool_hixl_engine *engine, const char *remote_engine,
                                          int32_t timeout_ms);

/* hixl::Hixl::TransferAsync: one descriptor list, one peer, one direction. *req is an opaque
 * request handle for transfer_status. */
kvpool_hixl_status kvpool_hixl_transfer_async(kvpool_hixl_engine *engine, const char *remote_engine,
                                              uint32_t op, const kvpool_hixl_desc *descs, uint32_t n,
                                              uint64_t *req);

/* hixl::Hixl::GetTransferStatus. A request reported COMPLETED or FAILED is freed: never query it
 * again. After disconnect from its peer a request is gone too. */
kvpool_hixl_status kvpool_hixl_transfer_status(kvpool_hixl_engine *engine, uint64_t req, uint32_t *state);

/* hixl::Hixl::TransferSync (the only mode that can stage host memory through the BufferPool). */
kvpool_hixl_status kvpool_hixl_transfer_sync(kvpool_hixl_engine *engine, const char *remote_engine,
                                             uint32_t op, const kvpool_hixl_desc *descs, uint32_t n,
                                             int32_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* KVPOOL_HIXL_SHIM_H_ */
