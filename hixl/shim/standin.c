/*
 * The stand-in for kvpool's HIXL shim: the same C ABI (kvpool_hixl_shim.h), implemented with memcpy
 * over POSIX shared memory between processes of one host. It lets CI drive kvpool's side of the
 * ABI for real (separate processes, real memory, real asynchrony) without CANN or Ascend devices.
 * It is not HIXL: it tests our side only.
 *
 * How it maps HIXL:
 *   - malloc: a shared-memory object (/dev/shm/kvpool-hixl-m-<pid>-<n>) mapped at an address
 *     aligned like HIXL wants (64 KiB host, 2 MiB device), standing for aclrtMallocHost/aclrtMalloc.
 *   - create: publishes a directory object named after the engine ("ip:port") listing registered
 *     memory (seqlock-protected); a second live engine of the same name is refused (port taken).
 *   - register: memory must come from malloc; it is added to the directory.
 *   - connect: maps the peer's directory and every region it lists at that moment (memory the
 *     peer registers later is not reachable until a reconnect, as in HIXL); waits for the peer
 *     up to timeout_ms, then TIMEOUT.
 *   - transfer_async: checks every address against registered memory on both sides, queues the
 *     request to a worker thread that copies; transfer_status reports it, and frees it once it is
 *     reported COMPLETED or FAILED. disconnect fails and forgets the peer's requests.
 *   - every call must come from the creating thread or one that called bind_thread (HIXL needs
 *     the ACL context on the calling thread); others fail and are counted.
 *
 * Test controls (not part of the ABI): kvpool_hixl_standin_inject(engine, spec) and the
 * KVPOOL_HIXL_STANDIN_FAULTS environment variable (read at create) take faults separated by ';':
 *   <point>=<status>[:<count>]  with point one of create, register, connect, transfer, status,
 *                               disconnect: that call returns <status> (count times, default 1);
 *   xfer_fail=<count>           the next requests end FAILED without copying;
 *   stall_ms=<ms>[:<count>]     the next requests wait that long (or until disconnected) first;
 *   clear                       removes every fault.
 * kvpool_hixl_standin_counters reports what the library saw (calls, descriptors, bytes...), and
 * kvpool_hixl_standin_option returns an option as create received it.
 */
#define _GNU_SOURCE
#include "kvpool_hixl_shim.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Built a second time with another value to test that kvpool refuses a mismatched library. */
#ifndef KVPOOL_HIXL_STANDIN_ABI
#define KVPOOL_HIXL_STANDIN_ABI KVPOOL_HIXL_ABI_VERSION
#endif

#define MAX_REGIONS 4096
#define SHM_NAME 64
#define DIR_MAGIC 0x314c5848504b564bull /* "KVPKHXL1" */
#define PAGE 4096u

typedef struct {
  uint64_t addr, len;
  uint32_t mem_type, live;
  char shm[SHM_NAME];
  uint64_t shm_off;
} dir_region;

/* The published directory of an engine. */
typedef struct {
  uint64_t magic;
  uint32_t abi;
  int32_t pid;
  _Atomic uint32_t alive;
  _Atomic uint64_t seq; /* odd while the owner rewrites regions */
  uint32_t n;
  dir_region r[MAX_REGIONS];
} directory;

typedef struct {
  uint64_t transfer_calls, descs, bytes, max_descs_per_call, sync_calls, connects, disconnects, registers,
      deregisters, status_calls, stale_status, wrong_thread, max_outstanding;
} kvpool_hixl_standin_counters;

typedef struct alloc {
  uint64_t addr, len, map_len;
  uint32_t mem_type;
  char shm[SHM_NAME];
  struct alloc *next;
} alloc;

typedef struct {
  uint64_t addr, len;
  uint8_t *ptr;        /* where the region's first byte is mapped here */
  void *map;           /* the mapping (page aligned) */
  size_t map_len;
} peer_region;

typedef struct peer {
  char *name;
  const directory *dir;
  uint32_t n;
  peer_region *regions;
  int refs; /* the engine's list holds one; each request holds one */
  struct peer *next;
} peer;

typedef struct req {
  uint64_t id;
  peer *peer;
  uint32_t op, n;
  kvpool_hixl_desc *descs;
  uint8_t **remote; /* resolved remote pointers, one per descriptor */
  uint32_t state;
  int aborted;
  int listed;   /* reachable through transfer_status */
  int queued;   /* owned by the worker (queued or running) */
  int waiter;   /* a transfer_sync caller waits on it */
  struct req *next_all, *next_q;
} req;

typedef struct fault {
  char point[16];
  uint32_t status;
  int count;
} fault;

struct kvpool_hixl_engine {
  pthread_t creator;
  char *name;
  int listen_fd; /* the engine's port, held as HIXL's listener would hold it */
  char dir_shm[SHM_NAME + 192];
  directory *dir;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t worker;
  int worker_started;
  int shutdown;
  alloc *allocs;
  peer *peers;
  req *all, *q_head, *q_tail;
  uint64_t next_req;
  fault faults[16];
  int n_faults;
  int xfer_fail;
  int stall_ms, stall_count;
  kvpool_hixl_standin_counters c;
  uint64_t outstanding; /* requests submitted and not yet reported or dropped */
  char **opt_keys, **opt_vals;
  uint32_t n_opts;
};

static __thread char t_err[512];
static __thread kvpool_hixl_engine *t_bound;

static kvpool_hixl_status fail(kvpool_hixl_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_err, sizeof t_err, fmt, ap);
  va_end(ap);
  return st;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void deadline_in(struct timespec *ts, int ms) {
  clock_gettime(CLOCK_REALTIME, ts);
  ts->tv_sec += ms / 1000;
  ts->tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec += 1;
    ts->tv_nsec -= 1000000000L;
  }
}

static int pid_alive(int pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

static void dir_name(const char *engine, char *out, size_t cap) {
  size_t o = (size_t)snprintf(out, cap, "/kvpool-hixl-e-");
  for (const char *p = engine; *p && o + 1 < cap; ++p) {
    char ch = *p;
    out[o++] = ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')) ? ch : '_';
  }
  out[o] = '\0';
}

/* ACL contexts are per thread: HIXL calls from a thread without one fail. */
static int wrong_thread(kvpool_hixl_engine *e) {
  if (pthread_equal(pthread_self(), e->creator) || t_bound == e) return 0;
  pthread_mutex_lock(&e->mu);
  e->c.wrong_thread++;
  pthread_mutex_unlock(&e->mu);
  fail(KVPOOL_HIXL_FAILED, "calling thread has no ACL context (not the creating thread, and bind_thread was not called)");
  return 1;
}

/* Consumes a fault for `point`; returns its status or SUCCESS. Caller holds mu. */
static kvpool_hixl_status take_fault(kvpool_hixl_engine *e, const char *point) {
  for (int i = 0; i < e->n_faults; ++i) {
    fault *f = &e->faults[i];
    if (f->count != 0 && strcmp(f->point, point) == 0) {
      if (f->count > 0) f->count--;
      return fail(f->status, "injected fault: %s returns %u", point, f->status);
    }
  }
  return KVPOOL_HIXL_SUCCESS;
}

static int parse_faults(kvpool_hixl_engine *e, const char *spec) {
  char buf[512];
  snprintf(buf, sizeof buf, "%s", spec);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
    while (*tok == ' ') tok++;
    if (*tok == '\0') continue;
    if (strcmp(tok, "clear") == 0) {
      e->n_faults = 0;
      e->xfer_fail = 0;
      e->stall_ms = 0;
      e->stall_count = 0;
      continue;
    }
    char *eq = strchr(tok, '=');
    if (!eq) return -1;
    *eq = '\0';
    char *val = eq + 1;
    char *colon = strchr(val, ':');
    int count = 1;
    if (colon) {
      *colon = '\0';
      count = atoi(colon + 1);
    }
    if (strcmp(tok, "xfer_fail") == 0) {
      e->xfer_fail = atoi(val);
    } else if (strcmp(tok, "stall_ms") == 0) {
      e->stall_ms = atoi(val);
      e->stall_count = count;
    } else {
      if (e->n_faults == 16 || strlen(tok) >= sizeof e->faults[0].point) return -1;
      fault *f = &e->faults[e->n_faults++];
      snprintf(f->point, sizeof f->point, "%s", tok);
      f->status = (uint32_t)strtoul(val, NULL, 10);
      f->count = count;
    }
  }
  return 0;
}

/* Names left in /dev/shm by processes that died without destroy (tests kill peers on purpose). */
static void sweep_stale(void) {
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    int pid = 0;
    char path[300];
    if (sscanf(de->d_name, "kvpool-hixl-m-%d-", &pid) == 1) {
      snprintf(path, sizeof path, "/%s", de->d_name);
      if (!pid_alive(pid)) shm_unlink(path);
    } else if (strncmp(de->d_name, "kvpool-hixl-e-", 14) == 0) {
      snprintf(path, sizeof path, "/%s", de->d_name);
      int fd = shm_open(path, O_RDONLY, 0);
      if (fd < 0) continue;
      struct stat st;
      if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(directory)) {
        directory *dir = mmap(NULL, sizeof(directory), PROT_READ, MAP_SHARED, fd, 0);
        if (dir != MAP_FAILED) {
          if (!pid_alive(dir->pid)) shm_unlink(path);
          munmap(dir, sizeof(directory));
        }
      }
      close(fd);
    }
  }
  closedir(d);
}

/* ---- requests ---- */

static void peer_unref(peer *p) {
  if (--p->refs > 0) return;
  for (uint32_t i = 0; i < p->n; ++i) munmap(p->regions[i].map, p->regions[i].map_len);
  if (p->dir) munmap((void *)p->dir, sizeof(directory));
  free(p->regions);
  free(p->name);
  free(p);
}

static void req_free_if_unowned(kvpool_hixl_engine *e, req *r) {
  if (r->listed || r->queued || r->waiter) return;
  (void)e;
  peer_unref(r->peer);
  free(r->descs);
  free(r->remote);
  free(r);
}

static void unlist(kvpool_hixl_engine *e, req *r) {
  if (r->listed) e->outstanding--;
  for (req **pp = &e->all; *pp; pp = &(*pp)->next_all) {
    if (*pp == r) {
      *pp = r->next_all;
      break;
    }
  }
  r->listed = 0;
}

static void *worker_main(void *arg) {
  kvpool_hixl_engine *e = arg;
  pthread_mutex_lock(&e->mu);
  for (;;) {
    while (!e->shutdown && !e->q_head) pthread_cond_wait(&e->cv, &e->mu);
    if (!e->q_head) break;
    req *r = e->q_head;
    e->q_head = r->next_q;
    if (!e->q_head) e->q_tail = NULL;
    int fail_it = 0;
    if (!r->aborted && e->xfer_fail > 0) {
      e->xfer_fail--;
      fail_it = 1;
    }
    if (!r->aborted && e->stall_ms > 0 && e->stall_count != 0) {
      if (e->stall_count > 0) e->stall_count--;
      struct timespec ts;
      deadline_in(&ts, e->stall_ms);
      while (!r->aborted && !e->shutdown) {
        if (pthread_cond_timedwait(&e->cv, &e->mu, &ts) == ETIMEDOUT) break;
      }
    }
    if (!r->aborted && !fail_it) {
      pthread_mutex_unlock(&e->mu);
      for (uint32_t i = 0; i < r->n && !__atomic_load_n(&r->aborted, __ATOMIC_RELAXED); ++i) {
        uint8_t *local = (uint8_t *)(uintptr_t)r->descs[i].local_addr;
        if (r->op == KVPOOL_HIXL_WRITE)
          memcpy(r->remote[i], local, r->descs[i].len);
        else
          memcpy(local, r->remote[i], r->descs[i].len);
      }
      pthread_mutex_lock(&e->mu);
    }
    r->state = (r->aborted || fail_it) ? KVPOOL_HIXL_XFER_FAILED : KVPOOL_HIXL_XFER_COMPLETED;
    r->queued = 0;
    req_free_if_unowned(e, r);
    pthread_cond_broadcast(&e->cv);
  }
  pthread_mutex_unlock(&e->mu);
  return NULL;
}

/* ---- ABI ---- */

uint32_t kvpool_hixl_abi_version(void) { return KVPOOL_HIXL_STANDIN_ABI; }

const char *kvpool_hixl_backend(void) { return "standin"; }

uint32_t kvpool_hixl_last_error(char *buf, uint32_t cap) {
  size_t n = strlen(t_err);
  if (buf && cap > 0) {
    size_t k = n < cap - 1 ? n : cap - 1;
    memcpy(buf, t_err, k);
    buf[k] = '\0';
  }
  return (uint32_t)n;
}

kvpool_hixl_status kvpool_hixl_create(int32_t device_id, const char *local_engine,
                                      const kvpool_hixl_option *options, uint32_t n_options,
                                      kvpool_hixl_engine **out) {
  (void)device_id;
  if (!local_engine || !*local_engine || !out || (!options && n_options))
    return fail(KVPOOL_HIXL_PARAM_INVALID, "create: null argument or empty engine name");
  sweep_stale();
  kvpool_hixl_engine *e = calloc(1, sizeof *e);
  if (!e) return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "create: out of memory");
  e->creator = pthread_self();
  e->name = strdup(local_engine);
  e->listen_fd = -1;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->opt_keys = calloc(n_options + 1, sizeof(char *));
  e->opt_vals = calloc(n_options + 1, sizeof(char *));
  for (uint32_t i = 0; i < n_options; ++i) {
    if (!options[i].key || !options[i].value) {
      kvpool_hixl_destroy(e);
      return fail(KVPOOL_HIXL_PARAM_INVALID, "create: null option key or value");
    }
    e->opt_keys[i] = strdup(options[i].key);
    e->opt_vals[i] = strdup(options[i].value);
    e->n_opts++;
    if (strncmp(options[i].key, "env:", 4) == 0) setenv(options[i].key + 4, options[i].value, 0);
  }
  const char *spec = getenv("KVPOOL_HIXL_STANDIN_FAULTS");
  if (spec && parse_faults(e, spec) != 0) {
    kvpool_hixl_destroy(e);
    return fail(KVPOOL_HIXL_PARAM_INVALID, "KVPOOL_HIXL_STANDIN_FAULTS: cannot parse %s", spec);
  }
  kvpool_hixl_status st = take_fault(e, "create");
  if (st != KVPOOL_HIXL_SUCCESS) {
    kvpool_hixl_destroy(e);
    return st;
  }
  /* A port in the name makes HIXL listen on it: hold it the same way, so that another process
   * probing for a free port sees it taken. */
  const char *colon = strrchr(local_engine, ':');
  const char *bracket = strrchr(local_engine, ']');
  if (colon && (!bracket || colon > bracket) && (bracket || strchr(local_engine, ':') == colon)) {
    int port = atoi(colon + 1);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 16) != 0) {
      int err = errno;
      if (lfd >= 0) close(lfd);
      kvpool_hixl_destroy(e);
      return fail(KVPOOL_HIXL_FAILED, "create: cannot listen on port %d of %s: %s", port, local_engine, strerror(err));
    }
    e->listen_fd = lfd;
  }
  dir_name(local_engine, e->dir_shm, sizeof e->dir_shm);
  int fd = -1;
  for (int attempt = 0; attempt < 2 && fd < 0; ++attempt) {
    fd = shm_open(e->dir_shm, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) {
      int ofd = shm_open(e->dir_shm, O_RDONLY, 0);
      int owner = 0;
      if (ofd >= 0) {
        directory *d = mmap(NULL, sizeof(directory), PROT_READ, MAP_SHARED, ofd, 0);
        if (d != MAP_FAILED) {
          owner = atomic_load(&d->alive) ? d->pid : 0;
          munmap(d, sizeof(directory));
        }
        close(ofd);
      }
      if (pid_alive(owner)) {
        e->dir_shm[0] = '\0';
        kvpool_hixl_destroy(e);
        return fail(KVPOOL_HIXL_FAILED, "engine name %s is in use by process %d (HIXL: listen port taken)",
                    local_engine, owner);
      }
      shm_unlink(e->dir_shm);
    }
  }
  if (fd < 0 || ftruncate(fd, sizeof(directory)) != 0) {
    if (fd >= 0) close(fd);
    e->dir_shm[0] = '\0';
    kvpool_hixl_destroy(e);
    return fail(KVPOOL_HIXL_FAILED, "create: shared memory for the directory: %s", strerror(errno));
  }
  e->dir = mmap(NULL, sizeof(directory), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (e->dir == MAP_FAILED) {
    e->dir = NULL;
    kvpool_hixl_destroy(e);
    return fail(KVPOOL_HIXL_FAILED, "create: mmap of the directory: %s", strerror(errno));
  }
  e->dir->magic = DIR_MAGIC;
  e->dir->abi = KVPOOL_HIXL_STANDIN_ABI;
  e->dir->pid = getpid();
  atomic_store(&e->dir->alive, 1);
  if (pthread_create(&e->worker, NULL, worker_main, e) != 0) {
    kvpool_hixl_destroy(e);
    return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "create: no worker thread");
  }
  e->worker_started = 1;
  *out = e;
  return KVPOOL_HIXL_SUCCESS;
}

void kvpool_hixl_destroy(kvpool_hixl_engine *e) {
  if (!e) return;
  if (e->dir) atomic_store(&e->dir->alive, 0);
  pthread_mutex_lock(&e->mu);
  e->shutdown = 1;
  for (req *r = e->all; r; r = r->next_all) r->aborted = 1;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  if (e->worker_started) pthread_join(e->worker, NULL);
  while (e->all) {
    req *r = e->all;
    unlist(e, r);
    r->queued = 0;
    req_free_if_unowned(e, r);
  }
  while (e->peers) {
    peer *p = e->peers;
    e->peers = p->next;
    peer_unref(p);
  }
  if (e->dir) munmap(e->dir, sizeof(directory));
  if (e->dir_shm[0]) shm_unlink(e->dir_shm);
  while (e->allocs) {
    alloc *a = e->allocs;
    e->allocs = a->next;
    munmap((void *)(uintptr_t)a->addr, a->map_len);
    shm_unlink(a->shm);
    free(a);
  }
  for (uint32_t i = 0; i < e->n_opts; ++i) {
    free(e->opt_keys[i]);
    free(e->opt_vals[i]);
  }
  free(e->opt_keys);
  free(e->opt_vals);
  free(e->name);
  if (e->listen_fd >= 0) close(e->listen_fd);
  pthread_mutex_destroy(&e->mu);
  pthread_cond_destroy(&e->cv);
  free(e);
}

kvpool_hixl_status kvpool_hixl_bind_thread(kvpool_hixl_engine *e) {
  if (!e) return fail(KVPOOL_HIXL_PARAM_INVALID, "bind_thread: null engine");
  t_bound = e;
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_malloc(kvpool_hixl_engine *e, uint64_t len, uint32_t mem_type, uint64_t *addr) {
  if (!e || !addr || len == 0) return fail(KVPOOL_HIXL_PARAM_INVALID, "malloc: null argument or zero length");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  /* The alignment aclrtMalloc (huge pages) and aclrtMallocHost give. */
  uint64_t align = mem_type == KVPOOL_HIXL_MEM_DEVICE ? (2u << 20) : (64u << 10);
  uint64_t map_len = (len + PAGE - 1) / PAGE * PAGE;
  alloc *a = calloc(1, sizeof *a);
  if (!a) return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "malloc: out of memory");
  /* Unique per process (several engines may share one). */
  static _Atomic uint64_t alloc_seq;
  snprintf(a->shm, sizeof a->shm, "/kvpool-hixl-m-%d-%llu", (int)getpid(),
           (unsigned long long)(atomic_fetch_add(&alloc_seq, 1) + 1));
  int fd = shm_open(a->shm, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)map_len) != 0) {
    int err = errno;
    if (fd >= 0) {
      close(fd);
      shm_unlink(a->shm);
    }
    free(a);
    return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "malloc(%llu): shared memory: %s", (unsigned long long)len, strerror(err));
  }
  uint8_t *res = mmap(NULL, map_len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (res == MAP_FAILED) {
    close(fd);
    shm_unlink(a->shm);
    free(a);
    return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "malloc(%llu): address space: %s", (unsigned long long)len, strerror(errno));
  }
  uintptr_t at = ((uintptr_t)res + align - 1) / align * align;
  void *p = mmap((void *)at, map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    munmap(res, map_len + align);
    shm_unlink(a->shm);
    free(a);
    return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "malloc: mmap: %s", strerror(errno));
  }
  if (at > (uintptr_t)res) munmap(res, at - (uintptr_t)res);
  uintptr_t end = (uintptr_t)res + map_len + align;
  if (end > at + map_len) munmap((void *)(at + map_len), end - (at + map_len));
  a->addr = at;
  a->len = len;
  a->map_len = map_len;
  a->mem_type = mem_type;
  pthread_mutex_lock(&e->mu);
  a->next = e->allocs;
  e->allocs = a;
  pthread_mutex_unlock(&e->mu);
  *addr = at;
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_free(kvpool_hixl_engine *e, uint64_t addr, uint32_t mem_type) {
  if (!e) return fail(KVPOOL_HIXL_PARAM_INVALID, "free: null engine");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  for (alloc **pp = &e->allocs; *pp; pp = &(*pp)->next) {
    alloc *a = *pp;
    if (a->addr == addr && a->mem_type == mem_type) {
      *pp = a->next;
      pthread_mutex_unlock(&e->mu);
      munmap((void *)(uintptr_t)a->addr, a->map_len);
      shm_unlink(a->shm);
      free(a);
      return KVPOOL_HIXL_SUCCESS;
    }
  }
  pthread_mutex_unlock(&e->mu);
  return fail(KVPOOL_HIXL_PARAM_INVALID, "free: 0x%llx was not allocated by malloc", (unsigned long long)addr);
}

kvpool_hixl_status kvpool_hixl_register_mem(kvpool_hixl_engine *e, uint64_t addr, uint64_t len, uint32_t mem_type,
                                            uint64_t *handle) {
  if (!e || !handle || len == 0) return fail(KVPOOL_HIXL_PARAM_INVALID, "register_mem: null argument or zero length");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  kvpool_hixl_status st = take_fault(e, "register");
  if (st != KVPOOL_HIXL_SUCCESS) {
    pthread_mutex_unlock(&e->mu);
    return st;
  }
  alloc *a = e->allocs;
  while (a && !(addr >= a->addr && addr - a->addr <= a->len && len <= a->len - (addr - a->addr))) a = a->next;
  if (!a) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_PARAM_INVALID,
                "register_mem: 0x%llx+%llu is not memory from malloc (HIXL takes aclrtMalloc/aclrtMallocHost memory)",
                (unsigned long long)addr, (unsigned long long)len);
  }
  if (a->mem_type != mem_type) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_PARAM_INVALID, "register_mem: memory type %u does not match the allocation's %u", mem_type,
                a->mem_type);
  }
  uint32_t slot = 0;
  while (slot < MAX_REGIONS && e->dir->r[slot].live) slot++;
  if (slot == MAX_REGIONS) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_RESOURCE_EXHAUSTED, "register_mem: more than %d registrations", MAX_REGIONS);
  }
  atomic_fetch_add(&e->dir->seq, 1);
  dir_region *r = &e->dir->r[slot];
  r->addr = addr;
  r->len = len;
  r->mem_type = mem_type;
  snprintf(r->shm, sizeof r->shm, "%s", a->shm);
  r->shm_off = addr - a->addr;
  r->live = 1;
  if (slot + 1 > e->dir->n) e->dir->n = slot + 1;
  atomic_fetch_add(&e->dir->seq, 1);
  e->c.registers++;
  pthread_mutex_unlock(&e->mu);
  *handle = slot + 1;
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_deregister_mem(kvpool_hixl_engine *e, uint64_t handle) {
  if (!e) return fail(KVPOOL_HIXL_PARAM_INVALID, "deregister_mem: null engine");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  if (handle == 0 || handle > MAX_REGIONS || !e->dir->r[handle - 1].live) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_PARAM_INVALID, "deregister_mem: unknown handle %llu", (unsigned long long)handle);
  }
  if (e->peers) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_FAILED, "deregister_mem while connected: HIXL requires Disconnect from every peer first");
  }
  atomic_fetch_add(&e->dir->seq, 1);
  e->dir->r[handle - 1].live = 0;
  atomic_fetch_add(&e->dir->seq, 1);
  e->c.deregisters++;
  pthread_mutex_unlock(&e->mu);
  return KVPOOL_HIXL_SUCCESS;
}

static peer *find_peer(kvpool_hixl_engine *e, const char *name) {
  for (peer *p = e->peers; p; p = p->next)
    if (strcmp(p->name, name) == 0) return p;
  return NULL;
}

/* Maps a peer's directory and the regions it lists now; NULL (and t_err set) when it is not there
 * yet. *retry says whether waiting may help. */
static peer *map_peer(const char *name, int *retry) {
  char path[SHM_NAME + 192];
  dir_name(name, path, sizeof path);
  *retry = 1;
  int fd = shm_open(path, O_RDONLY, 0);
  if (fd < 0) return NULL;
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(directory)) {
    close(fd);
    return NULL;
  }
  const directory *dir = mmap(NULL, sizeof(directory), PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (dir == MAP_FAILED) return NULL;
  if (dir->magic != DIR_MAGIC || !atomic_load(&dir->alive) || !pid_alive(dir->pid)) {
    munmap((void *)dir, sizeof(directory));
    return NULL;
  }
  if (dir->abi != KVPOOL_HIXL_STANDIN_ABI) {
    munmap((void *)dir, sizeof(directory));
    *retry = 0;
    fail(KVPOOL_HIXL_FAILED, "peer %s speaks stand-in ABI %u, this library %u", name, dir->abi, KVPOOL_HIXL_STANDIN_ABI);
    return NULL;
  }
  /* A consistent copy of the region table (seqlock). */
  dir_region *snap = malloc(sizeof(dir_region) * MAX_REGIONS);
  uint32_t n;
  for (;;) {
    uint64_t s1 = atomic_load(&dir->seq);
    if (s1 & 1) {
      sched_yield();
      continue;
    }
    n = dir->n;
    memcpy(snap, dir->r, sizeof(dir_region) * n);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load(&dir->seq) == s1) break;
  }
  peer *p = calloc(1, sizeof *p);
  p->name = strdup(name);
  p->dir = dir;
  p->refs = 1;
  p->regions = calloc(n ? n : 1, sizeof(peer_region));
  for (uint32_t i = 0; i < n; ++i) {
    if (!snap[i].live) continue;
    int rfd = shm_open(snap[i].shm, O_RDWR, 0);
    uint64_t off = snap[i].shm_off / PAGE * PAGE;
    size_t map_len = (size_t)(snap[i].shm_off - off + snap[i].len);
    void *m = rfd < 0 ? MAP_FAILED : mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, (off_t)off);
    if (rfd >= 0) close(rfd);
    if (m == MAP_FAILED) {
      free(snap);
      peer_unref(p);
      *retry = 0;
      fail(KVPOOL_HIXL_FAILED, "connect %s: cannot map its region %s: %s", name, snap[i].shm, strerror(errno));
      return NULL;
    }
    peer_region *pr = &p->regions[p->n++];
    pr->addr = snap[i].addr;
    pr->len = snap[i].len;
    pr->map = m;
    pr->map_len = map_len;
    pr->ptr = (uint8_t *)m + (snap[i].shm_off - off);
  }
  free(snap);
  return p;
}

kvpool_hixl_status kvpool_hixl_connect(kvpool_hixl_engine *e, const char *remote, int32_t timeout_ms) {
  if (!e || !remote) return fail(KVPOOL_HIXL_PARAM_INVALID, "connect: null argument");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  e->c.connects++;
  kvpool_hixl_status st = take_fault(e, "connect");
  int already = find_peer(e, remote) != NULL;
  pthread_mutex_unlock(&e->mu);
  if (st != KVPOOL_HIXL_SUCCESS) return st;
  if (already) return fail(KVPOOL_HIXL_ALREADY_CONNECTED, "already connected to %s", remote);
  uint64_t deadline = now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
  peer *p;
  int retry = 1;
  while ((p = map_peer(remote, &retry)) == NULL) {
    if (!retry) return KVPOOL_HIXL_FAILED;
    if (now_ms() >= deadline)
      return fail(KVPOOL_HIXL_TIMEOUT, "connect to %s: no engine of that name answered within %d ms", remote, timeout_ms);
    usleep(1000);
  }
  pthread_mutex_lock(&e->mu);
  p->next = e->peers;
  e->peers = p;
  pthread_mutex_unlock(&e->mu);
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_disconnect(kvpool_hixl_engine *e, const char *remote, int32_t timeout_ms) {
  (void)timeout_ms;
  if (!e || !remote) return fail(KVPOOL_HIXL_PARAM_INVALID, "disconnect: null argument");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  e->c.disconnects++;
  kvpool_hixl_status st = take_fault(e, "disconnect");
  if (st != KVPOOL_HIXL_SUCCESS) {
    pthread_mutex_unlock(&e->mu);
    return st;
  }
  peer *p = NULL;
  for (peer **pp = &e->peers; *pp; pp = &(*pp)->next) {
    if (strcmp((*pp)->name, remote) == 0) {
      p = *pp;
      *pp = p->next;
      break;
    }
  }
  if (!p) {
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_NOT_CONNECTED, "disconnect: not connected to %s", remote);
  }
  /* HIXL cleans up the link's requests: they fail and can no longer be queried. */
  req *r = e->all;
  while (r) {
    req *next = r->next_all;
    if (r->peer == p) {
      r->aborted = 1;
      r->state = KVPOOL_HIXL_XFER_FAILED;
      unlist(e, r);
      req_free_if_unowned(e, r);
    }
    r = next;
  }
  peer_unref(p);
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  return KVPOOL_HIXL_SUCCESS;
}

/* Checks a descriptor list and queues it as a request. Caller holds mu. */
static kvpool_hixl_status submit(kvpool_hixl_engine *e, const char *remote, uint32_t op, const kvpool_hixl_desc *descs,
                                 uint32_t n, req **out) {
  if (op != KVPOOL_HIXL_READ && op != KVPOOL_HIXL_WRITE) return fail(KVPOOL_HIXL_PARAM_INVALID, "unknown op %u", op);
  kvpool_hixl_status st = take_fault(e, "transfer");
  if (st != KVPOOL_HIXL_SUCCESS) return st;
  peer *p = find_peer(e, remote);
  if (!p) return fail(KVPOOL_HIXL_NOT_CONNECTED, "not connected to %s", remote);
  if (!atomic_load(&p->dir->alive) || !pid_alive(p->dir->pid))
    return fail(KVPOOL_HIXL_NOT_CONNECTED, "link to %s is down: the peer finalized or exited", remote);
  uint8_t **remote_ptrs = calloc(n ? n : 1, sizeof(uint8_t *));
  for (uint32_t i = 0; i < n; ++i) {
    const kvpool_hixl_desc *d = &descs[i];
    int ok = 0;
    for (uint32_t k = 0; k < e->dir->n && !ok; ++k) {
      const dir_region *r = &e->dir->r[k];
      ok = r->live && d->local_addr >= r->addr && d->local_addr - r->addr <= r->len &&
           d->len <= r->len - (d->local_addr - r->addr);
    }
    if (!ok) {
      free(remote_ptrs);
      return fail(KVPOOL_HIXL_PARAM_INVALID, "descriptor %u: local 0x%llx+%llu is not in registered memory", i,
                  (unsigned long long)d->local_addr, (unsigned long long)d->len);
    }
    for (uint32_t k = 0; k < p->n && !remote_ptrs[i]; ++k) {
      const peer_region *r = &p->regions[k];
      if (d->remote_addr >= r->addr && d->remote_addr - r->addr <= r->len && d->len <= r->len - (d->remote_addr - r->addr))
        remote_ptrs[i] = r->ptr + (d->remote_addr - r->addr);
    }
    if (!remote_ptrs[i]) {
      free(remote_ptrs);
      return fail(KVPOOL_HIXL_PARAM_INVALID,
                  "descriptor %u: remote 0x%llx+%llu is not in memory %s had registered when we connected", i,
                  (unsigned long long)d->remote_addr, (unsigned long long)d->len, remote);
    }
  }
  req *r = calloc(1, sizeof *r);
  r->id = ++e->next_req;
  r->peer = p;
  p->refs++;
  r->op = op;
  r->n = n;
  r->descs = malloc(sizeof(kvpool_hixl_desc) * (n ? n : 1));
  memcpy(r->descs, descs, sizeof(kvpool_hixl_desc) * n);
  r->remote = remote_ptrs;
  r->state = KVPOOL_HIXL_XFER_WAITING;
  r->listed = 1;
  r->queued = 1;
  r->next_all = e->all;
  e->all = r;
  if (e->q_tail)
    e->q_tail->next_q = r;
  else
    e->q_head = r;
  e->q_tail = r;
  e->c.transfer_calls++;
  if (++e->outstanding > e->c.max_outstanding) e->c.max_outstanding = e->outstanding;
  e->c.descs += n;
  for (uint32_t i = 0; i < n; ++i) e->c.bytes += descs[i].len;
  if (n > e->c.max_descs_per_call) e->c.max_descs_per_call = n;
  pthread_cond_broadcast(&e->cv);
  *out = r;
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_transfer_async(kvpool_hixl_engine *e, const char *remote, uint32_t op,
                                              const kvpool_hixl_desc *descs, uint32_t n, uint64_t *req_out) {
  if (!e || !remote || !req_out || (!descs && n)) return fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_async: null argument");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  req *r = NULL;
  kvpool_hixl_status st = submit(e, remote, op, descs, n, &r);
  if (st == KVPOOL_HIXL_SUCCESS) *req_out = r->id;
  pthread_mutex_unlock(&e->mu);
  return st;
}

kvpool_hixl_status kvpool_hixl_transfer_status(kvpool_hixl_engine *e, uint64_t id, uint32_t *state) {
  if (!e || !state) return fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_status: null argument");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  e->c.status_calls++;
  kvpool_hixl_status st = take_fault(e, "status");
  if (st != KVPOOL_HIXL_SUCCESS) {
    pthread_mutex_unlock(&e->mu);
    return st;
  }
  req *r = e->all;
  while (r && r->id != id) r = r->next_all;
  if (!r) {
    e->c.stale_status++;
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_status: unknown request %llu (already reported, or its link was "
                                           "disconnected)", (unsigned long long)id);
  }
  *state = r->state;
  if (r->state == KVPOOL_HIXL_XFER_COMPLETED || r->state == KVPOOL_HIXL_XFER_FAILED) {
    unlist(e, r);
    req_free_if_unowned(e, r);
  }
  pthread_mutex_unlock(&e->mu);
  return KVPOOL_HIXL_SUCCESS;
}

kvpool_hixl_status kvpool_hixl_transfer_sync(kvpool_hixl_engine *e, const char *remote, uint32_t op,
                                             const kvpool_hixl_desc *descs, uint32_t n, int32_t timeout_ms) {
  if (!e || !remote || (!descs && n)) return fail(KVPOOL_HIXL_PARAM_INVALID, "transfer_sync: null argument");
  if (wrong_thread(e)) return KVPOOL_HIXL_FAILED;
  pthread_mutex_lock(&e->mu);
  e->c.sync_calls++;
  req *r = NULL;
  kvpool_hixl_status st = submit(e, remote, op, descs, n, &r);
  if (st != KVPOOL_HIXL_SUCCESS) {
    pthread_mutex_unlock(&e->mu);
    return st;
  }
  r->waiter = 1;
  struct timespec ts;
  deadline_in(&ts, timeout_ms > 0 ? timeout_ms : 0);
  int timed_out = 0;
  while (r->listed && r->state == KVPOOL_HIXL_XFER_WAITING) {
    if (pthread_cond_timedwait(&e->cv, &e->mu, &ts) == ETIMEDOUT) {
      timed_out = r->state == KVPOOL_HIXL_XFER_WAITING;
      break;
    }
  }
  r->waiter = 0;
  if (!r->listed) {
    /* Disconnected under us: the request is gone. */
    req_free_if_unowned(e, r);
    pthread_mutex_unlock(&e->mu);
    return fail(KVPOOL_HIXL_NOT_CONNECTED, "transfer_sync: link to %s was disconnected", remote);
  }
  uint32_t state = r->state;
  if (timed_out) r->aborted = 1;
  unlist(e, r);
  req_free_if_unowned(e, r);
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
  if (timed_out) return fail(KVPOOL_HIXL_TIMEOUT, "transfer_sync to %s: not done within %d ms", remote, timeout_ms);
  if (state != KVPOOL_HIXL_XFER_COMPLETED) return fail(KVPOOL_HIXL_FAILED, "transfer_sync to %s failed", remote);
  return KVPOOL_HIXL_SUCCESS;
}

/* ---- test controls (not part of the ABI) ---- */

int kvpool_hixl_standin_inject(kvpool_hixl_engine *e, const char *spec) {
  if (!e || !spec) return -1;
  pthread_mutex_lock(&e->mu);
  int rc = parse_faults(e, spec);
  pthread_mutex_unlock(&e->mu);
  return rc;
}

void kvpool_hixl_standin_counters_get(kvpool_hixl_engine *e, kvpool_hixl_standin_counters *out) {
  pthread_mutex_lock(&e->mu);
  *out = e->c;
  pthread_mutex_unlock(&e->mu);
}

uint32_t kvpool_hixl_standin_option(kvpool_hixl_engine *e, const char *key, char *buf, uint32_t cap) {
  for (uint32_t i = 0; i < e->n_opts; ++i) {
    if (strcmp(e->opt_keys[i], key) == 0) {
      size_t n = strlen(e->opt_vals[i]);
      if (buf && cap > 0) {
        size_t k = n < cap - 1 ? n : cap - 1;
        memcpy(buf, e->opt_vals[i], k);
        buf[k] = '\0';
      }
      return (uint32_t)n + 1;
    }
  }
  return 0;
}
