/*
 * The real kvpool HIXL shim: kvpool_hixl_shim.h over CANN's hixl::Hixl (include/hixl/hixl.h,
 * libcann_hixl.so) and ACL (acl/acl.h).
 *
 * NOT VERIFIED: written against hixl.h / hixl_types.h as published by hicann/hixl and the HIXL
 * interface documentation; it has never been compiled against a CANN install nor run on Ascend
 * hardware. kvpool-hixl's build script compiles it only where CANN's headers are found.
 *
 * No exception may cross the C boundary: every entry point catches and turns it into FAILED.
 */
#include "kvpool_hixl_shim.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "hixl/hixl.h"

struct kvpool_hixl_engine {
  hixl::Hixl hixl;
  int32_t device_id = -1;
  aclrtContext context = nullptr;
};

namespace {

thread_local std::string g_last_error;

// Records what failed, with ACL's own recent message when it has one (it often names the cause:
// a missing /etc/hccn.conf, an unsupported option...).
kvpool_hixl_status Fail(kvpool_hixl_status status, const std::string &what) {
  g_last_error = what;
  const char *acl = aclGetRecentErrMsg();
  if (acl != nullptr && acl[0] != '\0') {
    g_last_error += " [ACL: ";
    g_last_error += acl;
    g_last_error += "]";
  }
  return status;
}

kvpool_hixl_status Check(hixl::Status status, const std::string &what) {
  if (status == hixl::SUCCESS) {
    return KVPOOL_HIXL_SUCCESS;
  }
  return Fail(status, what + " returned " + std::to_string(status));
}

hixl::MemType ToMemType(uint32_t mem_type) {
  return mem_type == KVPOOL_HIXL_MEM_DEVICE ? hixl::MEM_DEVICE : hixl::MEM_HOST;
}

std::vector<hixl::TransferOpDesc> ToDescs(const kvpool_hixl_desc *descs, uint32_t n) {
  std::vector<hixl::TransferOpDesc> out(n);
  for (uint32_t i = 0; i < n; ++i) {
    out[i].local_addr = static_cast<uintptr_t>(descs[i].local_addr);
    out[i].remote_addr = static_cast<uintptr_t>(descs[i].remote_addr);
    out[i].len = static_cast<size_t>(descs[i].len);
  }
  return out;
}

template <typename F>
kvpool_hixl_status Guard(const char *call, F &&body) {
  try {
    return body();
  } catch (const std::exception &e) {
    return Fail(KVPOOL_HIXL_FAILED, std::string(call) + ": exception: " + e.what());
  } catch (...) {
    return Fail(KVPOOL_HIXL_FAILED, std::string(call) + ": unknown exception");
  }
}

}  // namespace

extern "C" {

uint32_t kvpool_hixl_abi_version(void) { return KVPOOL_HIXL_ABI_VERSION; }

const char *kvpool_hixl_backend(void) { return "hixl"; }

uint32_t kvpool_hixl_last_error(char *buf, uint32_t cap) {
  const std::string &m = g_last_error;
  if (buf != nullptr && cap > 0) {
    size_t n = m.size() < cap - 1 ? m.size() : cap - 1;
    std::memcpy(buf, m.data(), n);
    buf[n] = '\0';
  }
  return static_cast<uint32_t>(m.size());
}

kvpool_hixl_status kvpool_hixl_create(int32_t device_id, const char *local_engine,
                                      const kvpool_hixl_option *options, uint32_t n_options,
                                      kvpool_hixl_engine **out) {
  return Guard("create", [&]() -> kvpool_hixl_status {
    if (local_engine == nullptr || out == nullptr || (options == nullptr && n_options > 0)) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "create: null argument");
    }
    std::map<hixl::AscendString, hixl::AscendString> opts;
    for (uint32_t i = 0; i < n_options; ++i) {
      const char *k = options[i].key;
      const char *v = options[i].value;
      if (k == nullptr || v == nullptr) {
        return Fail(KVPOOL_HIXL_PARAM_INVALID, "create: null option key or value");
      }
      if (std::strncmp(k, "env:", 4) == 0) {
        // Read by HCCL when the engine initialises; an operator's own setting wins.
        setenv(k + 4, v, 0);
      } else {
        opts[hixl::AscendString(k)] = hixl::AscendString(v);
      }
    }
    if (device_id >= 0) {
      aclError r = aclrtSetDevice(device_id);
      if (r != ACL_SUCCESS) {
        return Fail(KVPOOL_HIXL_FAILED, "aclrtSetDevice(" + std::to_string(device_id) + ") returned " +
                                            std::to_string(r));
      }
    }
    kvpool_hixl_engine *e = new (std::nothrow) kvpool_hixl_engine();
    if (e == nullptr) {
      return Fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "create: out of memory");
    }
    e->device_id = device_id;
    aclError r = aclrtGetCurrentContext(&e->context);
    if (r != ACL_SUCCESS) {
      delete e;
      return Fail(KVPOOL_HIXL_FAILED, "aclrtGetCurrentContext returned " + std::to_string(r) +
                                          " (no device set on this thread?)");
    }
    kvpool_hixl_status st = Check(e->hixl.Initialize(hixl::AscendString(local_engine), opts),
                                  std::string("Initialize(") + local_engine + ")");
    if (st != KVPOOL_HIXL_SUCCESS) {
      delete e;
      return st;
    }
    *out = e;
    return KVPOOL_HIXL_SUCCESS;
  });
}

void kvpool_hixl_destroy(kvpool_hixl_engine *engine) {
  if (engine == nullptr) {
    return;
  }
  try {
    engine->hixl.Finalize();
  } catch (...) {
  }
  // The device is not reset: other users of it in this process (the inference engine) keep it.
  delete engine;
}

kvpool_hixl_status kvpool_hixl_bind_thread(kvpool_hixl_engine *engine) {
  if (engine == nullptr) {
    return Fail(KVPOOL_HIXL_PARAM_INVALID, "bind_thread: null engine");
  }
  aclError r = aclrtSetCurrentContext(engine->context);
  if (r != ACL_SUCCESS) {
    return Fail(KVPOOL_HIXL_FAILED, "aclrtSetCurrentContext returned " + std::to_string(r));
  }
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_malloc(kvpool_hixl_engine *engine, uint64_t len, uint32_t mem_type,
                                      uint64_t *addr) {
  if (engine == nullptr || addr == nullptr || len == 0) {
    return Fail(KVPOOL_HIXL_PARAM_INVALID, "malloc: null argument or zero length");
  }
  void *p = nullptr;
  aclError r;
  if (mem_type == KVPOOL_HIXL_MEM_DEVICE) {
    // HCCS transfers need huge-page device memory.
    r = aclrtMalloc(&p, static_cast<size_t>(len), ACL_MEM_MALLOC_HUGE_ONLY);
  } else {
    r = aclrtMallocHost(&p, static_cast<size_t>(len));
  }
  if (r != ACL_SUCCESS) {
    return Fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED,
                std::string(mem_type == KVPOOL_HIXL_MEM_DEVICE ? "aclrtMalloc" : "aclrtMallocHost") +
                    "(" + std::to_string(len) + ") returned " + std::to_string(r));
  }
  *addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_free(kvpool_hixl_engine *engine, uint64_t addr, uint32_t mem_type) {
  if (engine == nullptr) {
    return Fail(KVPOOL_HIXL_PARAM_INVALID, "free: null engine");
  }
  void *p = reinterpret_cast<void *>(static_cast<uintptr_t>(addr));
  aclError r = mem_type == KVPOOL_HIXL_MEM_DEVICE ? aclrtFree(p) : aclrtFreeHost(p);
  if (r != ACL_SUCCESS) {
    return Fail(KVPOOL_HIXL_FAILED, "aclrtFree returned " + std::to_string(r));
  }
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_register_mem(kvpool_hixl_engine *engine, uint64_t addr, uint64_t len,
                                            uint32_t mem_type, uint64_t *handle) {
  return Guard("register_mem", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || handle == nullptr) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "register_mem: null argument");
    }
    hixl::MemDesc desc{};
    desc.addr = static_cast<uintptr_t>(addr);
    desc.len = static_cast<size_t>(len);
    hixl::MemHandle h = nullptr;
    kvpool_hixl_status st = Check(engine->hixl.RegisterMem(desc, ToMemType(mem_type), h), "RegisterMem");
    if (st == KVPOOL_HIXL_SUCCESS) {
      *handle = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h));
    }
    return st;
  });
}

kvpool_hixl_status kvpool_hixl_deregister_mem(kvpool_hixl_engine *engine, uint64_t handle) {
  return Guard("deregister_mem", [&]() -> kvpool_hixl_status {
    if (engine == nullptr) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "deregister_mem: null engine");
    }
    hixl::MemHandle h = reinterpret_cast<hixl::MemHandle>(static_cast<uintptr_t>(handle));
    return Check(engine->hixl.DeregisterMem(h), "DeregisterMem");
  });
}

kvpool_hixl_status kvpool_hixl_connect(kvpool_hixl_engine *engine, const char *remote_engine,
                                       int32_t timeout_ms) {
  return Guard("connect", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || remote_engine == nullptr) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "connect: null argument");
    }
    return Check(engine->hixl.Connect(hixl::AscendString(remote_engine), timeout_ms),
                 std::string("Connect(") + remote_engine + ")");
  });
}

kvpool_hixl_status kvpool_hixl_disconnect(kvpool_hixl_engine *engine, const char *remote_engine,
                                          int32_t timeout_ms) {
  return Guard("disconnect", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || remote_engine == nullptr) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "disconnect: null argument");
    }
    return Check(engine->hixl.Disconnect(hixl::AscendString(remote_engine), timeout_ms),
                 std::string("Disconnect(") + remote_engine + ")");
  });
}

kvpool_hixl_status kvpool_hixl_transfer_async(kvpool_hixl_engine *engine, const char *remote_engine,
                                              uint32_t op, const kvpool_hixl_desc *descs, uint32_t n,
                                              uint64_t *req) {
  return Guard("transfer_async", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || remote_engine == nullptr || req == nullptr || (descs == nullptr && n > 0)) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_async: null argument");
    }
    std::vector<hixl::TransferOpDesc> v = ToDescs(descs, n);
    hixl::TransferArgs args{};
    hixl::TransferReq r = nullptr;
    hixl::TransferOp o = op == KVPOOL_HIXL_READ ? hixl::READ : hixl::WRITE;
    kvpool_hixl_status st = Check(engine->hixl.TransferAsync(hixl::AscendString(remote_engine), o, v, args, r),
                                  std::string("TransferAsync(") + remote_engine + ")");
    if (st == KVPOOL_HIXL_SUCCESS) {
      *req = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(r));
    }
    return st;
  });
}

kvpool_hixl_status kvpool_hixl_transfer_status(kvpool_hixl_engine *engine, uint64_t req, uint32_t *state) {
  return Guard("transfer_status", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || state == nullptr) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_status: null argument");
    }
    hixl::TransferReq r = reinterpret_cast<hixl::TransferReq>(static_cast<uintptr_t>(req));
    hixl::TransferStatus s = hixl::TransferStatus::WAITING;
    kvpool_hixl_status st = Check(engine->hixl.GetTransferStatus(r, s), "GetTransferStatus");
    if (st != KVPOOL_HIXL_SUCCESS) {
      return st;
    }
    switch (s) {
      case hixl::TransferStatus::WAITING:
        *state = KVPOOL_HIXL_XFER_WAITING;
        break;
      case hixl::TransferStatus::COMPLETED:
        *state = KVPOOL_HIXL_XFER_COMPLETED;
        break;
      case hixl::TransferStatus::TIMEOUT:
        *state = KVPOOL_HIXL_XFER_TIMEOUT;
        break;
      default:
        *state = KVPOOL_HIXL_XFER_FAILED;
        break;
    }
    return KVPOOL_HIXL_SUCCESS;
  });
}

kvpool_hixl_status kvpool_hixl_transfer_sync(kvpool_hixl_engine *engine, const char *remote_engine,
                                             uint32_t op, const kvpool_hixl_desc *descs, uint32_t n,
                                             int32_t timeout_ms) {
  return Guard("transfer_sync", [&]() -> kvpool_hixl_status {
    if (engine == nullptr || remote_engine == nullptr || (descs == nullptr && n > 0)) {
      return Fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_sync: null argument");
    }
    std::vector<hixl::TransferOpDesc> v = ToDescs(descs, n);
    hixl::TransferOp o = op == KVPOOL_HIXL_READ ? hixl::READ : hixl::WRITE;
    return Check(engine->hixl.TransferSync(hixl::AscendString(remote_engine), o, v, timeout_ms),
                 std::string("TransferSync(") + remote_engine + ")");
  });
}

}  // extern "C"
