//! Where quinn's per-packet work runs: on the caller's Tokio runtime, or on a thread of its own.
//!
//! quinn drives an endpoint with one task that reads datagrams and one task per connection that
//! builds, seals and sends packets. On a multi-threaded runtime those tasks land on different
//! workers, so every received datagram's `Bytes` and every wake-up crosses threads, and the
//! caller's own tasks compete with them for the same workers. A client moves one stream's bytes
//! at a time through one connection: its packet work is serial, and it runs fastest when the
//! endpoint's and its connections' tasks share one thread (measured: `bench/RESULTS.md`, issue
//! 34). [`Drivers::IoThread`] gives each endpoint a thread of a small process-wide pool, with a
//! single-threaded runtime on it; the caller's tasks only meet quinn at stream reads and writes.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Which runtime runs an endpoint's quinn tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Drivers {
    /// The Tokio runtime the endpoint is made on (quinn's default).
    #[default]
    Caller,
    /// One thread of a process-wide pool ([`io_threads`] of them), all of this endpoint's
    /// tasks on it.
    IoThread,
}

/// Threads in the pool: one per core up to four. Endpoints are dealt to them in turn, so a
/// process with several endpoints (a cluster client, several engines' workers) spreads them.
pub fn io_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4)
}

/// The next thread of the pool (endpoints are dealt in turn). The pool is started on first use
/// and lives for the process (its threads park when idle); it is started again in a child
/// process after a `fork`, which copies the pool's handles but not its threads (an engine that
/// makes a client and then forks workers).
fn next_thread() -> io::Result<tokio::runtime::Handle> {
    static POOL: Mutex<Option<(u32, Vec<tokio::runtime::Handle>)>> = Mutex::new(None);
    static TURN: AtomicUsize = AtomicUsize::new(0);
    let mut pool = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let pid = std::process::id();
    if pool.as_ref().is_none_or(|(owner, _)| *owner != pid) {
        let handles = (0..io_threads())
            .map(|i| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                let handle = rt.handle().clone();
                std::thread::Builder::new().name(format!("kvpool-quic-io-{i}")).spawn(move || {
                    // Runs the spawned drivers until the process ends.
                    rt.block_on(std::future::pending::<()>());
                })?;
                Ok(handle)
            })
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start QUIC I/O threads: {e}")))?;
        *pool = Some((pid, handles));
    }
    let handles = &pool.as_ref().expect("just set").1;
    Ok(handles[TURN.fetch_add(1, Ordering::Relaxed) % handles.len()].clone())
}

/// A quinn runtime whose timers, sockets and tasks all belong to one pool thread's runtime.
pub struct IoThread {
    handle: tokio::runtime::Handle,
    inner: quinn::TokioRuntime,
}

impl fmt::Debug for IoThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoThread").finish_non_exhaustive()
    }
}

impl IoThread {
    /// The next thread of the pool.
    pub fn next() -> io::Result<IoThread> {
        Ok(IoThread { handle: next_thread()?, inner: quinn::TokioRuntime })
    }
}

impl quinn::Runtime for IoThread {
    fn new_timer(&self, i: Instant) -> Pin<Box<dyn quinn::AsyncTimer>> {
        // A timer belongs to the runtime whose context makes it.
        let _in = self.handle.enter();
        self.inner.new_timer(i)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        self.handle.spawn(future);
    }

    fn wrap_udp_socket(&self, t: std::net::UdpSocket) -> io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        // The socket registers with this runtime's reactor, which the pool thread drives.
        let _in = self.handle.enter();
        self.inner.wrap_udp_socket(t)
    }

    fn now(&self) -> Instant {
        self.inner.now()
    }
}
