/*
 * The stand-in for the device runtimes kvpool-devmem loads: built twice by build.rs, core.c with
 * cuda.c (the CUDA runtime's symbols, as libcudart exports them, KVPOOL_STANDIN_CUDA defined) and
 * core.c with acl.c (Ascend ACL's, as libascendcl exports them, KVPOOL_STANDIN_ACL). It lets CI drive kvpool's side of
 * those ABIs for real without a GPU or NPU. It is not CUDA or ACL: it tests our side only.
 *
 * How it behaves like a device:
 *   - Device memory (cudaMalloc / aclrtMalloc) is a memfd mapped twice: at the address handed out,
 *     PROT_NONE (a host read or write of a device pointer kills the process, as on a GPU), and a
 *     second, private read-write mapping that only the copy workers use.
 *   - Pointer attributes say device (and which device) for that memory, host for registered host
 *     memory, managed for cudaMallocManaged memory, unregistered for everything else.
 *   - Copies are asynchronous for real: each stream has a worker thread that runs its queue in
 *     order, after an optional delay per copy (KVPOOL_DEVMEM_STANDIN_DELAY_US, or
 *     kvpool_devmem_standin_set_delay_us). Bytes read before an event or stream sync are stale.
 *   - Events complete when their stream's worker reaches them. A copy that fails while running
 *     (injected) is reported by the next event or sync of its stream, as CUDA reports async errors.
 *   - ACL needs a current device on the calling thread (aclrtSetDevice) before streams, copies
 *     and allocations, and aclrtHostRegister needs a 4 KiB-aligned address, as CANN documents.
 *   - Devices: KVPOOL_DEVMEM_STANDIN_DEVICES (default 2).
 *
 * Test controls (not part of either runtime): kvpool_devmem_standin_counters_get,
 * kvpool_devmem_standin_reset, kvpool_devmem_standin_set_delay_us, kvpool_devmem_standin_fail
 * (what: 0 the next copy calls return an error, 1 the next copies fail while running, 2 the next
 * host registrations fail), kvpool_devmem_standin_backend ("cuda" or "acl").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"

#if defined(KVPOOL_STANDIN_CUDA) == defined(KVPOOL_STANDIN_ACL)
#error "build with exactly one of KVPOOL_STANDIN_CUDA and KVPOOL_STANDIN_ACL"
#endif

#define MAX_ALLOCS 4096
#define MAX_PINS 4096

/* Mirrored by kvpool_devmem::standin::Counters. */
typedef struct {
  uint64_t copies_enqueued, copies_done, bytes, h2d, d2h;
  uint64_t stream_syncs, event_records, event_syncs;
  uint64_t host_registers, host_unregisters, register_refused;
  uint64_t unpinned_copies, failed_copies;
  uint64_t streams_created, streams_destroyed, set_device;
  uint64_t max_busy_streams;
} kvpool_devmem_standin_counters;

typedef struct {
  uintptr_t addr;
  size_t len, map_len;
  char *shadow; /* the workers' read-write view of device memory; NULL for managed memory */
  int device, managed;
} alloc_t;

typedef struct {
  uintptr_t addr;
  size_t len;
} pin_t;

struct event;
typedef struct op {
  struct op *next;
  char *dst;
  const char *src;
  size_t n;
  int fail;          /* an injected failure while running */
  struct event *ev;  /* NULL: a copy; else: an event to complete */
} op_t;

typedef struct stream {
  pthread_t th;
  pthread_cond_t cv;
  op_t *head, *tail;
  int stop, device;
  int error; /* a failure not yet reported by an event or a sync */
} stream_t;

typedef struct event {
  int pending, error;
  int destroyed; /* freed by the worker once it completes, as CUDA frees a pending event */
} event_t;

/* One lock for all state: the stand-in is for correctness, not speed. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static alloc_t g_alloc[MAX_ALLOCS];
static int g_nalloc;
static pin_t g_pin[MAX_PINS];
static int g_npin;
static kvpool_devmem_standin_counters g_c;
static int g_busy;
static uint32_t g_fail[3];
static _Atomic uint32_t g_delay_us;
static int g_devices;
static stream_t *g_default;

static __thread char t_msg[256];
#ifdef KVPOOL_STANDIN_CUDA
static __thread int t_device = 0; /* CUDA: device 0 is current until set */
#else
static __thread int t_device = -1; /* ACL: no context until aclrtSetDevice */
#endif

void say(const char *fmt, const char *what) { snprintf(t_msg, sizeof t_msg, fmt, what); }
const char *standin_message(void) { return t_msg; }
int standin_device(void) { return t_device; }
void standin_clear_device(int d) {
  if (t_device == d) t_device = -1;
}

/* The environment's settings, read once when the library is loaded. */
__attribute__((constructor)) static void init(void) {
  const char *d = getenv("KVPOOL_DEVMEM_STANDIN_DEVICES");
  g_devices = d ? atoi(d) : 2;
  const char *us = getenv("KVPOOL_DEVMEM_STANDIN_DELAY_US");
  if (us) atomic_store(&g_delay_us, (uint32_t)strtoul(us, NULL, 10));
}

static int devices(void) { return g_devices; }

/* The device allocation holding [p, p + n), or NULL. Called with g_mu held. */
static alloc_t *find_dev(uintptr_t p, size_t n) {
  for (int i = 0; i < g_nalloc; i++) {
    alloc_t *a = &g_alloc[i];
    if (!a->managed && p >= a->addr && p - a->addr <= a->len && n <= a->len - (p - a->addr)) return a;
  }
  return NULL;
}

/* Any allocation (device or managed) touching [p, p + n). Called with g_mu held. */
static alloc_t *touches(uintptr_t p, size_t n, int managed) {
  for (int i = 0; i < g_nalloc; i++) {
    alloc_t *a = &g_alloc[i];
    if (a->managed == managed && p < a->addr + a->len && a->addr < p + (n ? n : 1)) return a;
  }
  return NULL;
}

static int pinned(uintptr_t p, size_t n) {
  for (int i = 0; i < g_npin; i++)
    if (p >= g_pin[i].addr && p + n <= g_pin[i].addr + g_pin[i].len) return 1;
  return touches(p, n, 1) != NULL;
}

static void *worker(void *arg) {
  stream_t *s = arg;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &g_mu);
    if (!s->head) break; /* stopped and drained */
    op_t *o = s->head;
    pthread_mutex_unlock(&g_mu);
    if (!o->ev) {
      uint32_t us = atomic_load(&g_delay_us);
      if (us) usleep(us);
      if (!o->fail) memcpy(o->dst, o->src, o->n);
    }
    pthread_mutex_lock(&g_mu);
    if (o->ev) {
      o->ev->error = s->error;
      s->error = 0;
      o->ev->pending = 0;
      if (o->ev->destroyed) free(o->ev);
    } else if (o->fail) {
      s->error = 1;
      g_c.failed_copies++;
    } else {
      g_c.copies_done++;
    }
    s->head = o->next;
    if (!s->head) {
      s->tail = NULL;
      g_busy--;
    }
    free(o);
    pthread_cond_broadcast(&g_done);
  }
  pthread_mutex_unlock(&g_mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return NULL;
}

/* Queue an op; g_mu held. */
static void enqueue(stream_t *s, op_t *o) {
  if (!s->head) {
    s->head = o;
    if (++g_busy > (int)g_c.max_busy_streams) g_c.max_busy_streams = (uint64_t)g_busy;
  } else {
    s->tail->next = o;
  }
  s->tail = o;
  pthread_cond_signal(&s->cv);
}

static stream_t *stream_new(int device) {
  stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->device = device;
  pthread_cond_init(&s->cv, NULL);
  if (pthread_create(&s->th, NULL, worker, s) != 0) {
    free(s);
    return NULL;
  }
  g_c.streams_created++;
  return s;
}

/* Wait for a stream's queue to drain and take its unreported error; g_mu held. */
static int drain(stream_t *s) {
  while (s->head) pthread_cond_wait(&g_done, &g_mu);
  int e = s->error;
  s->error = 0;
  return e;
}

/* As cudaStreamDestroy and aclrtDestroyStream: returns at once; the queued work still runs, then
 * the worker frees the stream (so a destroy cannot hide a missing sync either). */
void stream_free(void *stream) {
  stream_t *s = stream;
  pthread_mutex_lock(&g_mu);
  pthread_t th = s->th; /* s may be gone once the lock is released */
  s->stop = 1;
  pthread_cond_signal(&s->cv);
  g_c.streams_destroyed++;
  pthread_mutex_unlock(&g_mu);
  pthread_detach(th);
}

int dev_malloc(void **out, size_t size, int device, int managed) {
  if (!out || size == 0) return E_VALUE;
  long page = sysconf(_SC_PAGESIZE);
  size_t map_len = (size + (size_t)page - 1) / (size_t)page * (size_t)page;
  alloc_t a = {.len = size, .map_len = map_len, .device = device, .managed = managed};
  if (managed) {
    void *p = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return E_ALLOC;
    a.addr = (uintptr_t)p;
  } else {
    int fd = memfd_create("kvpool-devmem-standin", MFD_CLOEXEC);
    if (fd < 0) return E_ALLOC;
    if (ftruncate(fd, (off_t)map_len) != 0) {
      close(fd);
      return E_ALLOC;
    }
    void *user = mmap(NULL, map_len, PROT_NONE, MAP_SHARED, fd, 0);
    void *shadow = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (user == MAP_FAILED || shadow == MAP_FAILED) {
      if (user != MAP_FAILED) munmap(user, map_len);
      if (shadow != MAP_FAILED) munmap(shadow, map_len);
      return E_ALLOC;
    }
    a.addr = (uintptr_t)user;
    a.shadow = shadow;
  }
  pthread_mutex_lock(&g_mu);
  if (g_nalloc == MAX_ALLOCS) {
    pthread_mutex_unlock(&g_mu);
    munmap((void *)a.addr, map_len);
    if (a.shadow) munmap(a.shadow, map_len);
    return E_ALLOC;
  }
  g_alloc[g_nalloc++] = a;
  pthread_mutex_unlock(&g_mu);
  *out = (void *)a.addr;
  return OK;
}

int dev_free(void *p) {
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < g_nalloc; i++) {
    if (g_alloc[i].addr == (uintptr_t)p) {
      alloc_t a = g_alloc[i];
      g_alloc[i] = g_alloc[--g_nalloc];
      pthread_mutex_unlock(&g_mu);
      munmap((void *)a.addr, a.map_len);
      if (a.shadow) munmap(a.shadow, a.map_len);
      return OK;
    }
  }
  pthread_mutex_unlock(&g_mu);
  say("%s is not an allocation of this runtime", "the pointer");
  return E_VALUE;
}

/* Resolve a host<->device copy to worker addresses; g_mu held. h2d: 1 host to device, 0 device
 * to host. */
static int resolve(int h2d, void *dst, const void *src, size_t n, char **wdst, const char **wsrc) {
  uintptr_t dev = (uintptr_t)(h2d ? dst : src), host = (uintptr_t)(h2d ? src : dst);
  alloc_t *a = find_dev(dev, n);
  if (!a) {
    say("%s is not inside one device allocation", h2d ? "the destination" : "the source");
    return E_VALUE;
  }
  if (touches(host, n, 0)) {
    say("%s is device memory", h2d ? "the source" : "the destination");
    return E_VALUE;
  }
  char *d = a->shadow + (dev - a->addr);
  if (h2d) {
    *wdst = d;
    *wsrc = (const char *)host;
  } else {
    *wdst = (char *)host;
    *wsrc = d;
  }
  return OK;
}

int copy_async(void *dst, const void *src, size_t n, int h2d, void *stream) {
  stream_t *s = stream;
  pthread_mutex_lock(&g_mu);
  if (g_fail[0]) {
    g_fail[0]--;
    pthread_mutex_unlock(&g_mu);
    say("%s", "stand-in: injected copy failure");
    return E_INJECTED;
  }
  if (!s) {
    if (!g_default) g_default = stream_new(t_device < 0 ? 0 : t_device);
    s = g_default;
  }
  char *wd;
  const char *ws;
  int rc = resolve(h2d, dst, src, n, &wd, &ws);
  if (rc != OK) {
    pthread_mutex_unlock(&g_mu);
    return rc;
  }
  op_t *o = calloc(1, sizeof *o);
  if (!o) {
    pthread_mutex_unlock(&g_mu);
    return E_ALLOC;
  }
  o->dst = wd;
  o->src = ws;
  o->n = n;
  if (g_fail[1]) {
    g_fail[1]--;
    o->fail = 1;
  }
  uintptr_t host = (uintptr_t)(h2d ? src : dst);
  if (!pinned(host, n)) g_c.unpinned_copies++;
  g_c.copies_enqueued++;
  g_c.bytes += n;
  if (h2d)
    g_c.h2d++;
  else
    g_c.d2h++;
  enqueue(s, o);
  pthread_mutex_unlock(&g_mu);
  return OK;
}

int copy_sync(void *dst, const void *src, size_t n, int h2d) {
  pthread_mutex_lock(&g_mu);
  char *wd;
  const char *ws;
  int rc = resolve(h2d, dst, src, n, &wd, &ws);
  if (rc == OK) memcpy(wd, ws, n);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int host_register(void *p, size_t n, size_t align) {
  uintptr_t a = (uintptr_t)p;
  pthread_mutex_lock(&g_mu);
  int rc = OK;
  if (g_fail[2]) {
    g_fail[2]--;
    say("%s", "stand-in: injected host registration failure");
    rc = E_INJECTED;
  } else if (!p || n == 0) {
    say("%s", "empty host range");
    rc = E_VALUE;
  } else if (align && a % align) {
    say("%s", "the host address must be 4 KiB aligned");
    rc = E_ALIGN;
  } else if (touches(a, n, 0)) {
    say("%s", "that is device memory");
    rc = E_VALUE;
  } else if (g_npin == MAX_PINS) {
    rc = E_ALLOC;
  } else {
    for (int i = 0; i < g_npin; i++)
      if (a < g_pin[i].addr + g_pin[i].len && g_pin[i].addr < a + n) rc = E_PINNED_TWICE;
    if (rc == OK) g_pin[g_npin++] = (pin_t){a, n};
    else say("%s", "part of the range is registered already");
  }
  if (rc == OK)
    g_c.host_registers++;
  else
    g_c.register_refused++;
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int host_unregister(void *p) {
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < g_npin; i++) {
    if (g_pin[i].addr == (uintptr_t)p) {
      g_pin[i] = g_pin[--g_npin];
      g_c.host_unregisters++;
      pthread_mutex_unlock(&g_mu);
      return OK;
    }
  }
  pthread_mutex_unlock(&g_mu);
  say("%s", "no host registration starts there");
  return E_NOT_PINNED;
}

/* 0 unregistered, 1 registered host, 2 device, 3 managed; *device set for device memory. */
int classify(const void *p, int *device) {
  uintptr_t a = (uintptr_t)p;
  pthread_mutex_lock(&g_mu);
  int kind = 0;
  alloc_t *d = find_dev(a, 1);
  if (d) {
    kind = 2;
    *device = d->device;
  } else if (touches(a, 1, 1)) {
    kind = 3;
  } else if (pinned(a, 1)) {
    kind = 1;
  }
  pthread_mutex_unlock(&g_mu);
  return kind;
}

int event_wait(void *ev) {
  event_t *e = ev;
  pthread_mutex_lock(&g_mu);
  while (e->pending) pthread_cond_wait(&g_done, &g_mu);
  g_c.event_syncs++;
  int err = e->error;
  e->error = 0;
  pthread_mutex_unlock(&g_mu);
  return err ? E_EXEC : OK;
}

int event_record(void *ev, void *stream) {
  event_t *e = ev;
  stream_t *s = stream;
  op_t *o = calloc(1, sizeof *o);
  if (!e || !o) {
    free(o);
    return E_VALUE;
  }
  pthread_mutex_lock(&g_mu);
  if (!s) {
    if (!g_default) g_default = stream_new(t_device < 0 ? 0 : t_device);
    s = g_default;
  }
  /* Waiting for an earlier recording first keeps one op per event in flight. */
  while (e->pending) pthread_cond_wait(&g_done, &g_mu);
  e->pending = 1;
  o->ev = e;
  g_c.event_records++;
  enqueue(s, o);
  pthread_mutex_unlock(&g_mu);
  return OK;
}

void *stream_create(int device) {
  pthread_mutex_lock(&g_mu);
  stream_t *s = stream_new(device);
  pthread_mutex_unlock(&g_mu);
  return s;
}

void *event_new(void) { return calloc(1, sizeof(event_t)); }

/* CUDA returns at once and frees a pending event once it completes: so does the stand-in (a
 * destroy never waits for copies, so it cannot hide a missing sync). */
void event_free(void *ev) {
  event_t *e = ev;
  pthread_mutex_lock(&g_mu);
  if (e->pending)
    e->destroyed = 1;
  else
    free(e);
  pthread_mutex_unlock(&g_mu);
}

int stream_sync(void *stream) {
  stream_t *s = stream;
  pthread_mutex_lock(&g_mu);
  int err = drain(s);
  g_c.stream_syncs++;
  pthread_mutex_unlock(&g_mu);
  return err ? E_EXEC : OK;
}

int set_device(int d) {
  if (d < 0 || d >= devices()) {
    say("%s", "no such device");
    return E_DEVICE;
  }
  t_device = d;
  pthread_mutex_lock(&g_mu);
  g_c.set_device++;
  pthread_mutex_unlock(&g_mu);
  return OK;
}

EXPORT void kvpool_devmem_standin_counters_get(kvpool_devmem_standin_counters *out) {
  pthread_mutex_lock(&g_mu);
  *out = g_c;
  pthread_mutex_unlock(&g_mu);
}

/* Zero the counters and clear injected faults; the delay goes back to the environment's. */
EXPORT void kvpool_devmem_standin_reset(void) {
  pthread_mutex_lock(&g_mu);
  memset(&g_c, 0, sizeof g_c);
  g_c.max_busy_streams = (uint64_t)g_busy;
  memset(g_fail, 0, sizeof g_fail);
  const char *us = getenv("KVPOOL_DEVMEM_STANDIN_DELAY_US");
  atomic_store(&g_delay_us, us ? (uint32_t)strtoul(us, NULL, 10) : 0);
  pthread_mutex_unlock(&g_mu);
}

EXPORT void kvpool_devmem_standin_set_delay_us(uint32_t us) { atomic_store(&g_delay_us, us); }

EXPORT void kvpool_devmem_standin_fail(uint32_t what, uint32_t count) {
  pthread_mutex_lock(&g_mu);
  if (what < 3) g_fail[what] = count;
  pthread_mutex_unlock(&g_mu);
}

