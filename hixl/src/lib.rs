//! The HIXL (Ascend) backend of kvpool's [`Transport`] trait.
//!
//! kvpool drives CANN's `hixl::Hixl` through a thin C shim (`shim/kvpool_hixl_shim.cc`) that is
//! compiled only where CANN is installed and loaded at run time with `dlopen`, so kvpool builds
//! and runs everywhere and Ascend is a run-time choice. One engine thread owns the HIXL engine and
//! its ACL context and makes every HIXL call in order; this front end validates descriptors,
//! keeps the region and peer tables, and reports outcomes.
//!
//! The same ABI is implemented by a stand-in (`shim/standin.c`: memcpy over POSIX shared memory
//! between processes of one host) that the tests run against. What ran where is stated in
//! docs/HIXL.md: the stand-in tests kvpool's side of the ABI, never HIXL.

pub mod batch;
pub mod config;
mod engine;
pub mod error;
pub mod ffi;
pub mod meta;

pub use config::{plan, HixlConfig, HixlPlan};
pub use error::{Call, HixlCode, HixlError};
pub use ffi::StandinCounters;

use engine::{Cmd, EngineLoop, XferShared};
use ffi::{Engine, RawDesc, ShimLib, MEM_DEVICE, MEM_HOST, OP_READ, OP_WRITE};
use kvpool_transport::{
    Caps, MemKind, Op, PeerId, Region, RegionId, Transport, TransportError, Xfer, XferId, XferStatus,
};
use meta::{MetaRegion, PeerMeta};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use tracing::{info, warn};

/// Environment variable naming the shim library (after `HixlConfig::shim_path`).
pub const SHIM_ENV: &str = "KVPOOL_HIXL_SHIM";

/// The shim this build compiled, when CANN was installed at build time.
pub fn built_shim() -> Option<&'static str> {
    Some(env!("KVPOOL_HIXL_BUILT_SHIM")).filter(|s| !s.is_empty())
}

/// The stand-in library this build compiled (for tests and for trying kvpool without Ascend).
pub fn standin_library() -> &'static str {
    env!("KVPOOL_HIXL_STANDIN_LIB")
}

/// Which library a config resolves to: the configured path, `KVPOOL_HIXL_SHIM`, the shim this
/// build compiled, or the bare file name (searched on the library path).
pub fn shim_path(cfg: &HixlConfig) -> String {
    if let Some(p) = &cfg.shim_path {
        return p.display().to_string();
    }
    if let Some(p) = std::env::var_os(SHIM_ENV).filter(|p| !p.is_empty()) {
        return p.to_string_lossy().into_owned();
    }
    built_shim().unwrap_or(ffi::SHIM_NAME).to_string()
}

/// Load the shim a config names and check its ABI, without starting an engine: the start-up
/// check for `protocol = "ascend"`.
pub fn check_library(cfg: &HixlConfig) -> Result<String, HixlError> {
    let path = shim_path(cfg);
    let lib = ShimLib::open(&path)?;
    Ok(format!("{} ({} backend)", lib.path, lib.backend))
}

/// The outcome of a post, with HIXL's error kept typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HixlStatus {
    Pending,
    Done,
    Failed(HixlError),
}

struct LocalRegion {
    addr: u64,
    len: u64,
    kind: MemKind,
    handle: u64,
}

struct PeerEntry {
    engine: String,
    regions: HashMap<u64, (u64, u64)>,
}

struct Inner {
    tx: Sender<Cmd>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    backend: String,
    library: String,
    engine_name: String,
    plan: HixlPlan,
    regions: RwLock<HashMap<u64, LocalRegion>>,
    peers: RwLock<HashMap<u64, PeerEntry>>,
    xfers: Mutex<HashMap<u64, Arc<XferShared>>>,
    next: AtomicU64,
}

impl Inner {
    fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn call<T>(&self, make: impl FnOnce(mpsc::SyncSender<Result<T, HixlError>>) -> Cmd) -> Result<T, HixlError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.tx.send(make(tx)).map_err(|_| HixlError::EngineGone)?;
        rx.recv().map_err(|_| HixlError::EngineGone)?
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shutdown);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

/// kvpool's HIXL transport.
#[derive(Clone)]
pub struct HixlTransport {
    inner: Arc<Inner>,
}

/// Memory HIXL accepts (aclrtMallocHost / aclrtMalloc in the real shim), freed on drop. It keeps
/// the transport's engine alive.
pub struct HixlBuffer {
    inner: Arc<Inner>,
    addr: u64,
    len: u64,
    kind: MemKind,
}

impl HixlBuffer {
    pub fn addr(&self) -> usize {
        self.addr as usize
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The region to register.
    pub fn region(&self) -> Region {
        Region { addr: self.addr as usize, len: self.len as usize, kind: self.kind }
    }

    /// Host memory as bytes; `None` for device memory.
    ///
    /// # Safety
    /// No transfer may write this memory while the slice is alive.
    pub unsafe fn host_bytes(&self) -> Option<&[u8]> {
        (self.kind == MemKind::Host).then(|| std::slice::from_raw_parts(self.addr as *const u8, self.len as usize))
    }

    /// Host memory as mutable bytes; `None` for device memory.
    ///
    /// # Safety
    /// No transfer may touch this memory while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_bytes_mut(&self) -> Option<&mut [u8]> {
        (self.kind == MemKind::Host).then(|| std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len as usize))
    }
}

impl Drop for HixlBuffer {
    fn drop(&mut self) {
        let mem_type = if self.kind == MemKind::Host { MEM_HOST } else { MEM_DEVICE };
        let _ = self.inner.tx.send(Cmd::Free { addr: self.addr, mem_type });
    }
}

/// A port for this engine: Mooncake's scheme (a block of 1000 ports per device from
/// `ASCEND_BASE_PORT`), starting at a per-process offset, first one free for TCP.
fn pick_port(plan: &HixlPlan) -> Result<u16, HixlError> {
    // Ports handed to engines of this process: the stand-in listens on no socket, so the bind
    // probe alone would give two engines of one process the same name.
    static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let block = plan.base_port as u32 + 1000 * plan.device_id.max(0) as u32;
    let start = std::process::id() % 1000;
    let mut taken = TAKEN.lock();
    for i in 0..1000u32 {
        let port = block + (start + i) % 1000;
        let Ok(port) = u16::try_from(port) else { continue };
        if !taken.contains(&port) && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            taken.push(port);
            return Ok(port);
        }
    }
    Err(HixlError::Config(format!("no free port in {block}..{} for the HIXL engine (ASCEND_BASE_PORT)", block + 1000)))
}

impl HixlTransport {
    /// Load the shim, map the settings, and start the engine thread (which sets the device and
    /// initialises HIXL).
    pub fn new(cfg: &HixlConfig) -> Result<HixlTransport, HixlError> {
        let plan = config::plan(cfg, &|k| std::env::var(k).ok())?;
        Self::with_plan(&shim_path(cfg), plan)
    }

    /// Start over a given library and plan.
    pub fn with_plan(library: &str, plan: HixlPlan) -> Result<HixlTransport, HixlError> {
        let lib = ShimLib::open(library)?;
        for w in &plan.warnings {
            warn!("HIXL config: {w}");
        }
        let port = match plan.engine_port {
            Some(p) => p,
            None => pick_port(&plan)?,
        };
        let engine_name = plan.engine_name(port);
        let options: Vec<(String, String)> = plan.options.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let (tx, rx) = mpsc::channel::<Cmd>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), HixlError>>(1);
        let (name, p2, cmd_tx) = (engine_name.clone(), plan.clone(), tx.clone());
        let backend = lib.backend.clone();
        let thread = std::thread::Builder::new()
            .name("kvpool-hixl-engine".into())
            .spawn(move || {
                // The engine (and its ACL context) is created on, and never leaves, this thread.
                let eng = match Engine::create(lib, p2.device_id, &name, &options) {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                EngineLoop::new(eng, p2, cmd_tx).run(rx);
            })
            .map_err(|e| HixlError::Config(format!("cannot start the HIXL engine thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(HixlError::EngineGone);
            }
        }
        info!(engine = %engine_name, library, %backend, mode = ?plan.mode, "HIXL engine started");
        Ok(HixlTransport {
            inner: Arc::new(Inner {
                tx,
                thread: Mutex::new(Some(thread)),
                backend,
                library: library.to_string(),
                engine_name,
                plan,
                regions: RwLock::new(HashMap::new()),
                peers: RwLock::new(HashMap::new()),
                xfers: Mutex::new(HashMap::new()),
                next: AtomicU64::new(0),
            }),
        })
    }

    /// This engine's HIXL name ("ip:port").
    pub fn engine_name(&self) -> &str {
        &self.inner.engine_name
    }

    /// "hixl" (the real shim) or "standin".
    pub fn backend(&self) -> &str {
        &self.inner.backend
    }

    pub fn library(&self) -> &str {
        &self.inner.library
    }

    pub fn plan(&self) -> &HixlPlan {
        &self.inner.plan
    }

    /// Memory HIXL can register: pinned host memory, or device memory of this engine's NPU.
    pub fn alloc(&self, len: usize, kind: MemKind) -> Result<HixlBuffer, HixlError> {
        let mem_type = if kind == MemKind::Host { MEM_HOST } else { MEM_DEVICE };
        let addr = self.inner.call(|reply| Cmd::Alloc { len: len as u64, mem_type, reply })?;
        Ok(HixlBuffer { inner: self.inner.clone(), addr, len: len as u64, kind })
    }

    /// The outcome of a post with HIXL's error typed. Like [`Transport::status`], a settled post
    /// is reported once.
    pub fn poll(&self, xfer: XferId) -> Result<HixlStatus, TransportError> {
        let mut xfers = self.inner.xfers.lock();
        let shared = xfers.get(&xfer.0).ok_or(TransportError::UnknownXfer(xfer))?;
        let outcome = shared.outcome.lock().clone();
        match outcome {
            None => Ok(HixlStatus::Pending),
            Some(o) => {
                xfers.remove(&xfer.0);
                Ok(match o {
                    Ok(()) => HixlStatus::Done,
                    Err(e) => HixlStatus::Failed(e),
                })
            }
        }
    }

    /// Stand-in only: inject faults (see `shim/standin.c`); false on the real shim or a bad spec.
    pub fn standin_inject(&self, spec: &str) -> bool {
        let spec = spec.to_string();
        self.with_engine(move |e| e.standin_inject(&spec)).unwrap_or(false)
    }

    /// Stand-in only: what the library saw.
    pub fn standin_counters(&self) -> Option<StandinCounters> {
        self.with_engine(|e| e.standin_counters()).ok().flatten()
    }

    /// Stand-in only: an option as the library received it.
    pub fn standin_option(&self, key: &str) -> Option<String> {
        let key = key.to_string();
        self.with_engine(move |e| e.standin_option(&key)).ok().flatten()
    }

    fn with_engine<T: Send + 'static>(&self, f: impl FnOnce(&Engine) -> T + Send + 'static) -> Result<T, HixlError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.inner
            .tx
            .send(Cmd::Call(Box::new(move |e| {
                let _ = tx.send(f(e));
            })))
            .map_err(|_| HixlError::EngineGone)?;
        rx.recv().map_err(|_| HixlError::EngineGone)
    }

    fn metadata(&self) -> PeerMeta {
        let regions = self
            .inner
            .regions
            .read()
            .iter()
            .map(|(&id, r)| MetaRegion {
                id,
                addr: r.addr,
                len: r.len,
                device: match r.kind {
                    MemKind::Host => None,
                    MemKind::Device { device } => Some(device),
                },
            })
            .collect();
        PeerMeta::new(&self.inner.backend, &self.inner.engine_name, regions)
    }
}

impl Transport for HixlTransport {
    fn name(&self) -> &'static str {
        "hixl"
    }

    fn caps(&self) -> Caps {
        // The stand-in only reaches processes of this host.
        Caps { device_memory: true, same_host_only: self.inner.backend != "hixl" }
    }

    unsafe fn register(&self, region: Region) -> Result<RegionId, TransportError> {
        if region.len == 0 {
            return Err(TransportError::OutOfBounds { offset: 0, len: 0, region_len: 0 });
        }
        let mem_type = match region.kind {
            MemKind::Host => MEM_HOST,
            MemKind::Device { device } => {
                if device as i32 != self.inner.plan.device_id {
                    warn!(device, engine_device = self.inner.plan.device_id, "registering another NPU's memory");
                }
                MEM_DEVICE
            }
        };
        let (addr, len) = (region.addr as u64, region.len as u64);
        let handle = self.inner.call(|reply| Cmd::Register { addr, len, mem_type, reply }).map_err(|e| {
            // Name the alignment when it is visibly the problem (HIXL only says PARAM_INVALID).
            let align: u64 = if mem_type == MEM_DEVICE { 2 << 20 } else { 64 << 10 };
            match e {
                HixlError::Status { call, code: HixlCode::ParamInvalid, detail } if addr % align != 0 => {
                    let note = format!("address {addr:#x} is not aligned to {} KiB", align >> 10);
                    let detail = if detail.is_empty() { note } else { format!("{detail}; {note}") };
                    HixlError::Status { call, code: HixlCode::ParamInvalid, detail }
                }
                other => other,
            }
        })?;
        let id = self.inner.next();
        self.inner.regions.write().insert(id, LocalRegion { addr, len, kind: region.kind, handle });
        Ok(RegionId(id))
    }

    fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        let handle = self.inner.regions.read().get(&id.0).map(|r| r.handle).ok_or(TransportError::UnknownRegion(id))?;
        self.inner.call(|reply| Cmd::Deregister { handle, reply })?;
        self.inner.regions.write().remove(&id.0);
        Ok(())
    }

    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        Ok(self.metadata().encode())
    }

    /// Connecting again with newer metadata of the same engine refreshes its memory (and, as
    /// HIXL requires for memory registered after a connect, reconnects the link).
    fn connect(&self, metadata: &[u8]) -> Result<PeerId, TransportError> {
        let m = PeerMeta::decode(metadata, &self.inner.backend)?;
        if m.engine == self.inner.engine_name {
            return Err(TransportError::BadMetadata("this is the engine's own metadata".into()));
        }
        let regions: HashMap<u64, (u64, u64)> = m.regions.iter().map(|r| (r.id, (r.addr, r.len))).collect();
        let known = self
            .inner
            .peers
            .read()
            .iter()
            .find(|(_, p)| p.engine == m.engine)
            .map(|(&id, p)| (id, p.regions == regions));
        match known {
            Some((id, true)) => Ok(PeerId(id)),
            Some((id, false)) => {
                let engine = m.engine.clone();
                self.inner.call(|reply| Cmd::Connect { peer: id, engine, refresh: true, reply })?;
                self.inner.peers.write().insert(id, PeerEntry { engine: m.engine, regions });
                Ok(PeerId(id))
            }
            None => {
                let id = self.inner.next();
                let engine = m.engine.clone();
                self.inner.call(|reply| Cmd::Connect { peer: id, engine, refresh: false, reply })?;
                self.inner.peers.write().insert(id, PeerEntry { engine: m.engine, regions });
                Ok(PeerId(id))
            }
        }
    }

    fn disconnect(&self, peer: PeerId) -> Result<(), TransportError> {
        self.inner.peers.write().remove(&peer.0).ok_or(TransportError::UnknownPeer(peer))?;
        self.inner.call(|reply| Cmd::Disconnect { peer: peer.0, reply })?;
        Ok(())
    }

    fn post(&self, peer: PeerId, op: Op, batch: &[Xfer]) -> Result<XferId, TransportError> {
        let mut descs = Vec::with_capacity(batch.len());
        {
            let local = self.inner.regions.read();
            let peers = self.inner.peers.read();
            let remote = &peers.get(&peer.0).ok_or(TransportError::UnknownPeer(peer))?.regions;
            for x in batch {
                let l = local.get(&x.local.0).ok_or(TransportError::UnknownRegion(x.local))?;
                let &(raddr, rlen) = remote.get(&x.remote.0).ok_or(TransportError::UnknownRegion(x.remote))?;
                check_bounds(x.local_offset, x.len, l.len)?;
                check_bounds(x.remote_offset, x.len, rlen)?;
                descs.push(RawDesc {
                    local_addr: l.addr + x.local_offset,
                    remote_addr: raddr + x.remote_offset,
                    len: x.len,
                });
            }
        }
        let id = self.inner.next();
        let shared = XferShared::new();
        self.inner.xfers.lock().insert(id, shared.clone());
        let op = match op {
            Op::Read => OP_READ,
            Op::Write => OP_WRITE,
        };
        if self.inner.tx.send(Cmd::Post { xfer: id, shared, peer: peer.0, op, descs }).is_err() {
            self.inner.xfers.lock().remove(&id);
            return Err(HixlError::EngineGone.into());
        }
        Ok(XferId(id))
    }

    fn status(&self, xfer: XferId) -> Result<XferStatus, TransportError> {
        Ok(match self.poll(xfer)? {
            HixlStatus::Pending => XferStatus::Pending,
            HixlStatus::Done => XferStatus::Done,
            HixlStatus::Failed(e) => XferStatus::Failed(e.into()),
        })
    }

    fn cancel(&self, xfer: XferId) {
        let _ = self.inner.tx.send(Cmd::Cancel { xfer: xfer.0 });
    }

    fn completion(&self, xfer: XferId) -> Option<Arc<tokio::sync::Notify>> {
        self.inner.xfers.lock().get(&xfer.0).map(|s| s.notify.clone())
    }
}

fn check_bounds(offset: u64, len: u64, region_len: u64) -> Result<(), TransportError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds { offset, len, region_len }),
    }
}
