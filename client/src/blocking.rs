//! A blocking front-end to the async [`crate::Client`], in the manner of `reqwest::blocking`: it
//! owns a small Tokio runtime and runs each call to completion on the calling thread. One client
//! is safe to share between threads (the Python binding releases the GIL around every call, so
//! many threads may be in calls at once).

use crate::{
    BufSlice, Buffer, ClientConfig, GetIntoResult, GetResult, Located, PathReport, PutEntry, PutOptions, Result,
};
use kvpool_proto::{ErrorCode, HelloOk, Limits, PolicyInfo, PolicyKind, PutMode, RemoveAllResponse, StatsReport};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A blocking connection to a kvpool pool: a server that holds blocks, or a cluster master
/// (then the block calls go through the master to the storage nodes, as [`crate::Client`]'s
/// do). Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Client {
    // Dropped before the runtime it runs on.
    inner: crate::Client,
    rt: Arc<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl Client {
    /// Connect (see [`crate::Client::connect`]: a cluster master is routed through). Must not
    /// be called from inside an async runtime.
    pub fn connect(cfg: ClientConfig) -> Result<Client> {
        let rt = runtime()?;
        let inner = rt.block_on(crate::Client::connect(cfg))?;
        Ok(Client { inner, rt: Arc::new(rt) })
    }

    /// Connect to the cluster whose leading master etcd names (see
    /// [`crate::Client::connect_etcd`]).
    pub fn connect_etcd(endpoints: &str, prefix: &str, template: ClientConfig) -> Result<Client> {
        let rt = runtime()?;
        let inner = rt.block_on(crate::Client::connect_etcd(endpoints, prefix, template))?;
        Ok(Client { inner, rt: Arc::new(rt) })
    }

    /// Whether block calls go through a cluster master.
    pub fn is_cluster(&self) -> bool {
        self.inner.is_cluster()
    }

    fn run<T>(&self, fut: impl Future<Output = T>) -> T {
        self.rt.block_on(fut)
    }

    /// The async client underneath (its methods need this client's runtime).
    pub fn as_async(&self) -> &crate::Client {
        &self.inner
    }

    pub fn tenant(&self) -> String {
        self.inner.tenant()
    }
    pub fn is_admin(&self) -> bool {
        self.inner.is_admin()
    }
    pub fn limits(&self) -> Limits {
        self.inner.limits()
    }
    pub fn hello(&self) -> HelloOk {
        self.inner.hello()
    }
    pub fn path_report(&self) -> PathReport {
        self.inner.path_report()
    }
    pub fn transport_in_use(&self) -> &'static str {
        self.inner.transport_in_use()
    }
    pub fn control_in_use(&self) -> &'static str {
        self.inner.control_in_use()
    }
    pub fn close(&self) {
        self.run(self.inner.close())
    }

    pub fn put(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.put_with(key, value, PutOptions::default())
    }
    pub fn put_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Insert)
    }
    pub fn upsert(&self, key: impl AsRef<[u8]>, value: &[u8]) -> Result<()> {
        self.upsert_with(key, value, PutOptions::default())
    }
    pub fn upsert_with(&self, key: impl AsRef<[u8]>, value: &[u8], opts: PutOptions) -> Result<()> {
        self.put_one(key.as_ref(), value, opts, PutMode::Upsert)
    }
    fn put_one(&self, key: &[u8], value: &[u8], opts: PutOptions, mode: PutMode) -> Result<()> {
        match mode {
            PutMode::Insert => self.run(self.inner.put_with(key, value, opts)),
            PutMode::Upsert => self.run(self.inner.upsert_with(key, value, opts)),
        }
    }
    /// Put blocks; on a cluster, one copy each on the node the master places it on.
    pub fn put_batch(&self, entries: &[PutEntry<'_>], mode: PutMode) -> Result<Vec<ErrorCode>> {
        self.run(self.inner.put_batch(entries, mode))
    }
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        self.run(self.inner.get(key))
    }
    pub fn get_batch<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<GetResult>> {
        self.run(self.inner.get_batch(keys))
    }
    pub fn get_into(&self, key: impl AsRef<[u8]>, buf: &mut [u8]) -> Result<Option<usize>> {
        self.run(self.inner.get_into(key, buf))
    }
    pub fn get_batch_into<K: AsRef<[u8]>>(&self, keys: &[K], bufs: &mut [&mut [u8]]) -> Result<Vec<GetIntoResult>> {
        self.run(self.inner.get_batch_into(keys, bufs))
    }
    pub fn lookup<K: AsRef<[u8]>>(&self, chain: &[K]) -> Result<usize> {
        self.run(self.inner.lookup(chain))
    }
    pub fn exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<bool>> {
        self.run(self.inner.exists(keys))
    }
    pub fn remove(&self, key: impl AsRef<[u8]>, force: bool) -> Result<()> {
        self.run(self.inner.remove(key, force))
    }
    pub fn remove_batch<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<ErrorCode>> {
        self.run(self.inner.remove_batch(keys, force))
    }
    /// Remove every block of this tenant (on a cluster: on every live storage node, summed).
    pub fn remove_all(&self, force: bool) -> Result<RemoveAllResponse> {
        self.run(self.inner.remove_all(force))
    }
    /// The server's statistics (on a cluster: the master's, which holds no blocks; per node
    /// statistics come from [`crate::ClusterClient::stats`]).
    pub fn stats(&self) -> Result<StatsReport> {
        self.run(self.inner.stats())
    }
    pub fn ping(&self) -> Result<Duration> {
        self.run(self.inner.ping())
    }

    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        // Sharing a buffer talks to the shm socket; keep it off any async thread.
        let _guard = self.rt.enter();
        self.inner.alloc_buffer(len)
    }
    /// Put blocks whose values are in buffers (on a cluster their bytes go to the nodes over
    /// the network).
    pub fn put_from_batch<K: AsRef<[u8]>>(
        &self,
        entries: &[(K, BufSlice<'_>, PutOptions)],
        mode: PutMode,
    ) -> Result<Vec<ErrorCode>> {
        self.run(self.inner.put_from_batch(entries, mode))
    }
    pub fn get_into_batch<K: AsRef<[u8]>>(&self, keys: &[K], dests: &[BufSlice<'_>]) -> Result<Vec<GetIntoResult>> {
        self.run(self.inner.get_into_batch(keys, dests))
    }

    /// Locate blocks and lease them in place (sizes, tiers, checksums); end with [`Self::release`].
    /// Not offered through a cluster master (`unsupported`).
    pub fn get_locate<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Located> {
        self.run(self.inner.get_locate(keys))
    }
    /// End a lease of [`Self::get_locate`] or [`Self::lookup_lease`].
    pub fn release(&self, lease: u64) -> Result<()> {
        self.run(self.inner.release(lease))
    }
    /// See [`crate::Client::lookup_lease`]. On a cluster it counts as [`Self::lookup`] does
    /// and holds nothing (lease 0): a block that goes before it is read is a miss, which a
    /// connector recovers from by computing it.
    pub fn lookup_lease<K: AsRef<[u8]>>(&self, chain: &[K], ttl: Duration) -> Result<crate::LookupLease> {
        self.run(self.inner.lookup_lease(chain, ttl))
    }
    /// See [`crate::Client::remove_matching`] (on a cluster: on every live storage node).
    pub fn remove_matching(
        &self,
        prefix: impl AsRef<[u8]>,
        pattern: Option<&str>,
        force: bool,
    ) -> Result<RemoveAllResponse> {
        self.run(self.inner.remove_matching(prefix, pattern, force))
    }

    pub fn policy_load(
        &self,
        kind: PolicyKind,
        name: &str,
        params: &[(String, String)],
        wasm: &[u8],
    ) -> Result<PolicyInfo> {
        self.run(self.inner.policy_load(kind, name, params, wasm))
    }
    /// Follow the pool's KV events (see [`crate::Client::subscribe`]).
    pub fn subscribe(&self, opts: crate::SubscribeOptions) -> Result<Subscription> {
        let inner = self.run(self.inner.subscribe(opts))?;
        Ok(Subscription { inner, rt: self.rt.clone() })
    }

    pub fn policy_list(&self) -> Result<Vec<PolicyInfo>> {
        self.run(self.inner.policy_list())
    }
    pub fn policy_rollback(&self, kind: PolicyKind) -> Result<PolicyInfo> {
        self.run(self.inner.policy_rollback(kind))
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvpool-client")
        .enable_all()
        .build()
        .map_err(|e| crate::ClientError::Io(format!("cannot start the client runtime: {e}")))
}

/// A blocking [`crate::Subscription`].
#[derive(Debug)]
pub struct Subscription {
    // Dropped before the runtime it runs on.
    inner: crate::Subscription,
    rt: Arc<tokio::runtime::Runtime>,
}

impl Subscription {
    pub fn log_id(&self) -> u64 {
        self.inner.log_id()
    }

    pub fn resume_from(&self) -> u64 {
        self.inner.resume_from()
    }

    /// The next batch within `wait` (`None` when nothing came in time).
    pub fn next_within(&mut self, wait: Duration) -> Result<Option<kvpool_proto::EventBatch>> {
        self.rt.block_on(self.inner.next_within(wait))
    }
}
