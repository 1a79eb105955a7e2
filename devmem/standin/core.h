/*
 * The shared core of kvpool-devmem's stand-in runtimes (core.c): device memory, host
 * registrations, streams with worker threads, events, counters and injected faults. cuda.c and
 * acl.c put each runtime's C ABI in front of it. Nothing here is exported from the library.
 */
#ifndef KVPOOL_DEVMEM_STANDIN_CORE_H
#define KVPOOL_DEVMEM_STANDIN_CORE_H

#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

/* Errors of the core; each front end turns them into its runtime's codes. */
enum { OK = 0, E_VALUE, E_ALLOC, E_DEVICE, E_CONTEXT, E_EXEC, E_PINNED_TWICE, E_NOT_PINNED, E_ALIGN, E_INJECTED };

/* The thread's current device (-1: none, ACL's state before aclrtSetDevice). */
int standin_device(void);
void standin_clear_device(int d);
int set_device(int d);
/* Leave a message for the calling thread (aclGetRecentErrMsg reads it). */
void say(const char *fmt, const char *what);
const char *standin_message(void);

int dev_malloc(void **out, size_t size, int device, int managed);
int dev_free(void *p);
/* h2d: 1 host to device, 0 device to host. A NULL stream is the default stream. */
int copy_async(void *dst, const void *src, size_t n, int h2d, void *stream);
int copy_sync(void *dst, const void *src, size_t n, int h2d);
/* align: the address alignment required (0: none). */
int host_register(void *p, size_t n, size_t align);
int host_unregister(void *p);
/* 0 unregistered, 1 registered host, 2 device, 3 managed; *device set for device memory. */
int classify(const void *p, int *device);

void *stream_create(int device);
void stream_free(void *s);
int stream_sync(void *s);
void *event_new(void);
void event_free(void *e);
int event_record(void *e, void *s);
int event_wait(void *e);

#endif
