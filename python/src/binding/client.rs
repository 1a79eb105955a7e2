//! `Client`, the store class: a connection and every call Python makes on it.

use super::args::{key_bytes, keys_of, mode, pieces_of, put_options, single_pieces, value_ref, ValueRef};
use super::buffer::SharedBuffer;
use super::device::{Claim, DEVICE_CHUNK};
use super::error::{Error, Res};
use super::events::EventSubscription;
use super::ranges::Stage;
use crate::devstage::Staging;
use crate::regions::{Mem, Regions};
use kvpool_client::blocking::Client as Blocking;
use kvpool_client::proto::EventScope;
use kvpool_client::{Buffer, ClientConfig, ErrorCode, PutEntry, SubscribeOptions, TransportChoice, Trust};
use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

/// A kvpool connection (see the module docs).
#[pyclass(module = "kvpool._native", frozen)]
pub(super) struct Client {
    pub(super) inner: Blocking,
    pub(super) regions: RwLock<Regions<Arc<Buffer>>>,
    /// Shared buffers made by `alloc_buffer`, by start address, to recognise registrations
    /// that lie inside one.
    pub(super) shared: Mutex<BTreeMap<usize, Weak<Buffer>>>,
    pub(super) stage: Stage,
    /// Device runtimes (CUDA, ACL), read from the environment at the first registration.
    pub(super) devices: OnceLock<Result<kvpool_devmem::Runtimes, kvpool_devmem::DevmemError>>,
    /// Pinned staging buffers for device memory.
    pub(super) staging: Staging<Buffer>,
    /// The last failed device copy, for `last_device_error`.
    pub(super) device_error: Mutex<Option<String>>,
    pub(super) closed: AtomicBool,
}

impl Client {
    pub(super) fn live(&self) -> Res<&Blocking> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(&self.inner)
    }

    pub(super) fn max_batch(&self) -> usize {
        (self.inner.limits().max_batch as usize).max(1)
    }
}

#[pymethods]
impl Client {
    /// Connect to a kvpool server.
    ///
    /// Either `data_dir` (a local server's data directory: `endpoint.json` and `api-key`), or
    /// `server` (`host:port`) with `api_key` and one of `fingerprint` (SHA-256 of the server
    /// certificate, hex) or `ca_file` (PEM). Explicit arguments override what `data_dir` says.
    /// `transport` is `auto` (same-host shared memory when offered, else QUIC), `quic` or `shm`.
    /// `bulk` is the path of bulk bytes to a server on another host: `auto` (its TCP bulk
    /// channel, QUIC on this host), `quic` or `tcp`; `trusted_networks` (CIDR strings) lets it
    /// run in plaintext to servers there that trust this client's network too.
    /// `timeout` bounds each request; `dead_after` (seconds, default 60) is how long a connection
    /// may hear nothing from the server before it counts as dead (a killed server sends no
    /// close), after which calls fail with the code `unavailable` and the next one connects again.
    /// The server verifies every block it copies into a registered buffer against the checksum
    /// taken at put; `verify_shm_gets=True` has the client hash those bytes again too, a guard
    /// against a faulty server that costs one more pass over the data.
    /// A server that is a cluster master is routed through to its storage nodes (`cluster`);
    /// a storage node that answers neither a call nor a ping within `node_answer_within`
    /// (seconds, default 0.25) is skipped until it answers again (its blocks miss);
    /// `etcd` (`http://host:port`, comma-separated) finds the cluster's leading master there
    /// under `etcd_prefix` instead of `server`, trusting the fingerprint it published.
    /// `device_chunk` (bytes, default 16 MiB) is the staging chunk of transfers from and to
    /// device memory (see `register`).
    #[new]
    #[pyo3(signature = (server=None, api_key=None, *, fingerprint=None, ca_file=None, data_dir=None,
                        server_name=None, transport="auto", timeout=30.0, client_name=None,
                        verify_shm_gets=false, dead_after=None, etcd=None, etcd_prefix="/kvpool/",
                        node_answer_within=None, bulk="auto", trusted_networks=None, device_chunk=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        server: Option<String>,
        api_key: Option<String>,
        fingerprint: Option<String>,
        ca_file: Option<String>,
        data_dir: Option<String>,
        server_name: Option<String>,
        transport: &str,
        timeout: f64,
        client_name: Option<String>,
        verify_shm_gets: bool,
        dead_after: Option<f64>,
        etcd: Option<String>,
        etcd_prefix: &str,
        node_answer_within: Option<f64>,
        bulk: &str,
        trusted_networks: Option<Vec<String>>,
        device_chunk: Option<usize>,
    ) -> PyResult<Self> {
        let device_chunk = device_chunk.unwrap_or(DEVICE_CHUNK);
        if !(4096..=1 << 30).contains(&device_chunk) {
            return Err(Error::Argument(format!("device_chunk must be 4 KiB to 1 GiB, not {device_chunk}")).into());
        }
        let trust = match (fingerprint, ca_file) {
            (Some(f), _) => Some(Trust::Fingerprint(kvpool_client::parse_fingerprint(&f).map_err(Error::from)?)),
            (None, Some(c)) => Some(Trust::CaFile(c.into())),
            (None, None) => None,
        };
        let mut cfg = match data_dir {
            Some(d) => ClientConfig::from_data_dir(d).map_err(Error::from)?,
            // The leader's address and fingerprint come from etcd.
            None if etcd.is_some() => {
                let Some(k) = api_key.clone() else {
                    return Err(Error::Argument("etcd needs an api_key".into()).into());
                };
                ClientConfig::new(String::new(), k, Trust::Fingerprint([0; 32]))
            }
            None => {
                let (Some(s), Some(k), Some(t)) = (server.clone(), api_key.clone(), trust.clone()) else {
                    return Err(Error::Argument(
                        "give data_dir, or server with api_key and a fingerprint or ca_file".into(),
                    )
                    .into());
                };
                ClientConfig::new(s, k, t)
            }
        };
        if let Some(s) = server {
            cfg.server = s;
        }
        if let Some(k) = api_key {
            cfg.api_key = k;
        }
        if let Some(t) = trust {
            cfg.trust = t;
        }
        if let Some(n) = server_name {
            cfg.server_name = n;
        }
        if let Some(n) = client_name {
            cfg.client_name = n;
        }
        cfg.transport = transport.parse::<TransportChoice>().map_err(Error::Argument)?;
        cfg.bulk = bulk.parse::<kvpool_client::BulkChoice>().map_err(Error::Argument)?;
        for n in trusted_networks.unwrap_or_default() {
            let net = n.parse().map_err(|e| Error::Argument(format!("trusted network {n:?}: {e}")))?;
            cfg.trusted_networks.push(net);
        }
        cfg.verify_shm_gets = verify_shm_gets;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(Error::Argument(format!("timeout must be a positive number of seconds, not {timeout}")).into());
        }
        cfg.request_timeout = Duration::from_secs_f64(timeout);
        if let Some(d) = dead_after {
            if !(d.is_finite() && (0.1..=3600.0).contains(&d)) {
                return Err(Error::Argument(format!("dead_after must be 0.1 to 3600 seconds, not {d}")).into());
            }
            cfg.dead_after = Duration::from_secs_f64(d);
        }
        if let Some(d) = node_answer_within {
            if !(d.is_finite() && (0.01..=3600.0).contains(&d)) {
                return Err(Error::Argument(format!("node_answer_within must be 0.01 to 3600 seconds, not {d}")).into());
            }
            cfg.node_answer_within = Duration::from_secs_f64(d);
        }
        let inner = match etcd {
            Some(e) => py.detach(|| Blocking::connect_etcd(&e, etcd_prefix, cfg)),
            None => py.detach(|| Blocking::connect(cfg)),
        }
        .map_err(Error::from)?;
        tracing::debug!(transport = inner.transport_in_use(), "kvpool python client connected");
        Ok(Client {
            inner,
            regions: RwLock::new(Regions::default()),
            shared: Mutex::new(BTreeMap::new()),
            stage: Stage::default(),
            devices: OnceLock::new(),
            // Two chunks per call in flight; as many kept as two calls at once use.
            staging: Staging::new(device_chunk, 4 * device_chunk),
            device_error: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }

    /// The data path of block bytes on this connection: `"shm"` or `"quic"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.transport_in_use()
    }

    /// The path of requests on this connection: `"local"` (the server's same-host control
    /// socket) or `"quic"`.
    #[getter]
    fn control(&self) -> &'static str {
        self.inner.control_in_use()
    }

    /// Whether this client routes through a cluster master to its storage nodes (found out at
    /// connect: the server was a master).
    #[getter]
    fn cluster(&self) -> bool {
        self.inner.is_cluster()
    }

    /// The tenant the API key belongs to.
    #[getter]
    fn tenant(&self) -> String {
        self.inner.tenant()
    }

    /// Limits the server announced: `max_key_len`, `max_value_size`, `max_batch`.
    #[getter]
    fn limits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let l = self.inner.limits();
        let d = PyDict::new(py);
        d.set_item("max_key_len", l.max_key_len)?;
        d.set_item("max_value_size", l.max_value_size)?;
        d.set_item("max_batch", l.max_batch)?;
        Ok(d)
    }

    /// Round-trip time of one request, in seconds.
    fn ping(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(py.detach(|| -> Res<_> { Ok(self.live()?.ping()?) })?.as_secs_f64())
    }

    /// Close the connection; later calls fail with code `closed`.
    fn close(&self, py: Python<'_>) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            py.detach(|| self.inner.close());
        }
    }

    /// Put values given as Python buffers (bytes, bytearray, memoryview, numpy arrays).
    /// Returns one status name per key: `ok`, `already-exists` (blocks are immutable; the old
    /// value stays), `no-space`, `rejected` (admission), `leased` (upsert of a leased block), ...
    #[pyo3(signature = (keys, values, upsert=false, parents=None, tokens=None, seq_tokens=None, pin=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        values: Vec<Bound<'_, PyAny>>,
        upsert: bool,
        parents: Option<Vec<Option<Bound<'_, PyAny>>>>,
        tokens: Option<Vec<u32>>,
        seq_tokens: Option<Vec<u64>>,
        pin: Option<&str>,
    ) -> PyResult<Vec<&'static str>> {
        if keys.len() != values.len() {
            return Err(Error::Argument(format!("{} keys but {} values", keys.len(), values.len())).into());
        }
        let ks = keys_of(&keys)?;
        let vals: Vec<ValueRef> = values.iter().map(value_ref).collect::<PyResult<_>>()?;
        let opts = put_options(ks.len(), parents, tokens, seq_tokens, pin)?;
        let out = py.detach(|| -> Res<Vec<&'static str>> {
            let client = self.live()?;
            let mut out = Vec::with_capacity(ks.len());
            for (c, chunk) in ks.chunks(self.max_batch()).enumerate() {
                let base = c * self.max_batch();
                let entries: Vec<PutEntry<'_>> = chunk
                    .iter()
                    .enumerate()
                    .map(|(j, k)| PutEntry { key: k, value: vals[base + j].bytes(), opts: opts[base + j].clone() })
                    .collect();
                out.extend(client.put_batch(&entries, mode(upsert))?.into_iter().map(ErrorCode::name));
            }
            Ok(out)
        })?;
        Ok(out)
    }

    /// Read values. One `(status, bytes or None)` per key; status `ok`, `not-found` or
    /// `corrupt` (the server dropped a block whose checksum failed). Reads lease the blocks.
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyList>> {
        let ks = keys_of(&keys)?;
        let got = py.detach(|| -> Res<Vec<_>> {
            let client = self.live()?;
            let mut out = Vec::with_capacity(ks.len());
            for chunk in ks.chunks(self.max_batch()) {
                out.extend(client.get_batch(chunk)?);
            }
            Ok(out)
        })?;
        let items = got.into_iter().map(|r| {
            let v = r.value.map(|v| PyBytes::new(py, &v));
            (r.status.name(), v)
        });
        PyList::new(py, items)
    }

    /// Sizes of stored values without moving their bytes: one `(status, size)` per key. The
    /// server plans these as reads: each found block gets the read lease a `get` grants.
    fn get_size(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<(&'static str, u64)>> {
        let ks = keys_of(&keys)?;
        Ok(py.detach(|| -> Res<Vec<_>> {
            let client = self.live()?;
            let mut out = Vec::with_capacity(ks.len());
            if client.is_cluster() {
                // No in-place locate through a master: the sizes of the values read.
                for chunk in ks.chunks(self.max_batch()) {
                    out.extend(
                        client
                            .get_batch(chunk)?
                            .into_iter()
                            .map(|r| (r.status.name(), r.value.map_or(0, |v| v.len() as u64))),
                    );
                }
                return Ok(out);
            }
            for chunk in ks.chunks(self.max_batch()) {
                let located = client.get_locate(chunk)?;
                if located.lease != 0 {
                    client.release(located.lease)?;
                }
                out.extend(located.blocks.iter().map(|b| (b.status.name(), b.size)));
            }
            Ok(out)
        })?)
    }

    /// Presence of each key. Unlike Mooncake, asking never grants or renews a lease and never
    /// counts as a use for eviction.
    fn exists(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let ks = keys_of(&keys)?;
        Ok(py.detach(|| -> Res<Vec<bool>> {
            let client = self.live()?;
            let mut out = Vec::with_capacity(ks.len());
            for chunk in ks.chunks(self.max_batch()) {
                out.extend(client.exists(chunk)?);
            }
            Ok(out)
        })?)
    }

    /// Number of leading keys of `chain` (root first) that are resident, in one request. Never
    /// leases, never touches recency.
    fn lookup(&self, py: Python<'_>, chain: Vec<Bound<'_, PyAny>>) -> PyResult<usize> {
        let ks = keys_of(&chain)?;
        Ok(py.detach(|| -> Res<usize> {
            let client = self.live()?;
            // A chain longer than one request may hold is asked in parts, stopping at a gap.
            let mut resident = 0;
            for chunk in ks.chunks(self.max_batch()) {
                let n = client.lookup(chunk)?;
                resident += n;
                if n < chunk.len() {
                    break;
                }
            }
            Ok(resident)
        })?)
    }

    /// `lookup`, holding what it counted: the resident leading blocks stay (not evicted, not
    /// removed without force) until `release` of each lease returned, `ttl` seconds (the server's
    /// lease time when None; at most 60), or the end of this client's connection. Returns
    /// `(resident, leases)`; a chain longer than one request may hold takes one lease per part.
    #[pyo3(signature = (chain, ttl=None))]
    fn lookup_lease(
        &self,
        py: Python<'_>,
        chain: Vec<Bound<'_, PyAny>>,
        ttl: Option<f64>,
    ) -> PyResult<(usize, Vec<u64>)> {
        let ks = keys_of(&chain)?;
        let ttl = match ttl {
            None => Duration::ZERO,
            Some(t) if t.is_finite() && t > 0.0 => Duration::from_secs_f64(t.min(3600.0)),
            Some(t) => return Err(Error::Argument(format!("ttl must be a positive number of seconds, not {t}")).into()),
        };
        Ok(py.detach(|| -> Res<(usize, Vec<u64>)> {
            let client = self.live()?;
            let (mut resident, mut leases) = (0, Vec::new());
            for chunk in ks.chunks(self.max_batch()) {
                let l = client.lookup_lease(chunk, ttl)?;
                resident += l.resident;
                if l.lease != 0 {
                    leases.push(l.lease);
                }
                if l.resident < chunk.len() {
                    break;
                }
            }
            Ok((resident, leases))
        })?)
    }

    /// End a lease of `lookup_lease` early. A lease that already ended raises `expired`.
    fn release(&self, py: Python<'_>, lease: u64) -> PyResult<()> {
        Ok(py.detach(|| -> Res<()> { Ok(self.live()?.release(lease)?) })?)
    }

    /// Remove every block of this tenant whose key starts with `prefix` and, when `pattern` is
    /// given, matches that regular expression (Rust regex syntax, over the key's bytes; anchor it
    /// with `^...$` to match whole keys). Returns `(removed, kept_because_leased)`.
    #[pyo3(signature = (prefix=None, pattern=None, force=false))]
    fn remove_matching(
        &self,
        py: Python<'_>,
        prefix: Option<Bound<'_, PyAny>>,
        pattern: Option<String>,
        force: bool,
    ) -> PyResult<(u64, u64)> {
        let prefix = match prefix {
            Some(p) => key_bytes(&p)?,
            None => Vec::new(),
        };
        let r = py.detach(|| -> Res<_> { Ok(self.live()?.remove_matching(&prefix, pattern.as_deref(), force)?) })?;
        Ok((r.removed, r.skipped))
    }

    /// Remove keys: one status per key (`ok`, `not-found`, `leased` unless `force`).
    #[pyo3(signature = (keys, force=false))]
    fn remove(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>, force: bool) -> PyResult<Vec<&'static str>> {
        let ks = keys_of(&keys)?;
        Ok(py.detach(|| -> Res<Vec<_>> {
            let client = self.live()?;
            let mut out = Vec::with_capacity(ks.len());
            for chunk in ks.chunks(self.max_batch()) {
                out.extend(client.remove_batch(chunk, force)?.into_iter().map(ErrorCode::name));
            }
            Ok(out)
        })?)
    }

    /// Remove every block of this tenant; returns `(removed, kept_because_leased)`.
    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<(u64, u64)> {
        let r = py.detach(|| -> Res<_> { Ok(self.live()?.remove_all(force)?) })?;
        Ok((r.removed, r.skipped))
    }

    /// Follow the pool's KV events (blocks stored, removed, evicted): a subscription whose
    /// `next(timeout)` returns batches. `from_seq` resumes at a sequence number (a batch's
    /// `next`) of the log `log_id` (a restarted server's other log is refused with `expired`);
    /// `all_tenants` needs an admin key.
    #[pyo3(signature = (from_seq=None, all_tenants=false, max_batch=0, log_id=None))]
    fn subscribe(
        &self,
        py: Python<'_>,
        from_seq: Option<u64>,
        all_tenants: bool,
        max_batch: u32,
        log_id: Option<u64>,
    ) -> PyResult<EventSubscription> {
        let scope = if all_tenants { EventScope::All } else { EventScope::Tenant };
        let opts = SubscribeOptions { from: from_seq, scope, max_batch, log_id };
        let sub = py.detach(|| -> Res<_> { Ok(self.live()?.subscribe(opts)?) })?;
        Ok(EventSubscription { inner: Mutex::new(Some(sub)), closed: AtomicBool::new(false) })
    }

    /// Pool statistics as a dict: `blocks`, `tiers` (per tier: capacity, used bytes, blocks,
    /// hits, misses, evictions), `ops` (per operation: count, errors, p50/p99/mean in us), ...
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| -> Res<_> { Ok(self.live()?.stats()?) })?;
        let d = PyDict::new(py);
        d.set_item("server", s.server)?;
        d.set_item("uptime_s", s.uptime_s)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("demotions", s.demotions)?;
        d.set_item("promotions", s.promotions)?;
        d.set_item("rejected_puts", s.rejected_puts)?;
        d.set_item("corrupt_blocks", s.corrupt_blocks)?;
        let tiers = PyDict::new(py);
        for t in s.tiers {
            let e = PyDict::new(py);
            e.set_item("capacity_bytes", t.capacity_bytes)?;
            e.set_item("used_bytes", t.used_bytes)?;
            e.set_item("blocks", t.blocks)?;
            e.set_item("hits", t.hits)?;
            e.set_item("misses", t.misses)?;
            e.set_item("evictions", t.evictions)?;
            tiers.set_item(t.tier, e)?;
        }
        d.set_item("tiers", tiers)?;
        let ops = PyDict::new(py);
        for o in s.ops {
            let e = PyDict::new(py);
            e.set_item("count", o.count)?;
            e.set_item("errors", o.errors)?;
            e.set_item("p50_us", o.p50_us)?;
            e.set_item("p99_us", o.p99_us)?;
            e.set_item("mean_us", o.mean_us)?;
            ops.set_item(o.op, e)?;
        }
        d.set_item("ops", ops)?;
        Ok(d)
    }

    /// A zero-filled shared buffer of `size` bytes (a sealed memfd). It supports the buffer
    /// protocol (`numpy.frombuffer(buf, dtype)`, `memoryview(buf)`); registered ranges inside it
    /// move zero-copy on a same-host connection (the server copies between its segment and
    /// this memory), and in band over QUIC otherwise.
    fn alloc_buffer(&self, py: Python<'_>, size: usize) -> PyResult<SharedBuffer> {
        if size == 0 {
            return Err(Error::Argument("a shared buffer needs at least one byte".into()).into());
        }
        let buf = Arc::new(py.detach(|| -> Res<Buffer> { Ok(self.live()?.alloc_buffer(size)?) })?);
        let mut shared = self.shared.lock();
        shared.retain(|_, w| w.strong_count() > 0);
        shared.insert(buf.as_ptr() as usize, Arc::downgrade(&buf));
        Ok(SharedBuffer { buf })
    }

    /// Register `[ptr, ptr + size)` for raw-address transfers. The memory must stay valid until
    /// `unregister(ptr)`. Overlapping an existing registration is refused. When the range lies
    /// inside a buffer of `alloc_buffer`, transfers through it are zero-copy, and the buffer is
    /// kept alive while registered. Returns True when the range is such a shared buffer.
    ///
    /// Device memory (a CUDA or Ascend device pointer: a torch tensor's `data_ptr()`) is asked
    /// of the device runtimes first (`cudaPointerGetAttributes`, `aclrtPointerGetAttributes`;
    /// `KVPOOL_CUDA_RUNTIME` / `KVPOOL_ACL_RUNTIME` choose them, by default those this process
    /// loaded): a range that one calls device memory, start and end on the same device, is
    /// registered as such and moves through pinned staging buffers, never read from the host.
    /// Any other range must be host memory this process can read and write (a device pointer no
    /// runtime claims is refused with `invalid-argument`, never read).
    fn register(&self, py: Python<'_>, ptr: usize, size: usize) -> PyResult<bool> {
        let backing = {
            let shared = self.shared.lock();
            shared.range(..=ptr).next_back().and_then(|(&start, w)| {
                let b = w.upgrade()?;
                (ptr.checked_add(size)? <= start + b.len()).then(|| (b, ptr - start))
            })
        };
        let zero_copy = backing.is_some();
        let mem = match backing {
            Some((b, off)) => Mem::Shared(b, off),
            None => match py.detach(|| self.claim(ptr, size))? {
                Some(Claim::Device(loc)) => Mem::Device(loc),
                // Pinned or managed host memory, as its runtime says.
                Some(Claim::Host) => Mem::Host,
                None => {
                    // A device pointer (CUDA, Ascend) is refused here, before anything reads it.
                    crate::hostmem::check(ptr, size).map_err(Error::from)?;
                    Mem::Host
                }
            },
        };
        py.detach(|| self.regions.write().add(ptr, size, mem)).map_err(Error::from)?;
        Ok(zero_copy)
    }

    /// Unregister the range that starts at `ptr`; waits for transfers that use it.
    fn unregister(&self, py: Python<'_>, ptr: usize) -> PyResult<()> {
        let removed = py.detach(|| self.regions.write().remove(ptr)).map_err(Error::from)?;
        drop(removed);
        Ok(())
    }

    /// The registered ranges: `(ptr, size, zero_copy)` in address order; with `memory=True`,
    /// `(ptr, size, zero_copy, memory)` where `memory` is `"host"`, `"shared"` (an
    /// `alloc_buffer` buffer) or the device, as `"cuda:0"` or `"acl:1"`.
    #[pyo3(signature = (memory=false))]
    fn registered<'py>(&self, py: Python<'py>, memory: bool) -> PyResult<Bound<'py, PyList>> {
        let regions = self.regions.read();
        let rows = regions.iter().map(|r| {
            let zero_copy = matches!(r.mem, Mem::Shared(..));
            if !memory {
                return (r.start, r.len, zero_copy).into_pyobject(py);
            }
            let what = match &r.mem {
                Mem::Host => "host".to_string(),
                Mem::Shared(..) => "shared".to_string(),
                Mem::Device(loc) => loc.to_string(),
            };
            (r.start, r.len, zero_copy, what).into_pyobject(py)
        });
        PyList::new(py, rows.collect::<PyResult<Vec<_>>>()?)
    }

    /// Why the last device copy of this client failed (an item answered `device-error`): the
    /// runtime call and its error, as `"CUDA: cudaEventSynchronize failed with error 700: ..."`.
    /// None when none has.
    #[getter]
    fn last_device_error(&self) -> Option<String> {
        self.device_error.lock().clone()
    }

    /// Put values from registered memory, one address range per key. One status per key; a
    /// range outside the registrations answers `invalid-argument` and is not read. Ranges in
    /// device memory are copied to pinned staging buffers chunk by chunk while the previous chunk
    /// is sent; an item whose device copy failed answers `device-error`.
    #[pyo3(signature = (keys, ptrs, sizes, upsert=false, parents=None, tokens=None, seq_tokens=None, pin=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        upsert: bool,
        parents: Option<Vec<Option<Bound<'_, PyAny>>>>,
        tokens: Option<Vec<u32>>,
        seq_tokens: Option<Vec<u64>>,
        pin: Option<&str>,
    ) -> PyResult<Vec<&'static str>> {
        let ks = keys_of(&keys)?;
        let pieces = single_pieces(ptrs, sizes, ks.len())?;
        let opts = put_options(ks.len(), parents, tokens, seq_tokens, pin)?;
        Ok(py.detach(|| self.put_ranges(&ks, &pieces, &opts, mode(upsert)))?)
    }

    /// Put values each gathered from several registered ranges (concatenated in order).
    #[pyo3(signature = (keys, ptrs, sizes, upsert=false, parents=None, tokens=None, seq_tokens=None, pin=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_from_multi(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        upsert: bool,
        parents: Option<Vec<Option<Bound<'_, PyAny>>>>,
        tokens: Option<Vec<u32>>,
        seq_tokens: Option<Vec<u64>>,
        pin: Option<&str>,
    ) -> PyResult<Vec<&'static str>> {
        let ks = keys_of(&keys)?;
        let pieces = pieces_of(ptrs, sizes, ks.len())?;
        let opts = put_options(ks.len(), parents, tokens, seq_tokens, pin)?;
        Ok(py.detach(|| self.put_ranges(&ks, &pieces, &opts, mode(upsert)))?)
    }

    /// Get values into registered memory, one range per key: `(status, size)` per key. A value
    /// larger than its range answers `value-too-large` (nothing written there); a range outside
    /// the registrations answers `invalid-argument`. Destinations of one call may not overlap.
    /// Ranges in device memory are filled from pinned staging buffers, each chunk's copies
    /// running while the next chunk is fetched; all of them are complete when the call returns
    /// (an item whose copy failed answers `device-error`).
    fn get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<(&'static str, u64)>> {
        let ks = keys_of(&keys)?;
        let pieces = single_pieces(ptrs, sizes, ks.len())?;
        Ok(py.detach(|| self.get_ranges(&ks, &pieces))?)
    }

    /// Get values each scattered over several registered ranges, filled in order.
    fn get_into_multi(
        &self,
        py: Python<'_>,
        keys: Vec<Bound<'_, PyAny>>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> PyResult<Vec<(&'static str, u64)>> {
        let ks = keys_of(&keys)?;
        let pieces = pieces_of(ptrs, sizes, ks.len())?;
        Ok(py.detach(|| self.get_ranges(&ks, &pieces))?)
    }

    fn __repr__(&self) -> String {
        format!(
            "kvpool.Client(server={:?}, transport={}, control={})",
            self.inner.as_async().config().server,
            self.inner.transport_in_use(),
            self.inner.control_in_use()
        )
    }
}
