/* Counts the bytes a process copies with memcpy/memmove (LD_PRELOAD), for `bulk-cost.sh`:
 * user-space copies per payload byte, read before and after a measured phase. The counters
 * live in a file mapped at start, $COPYCOUNT_DIR/copycount.<pid>: three u64 (bytes in all
 * copies, bytes in copies of 1 KiB or more, number of such copies). Rust's std and rustls copy
 * buffers with libc's memcpy/memmove; the kernel's copies (read, write) are not counted.
 * Build: cc -O2 -shared -fPIC -o copycount.so copycount.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef void *(*copy_fn)(void *, const void *, size_t);
static copy_fn real_memcpy, real_memmove;
static volatile uint64_t *counters;
static uint64_t fallback[3];

static void *slow_move(void *d, const void *s, size_t n) {
    unsigned char *dd = d;
    const unsigned char *ss = s;
    if (dd < ss) for (size_t i = 0; i < n; i++) dd[i] = ss[i];
    else for (size_t i = n; i > 0; i--) dd[i - 1] = ss[i - 1];
    return d;
}

static void count(size_t n) {
    volatile uint64_t *c = counters ? counters : fallback;
    __atomic_fetch_add(&c[0], n, __ATOMIC_RELAXED);
    if (n >= 1024) {
        __atomic_fetch_add(&c[1], n, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c[2], 1, __ATOMIC_RELAXED);
    }
}

__attribute__((constructor)) static void init(void) {
    real_memcpy = (copy_fn)dlsym(RTLD_NEXT, "memcpy");
    real_memmove = (copy_fn)dlsym(RTLD_NEXT, "memmove");
    const char *dir = getenv("COPYCOUNT_DIR");
    if (!dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/copycount.%d", dir, (int)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, 4096) != 0) return;
    void *m = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m != MAP_FAILED) counters = m;
}

void *memcpy(void *d, const void *s, size_t n) {
    count(n);
    return real_memcpy ? real_memcpy(d, s, n) : slow_move(d, s, n);
}

void *memmove(void *d, const void *s, size_t n) {
    count(n);
    return real_memmove ? real_memmove(d, s, n) : slow_move(d, s, n);
}
