//! The engine thread: the one thread that owns the HIXL engine (and so the ACL context) and makes
//! every control call in order. Transfers are batched here, submitted (TransferAsync from this
//! thread, or TransferSync on worker threads bound to the same ACL context), polled, timed out,
//! retried, and settled.
//!
//! HIXL's rules this follows: register before connect; a request reported finished is never
//! queried again; the caller enforces transfer timeouts and disconnects the link on timeout,
//! after which the link's requests are gone (never queried); disconnect before deregistering.

use crate::batch::{Batcher, Job, Piece};
use crate::config::{HixlPlan, Mode};
use crate::error::{Call, HixlCode, HixlError};
use crate::ffi::{Engine, RawDesc, XFER_COMPLETED, XFER_FAILED, XFER_TIMEOUT, XFER_WAITING};
use kvpool_transport::TransportError;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

pub(crate) type Reply<T> = SyncSender<Result<T, HixlError>>;

/// Where the front end learns that a post settled.
pub(crate) struct XferShared {
    pub outcome: Mutex<Option<Result<(), HixlError>>>,
    pub notify: Arc<tokio::sync::Notify>,
}

impl XferShared {
    pub fn new() -> Arc<XferShared> {
        Arc::new(XferShared { outcome: Mutex::new(None), notify: Arc::new(tokio::sync::Notify::new()) })
    }
}

pub(crate) enum Cmd {
    Alloc {
        len: u64,
        mem_type: u32,
        reply: Reply<u64>,
    },
    Free {
        addr: u64,
        mem_type: u32,
    },
    Register {
        addr: u64,
        len: u64,
        mem_type: u32,
        reply: Reply<u64>,
    },
    Deregister {
        handle: u64,
        reply: Reply<()>,
    },
    /// Connect a new peer, or reconnect a known one whose memory changed (`refresh`).
    Connect {
        peer: u64,
        engine: String,
        refresh: bool,
        reply: Reply<()>,
    },
    Disconnect {
        peer: u64,
        reply: Reply<()>,
    },
    Post {
        xfer: u64,
        shared: Arc<XferShared>,
        peer: u64,
        op: u32,
        descs: Vec<RawDesc>,
    },
    Cancel {
        xfer: u64,
    },
    SyncDone {
        job: u64,
        result: Result<(), HixlError>,
    },
    /// Run something against the engine on its thread (stand-in controls).
    Call(Box<dyn FnOnce(&Engine) + Send>),
    Shutdown,
}

struct PeerState {
    engine: String,
    connected: bool,
    /// Forgotten by the caller; kept while sync workers still use it.
    removed: bool,
    /// Jobs running on sync workers.
    active: usize,
    /// A HIXL Disconnect owed once `active` drops to 0 (sync mode never disconnects a link a
    /// worker is transferring on).
    disconnect_owed: bool,
}

struct XferState {
    remaining: usize,
    err: Option<HixlError>,
    cancelled: bool,
    shared: Arc<XferShared>,
}

struct Inflight {
    /// HIXL request handle (async) or job number (sync).
    id: u64,
    job: Job,
    deadline: Instant,
}

struct SyncJob {
    id: u64,
    engine: String,
    op: u32,
    descs: Vec<RawDesc>,
}

pub(crate) struct EngineLoop {
    eng: Arc<Engine>,
    plan: HixlPlan,
    batcher: Batcher,
    queue: VecDeque<Job>,
    inflight: Vec<Inflight>,
    peers: HashMap<u64, PeerState>,
    xfers: HashMap<u64, XferState>,
    handles: Vec<u64>,
    /// Deregistrations waiting for in-flight transfers to drain.
    deferred: VecDeque<(u64, Reply<()>)>,
    sync_tx: Option<Sender<SyncJob>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    next_job: u64,
    pause: Duration,
}

const MIN_PAUSE: Duration = Duration::from_micros(20);
const MAX_PAUSE: Duration = Duration::from_millis(1);

fn unknown_peer(peer: u64) -> HixlError {
    HixlError::Transport(TransportError::UnknownPeer(kvpool_transport::PeerId(peer)))
}

fn millis(d: Duration) -> i32 {
    d.as_millis().min(i32::MAX as u128) as i32
}

impl EngineLoop {
    pub fn new(eng: Engine, plan: HixlPlan, cmd_tx: Sender<Cmd>) -> EngineLoop {
        let eng = Arc::new(eng);
        let mut workers = Vec::new();
        let mut sync_tx = None;
        if let Mode::Sync { workers: n } = plan.mode {
            let (tx, rx) = std::sync::mpsc::channel::<SyncJob>();
            let rx = Arc::new(std::sync::Mutex::new(rx));
            for i in 0..n {
                let (eng, rx, done) = (eng.clone(), rx.clone(), cmd_tx.clone());
                let timeout = millis(plan.transfer_timeout);
                workers.push(
                    std::thread::Builder::new()
                        .name(format!("kvpool-hixl-sync-{i}"))
                        .spawn(move || sync_worker(&eng, &rx, &done, timeout))
                        .expect("spawn HIXL sync worker"),
                );
            }
            sync_tx = Some(tx);
        }
        EngineLoop {
            eng,
            batcher: Batcher::new(plan.batch),
            plan,
            queue: VecDeque::new(),
            inflight: Vec::new(),
            peers: HashMap::new(),
            xfers: HashMap::new(),
            handles: Vec::new(),
            deferred: VecDeque::new(),
            sync_tx,
            workers,
            next_job: 0,
            pause: MIN_PAUSE,
        }
    }

    fn cap(&self) -> usize {
        match self.plan.mode {
            Mode::Async { max_inflight } => max_inflight,
            Mode::Sync { workers } => workers,
        }
    }

    fn is_async(&self) -> bool {
        matches!(self.plan.mode, Mode::Async { .. })
    }

    pub fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            let wait = self.wait_time();
            let first = match wait {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(t) => rx.recv_timeout(t),
            };
            let mut stop = false;
            match first {
                Ok(c) => {
                    stop = self.handle(c);
                    // Everything already queued is taken before submitting, so that posts which
                    // arrived while the engine was busy share descriptor lists.
                    while !stop {
                        match rx.try_recv() {
                            Ok(c) => stop = self.handle(c),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => stop = true,
            }
            if stop {
                break;
            }
            let mut ready = Vec::new();
            self.batcher.flush(Instant::now(), false, &mut ready);
            self.queue.extend(ready);
            self.run_deferred();
            self.submit();
            if self.is_async() && self.poll() {
                // Retries and freed slots.
                self.submit();
            }
        }
        self.shutdown();
    }

    fn wait_time(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut wait: Option<Duration> = None;
        let mut at_most = |d: Duration| wait = Some(wait.map_or(d, |w| w.min(d)));
        if self.is_async() && !self.inflight.is_empty() {
            at_most(self.pause);
        }
        if let Some(due) = self.batcher.next_due() {
            at_most(due.saturating_duration_since(now));
        }
        // A queue left after submit() with room in flight is blocked: by a backoff (timed
        // here), a deregistration or an owed disconnect (both end with a command or a poll).
        if let Some(nb) = self.queue.front().and_then(|j| j.not_before) {
            at_most(nb.saturating_duration_since(now));
        }
        if !self.deferred.is_empty() && self.inflight.is_empty() {
            at_most(Duration::ZERO);
        }
        wait
    }

    /// Returns true to stop.
    fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Alloc { len, mem_type, reply } => {
                let _ = reply.send(self.eng.malloc(len, mem_type));
            }
            Cmd::Free { addr, mem_type } => {
                if let Err(e) = self.eng.free(addr, mem_type) {
                    warn!(error = %e, "HIXL free");
                }
            }
            Cmd::Register { addr, len, mem_type, reply } => {
                let r = self.eng.register(addr, len, mem_type);
                if let Ok(h) = r {
                    self.handles.push(h);
                }
                let _ = reply.send(r);
            }
            Cmd::Deregister { handle, reply } => self.deferred.push_back((handle, reply)),
            Cmd::Connect { peer, engine, refresh, reply } => {
                let _ = reply.send(self.connect(peer, engine, refresh));
            }
            Cmd::Disconnect { peer, reply } => {
                let _ = reply.send(self.disconnect(peer));
            }
            Cmd::Post { xfer, shared, peer, op, descs } => self.post(xfer, shared, peer, op, &descs),
            Cmd::Cancel { xfer } => self.cancel(xfer),
            Cmd::SyncDone { job, result } => self.sync_done(job, result),
            Cmd::Call(f) => f(&self.eng),
            Cmd::Shutdown => return true,
        }
        false
    }

    fn connect(&mut self, peer: u64, engine: String, refresh: bool) -> Result<(), HixlError> {
        let timeout = millis(self.plan.connect_timeout);
        if refresh {
            let Some(p) = self.peers.get(&peer) else { return Err(unknown_peer(peer)) };
            if p.active > 0 {
                return Err(HixlError::Config(format!(
                    "cannot reconnect to {engine} while transfers to it run on sync workers; retry"
                )));
            }
            // Memory the peer registered since the last Connect is only reachable on a new link.
            if p.connected {
                self.drop_link(peer);
            }
        } else {
            self.peers.insert(
                peer,
                PeerState {
                    engine: engine.clone(),
                    connected: false,
                    removed: false,
                    active: 0,
                    disconnect_owed: false,
                },
            );
        }
        match self.eng.connect(&engine, timeout) {
            Ok(()) => {}
            Err(e) if e.code() == Some(HixlCode::AlreadyConnected) => {}
            Err(e) => {
                if !refresh {
                    self.peers.remove(&peer);
                }
                return Err(e);
            }
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.connected = true;
        }
        info!(peer, %engine, "HIXL connected");
        Ok(())
    }

    fn disconnect(&mut self, peer: u64) -> Result<(), HixlError> {
        let Some(p) = self.peers.get_mut(&peer) else { return Err(unknown_peer(peer)) };
        p.removed = true;
        let err = || {
            HixlError::Transport(TransportError::Io(format!(
                "peer {peer} was disconnected while this transfer was pending"
            )))
        };
        let dropped = self.batcher.take_where(|pe, _| pe == peer);
        self.fail_pieces(&dropped, &err());
        let mut kept = VecDeque::new();
        for job in std::mem::take(&mut self.queue) {
            if job.peer == peer {
                self.fail_pieces(&job.pieces, &err());
            } else {
                kept.push_back(job);
            }
        }
        self.queue = kept;
        if self.is_async() {
            // HIXL forgets the link's requests on Disconnect: settle them here.
            let mut rest = Vec::new();
            for f in std::mem::take(&mut self.inflight) {
                if f.job.peer == peer {
                    self.fail_pieces(&f.job.pieces, &err());
                } else {
                    rest.push(f);
                }
            }
            self.inflight = rest;
        }
        let p = self.peers.get_mut(&peer).expect("checked above");
        if p.active > 0 {
            p.disconnect_owed = p.connected;
            return Ok(());
        }
        let p = self.peers.remove(&peer).expect("checked above");
        if p.connected {
            match self.eng.disconnect(&p.engine, millis(self.plan.connect_timeout)) {
                Ok(()) => {}
                Err(e) if e.code() == Some(HixlCode::NotConnected) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Tear down the link to `peer` (HIXL: after a timeout or failure, and before reconnecting).
    /// In async mode the link's other requests are gone with it and are resubmitted later.
    fn drop_link(&mut self, peer: u64) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        if !p.connected {
            return;
        }
        p.connected = false;
        if p.active > 0 {
            p.disconnect_owed = true;
            return;
        }
        let engine = p.engine.clone();
        if let Err(e) = self.eng.disconnect(&engine, millis(self.plan.connect_timeout)) {
            if e.code() != Some(HixlCode::NotConnected) {
                warn!(peer, %engine, error = %e, "HIXL disconnect");
            }
        }
        if self.is_async() {
            let (gone, rest): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.inflight).into_iter().partition(|f| f.job.peer == peer);
            self.inflight = rest;
            for f in gone.into_iter().rev() {
                debug!(peer, "resubmitting a request the disconnect took down");
                self.queue.push_front(f.job);
            }
        }
    }

    fn post(&mut self, xfer: u64, shared: Arc<XferShared>, peer: u64, op: u32, descs: &[RawDesc]) {
        self.xfers.insert(xfer, XferState { remaining: 0, err: None, cancelled: false, shared });
        if self.peers.get(&peer).is_none_or(|p| p.removed) {
            self.xfers.get_mut(&xfer).expect("inserted").err = Some(unknown_peer(peer));
            self.settle_if_done(xfer);
            return;
        }
        let mut ready = Vec::new();
        let n = self.batcher.add(peer, op, xfer, descs, Instant::now(), &mut ready);
        self.xfers.get_mut(&xfer).expect("inserted").remaining = n;
        self.queue.extend(ready);
        self.settle_if_done(xfer);
    }

    fn cancel(&mut self, xfer: u64) {
        let Some(x) = self.xfers.get_mut(&xfer) else { return };
        x.cancelled = true;
        // Not started: skipped.
        let dropped = self.batcher.take_where(|_, p| p.xfer == xfer).len() + self.unqueue(xfer);
        self.done_pieces(xfer, dropped);
        // Running: HIXL cannot cancel a request; the caller must Disconnect (async). Sync
        // transfers return by their own timeout.
        if self.is_async() {
            let peers: Vec<u64> = self
                .inflight
                .iter()
                .filter(|f| f.job.pieces.iter().any(|p| p.xfer == xfer))
                .map(|f| f.job.peer)
                .collect();
            for peer in peers {
                info!(peer, xfer, "cancel: disconnecting the link its requests run on");
                self.drop_link(peer);
            }
            // The dropped requests went back to the queue: take this post's pieces out again.
            let dropped = self.unqueue(xfer);
            self.done_pieces(xfer, dropped);
        }
    }

    /// Take the pieces of `xfer` out of the queued jobs (and jobs left empty); returns how many.
    fn unqueue(&mut self, xfer: u64) -> usize {
        let mut dropped = 0;
        for job in self.queue.iter_mut() {
            let before = job.pieces.len();
            job.pieces.retain(|p| p.xfer != xfer);
            dropped += before - job.pieces.len();
        }
        self.queue.retain(|j| !j.pieces.is_empty());
        dropped
    }

    fn done_pieces(&mut self, xfer: u64, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(x) = self.xfers.get_mut(&xfer) {
            x.remaining = x.remaining.saturating_sub(n);
        }
        self.settle_if_done(xfer);
    }

    fn fail_pieces(&mut self, pieces: &[Piece], err: &HixlError) {
        for p in pieces {
            if let Some(x) = self.xfers.get_mut(&p.xfer) {
                x.err.get_or_insert_with(|| err.clone());
            }
            self.done_pieces(p.xfer, 1);
        }
    }

    fn settle_if_done(&mut self, xfer: u64) {
        let Some(x) = self.xfers.get(&xfer) else { return };
        if x.remaining > 0 {
            return;
        }
        let x = self.xfers.remove(&xfer).expect("present");
        let outcome = match (x.err, x.cancelled) {
            (Some(e), _) => Err(e),
            (None, true) => Err(HixlError::Transport(TransportError::Cancelled)),
            (None, false) => Ok(()),
        };
        *x.shared.outcome.lock() = Some(outcome);
        x.shared.notify.notify_one();
    }

    /// Whether pieces of this post should still move.
    fn live(&self, p: &Piece) -> bool {
        self.xfers.get(&p.xfer).is_some_and(|x| !x.cancelled && x.err.is_none())
    }

    fn submit(&mut self) {
        let now = Instant::now();
        while self.inflight.len() < self.cap() && self.deferred.is_empty() {
            let Some(job) = self.queue.front() else { break };
            if job.not_before.is_some_and(|t| t > now) {
                break;
            }
            let mut job = self.queue.pop_front().expect("front exists");
            // Posts that failed or were cancelled meanwhile: their pieces are dropped.
            let (live, dead): (Vec<Piece>, Vec<Piece>) = job.pieces.iter().partition(|p| self.live(p));
            for p in dead {
                self.done_pieces(p.xfer, 1);
            }
            if live.is_empty() {
                continue;
            }
            job.pieces = live;
            let Some(peer) = self.peers.get(&job.peer) else {
                self.fail_pieces(&job.pieces, &unknown_peer(job.peer));
                continue;
            };
            if peer.removed {
                self.fail_pieces(&job.pieces, &unknown_peer(job.peer));
                continue;
            }
            if peer.disconnect_owed {
                // A sync worker still runs on the old link: wait for it.
                self.queue.push_front(job);
                break;
            }
            let engine = peer.engine.clone();
            if !peer.connected {
                match self.eng.connect(&engine, millis(self.plan.connect_timeout)) {
                    Ok(()) => {}
                    Err(e) if e.code() == Some(HixlCode::AlreadyConnected) => {}
                    Err(e) => {
                        warn!(peer = job.peer, %engine, error = %e, "HIXL reconnect");
                        self.job_failed(job, e);
                        continue;
                    }
                }
                self.peers.get_mut(&job.peer).expect("present").connected = true;
            }
            let descs: Vec<RawDesc> = job.pieces.iter().map(|p| p.desc).collect();
            let deadline = Instant::now() + self.plan.transfer_timeout;
            match (&self.plan.mode, &self.sync_tx) {
                (Mode::Sync { .. }, Some(tx)) => {
                    self.next_job += 1;
                    let id = self.next_job;
                    if tx.send(SyncJob { id, engine, op: job.op, descs }).is_err() {
                        self.fail_pieces(&job.pieces, &HixlError::EngineGone);
                        continue;
                    }
                    self.peers.get_mut(&job.peer).expect("present").active += 1;
                    self.inflight.push(Inflight { id, job, deadline });
                }
                _ => match self.eng.transfer_async(&engine, job.op, &descs) {
                    Ok(req) => {
                        self.pause = MIN_PAUSE;
                        self.inflight.push(Inflight { id: req, job, deadline });
                    }
                    Err(e) => self.job_failed(job, e),
                },
            }
        }
    }

    /// Query every request once; settle the finished ones. Returns whether any finished.
    fn poll(&mut self) -> bool {
        let now = Instant::now();
        let mut finished: Vec<(Job, Result<(), HixlError>)> = Vec::new();
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &self.inflight[i];
            let result = match self.eng.transfer_status(f.id) {
                Ok(XFER_WAITING) if now < f.deadline => {
                    i += 1;
                    continue;
                }
                Ok(XFER_WAITING) | Ok(XFER_TIMEOUT) => Err(HixlError::TransferTimeout(self.plan.transfer_timeout)),
                Ok(XFER_COMPLETED) => Ok(()),
                Ok(XFER_FAILED) => Err(HixlError::status(Call::Transfer, HixlCode::Failed, "the request ended FAILED")),
                Ok(other) => {
                    Err(HixlError::status(Call::TransferStatus, HixlCode::Other(other), "unknown request state"))
                }
                Err(e) => Err(e),
            };
            let f = self.inflight.swap_remove(i);
            finished.push((f.job, result));
        }
        if finished.is_empty() {
            self.pause = (self.pause * 2).min(MAX_PAUSE);
            return false;
        }
        self.pause = MIN_PAUSE;
        for (job, result) in finished {
            match result {
                Ok(()) => self.job_done(job),
                Err(e) => self.job_failed(job, e),
            }
        }
        true
    }

    fn job_done(&mut self, job: Job) {
        for p in &job.pieces {
            self.done_pieces(p.xfer, 1);
        }
    }

    /// A failed HIXL call or request: tear the link down where HIXL requires it, then retry the
    /// job (after reconnecting) if the failure is one that can pass, or fail its posts.
    fn job_failed(&mut self, mut job: Job, e: HixlError) {
        let code = e.code();
        if matches!(code, Some(HixlCode::Timeout) | Some(HixlCode::NotConnected) | Some(HixlCode::Failed)) {
            self.drop_link(job.peer);
        }
        let retry = code.is_some_and(|c| c.retryable()) && job.attempts < self.plan.retry_times;
        warn!(peer = job.peer, attempt = job.attempts, retry, error = %e, "HIXL transfer failed");
        if retry {
            job.attempts += 1;
            if code == Some(HixlCode::ResourceExhausted) {
                job.not_before = Some(Instant::now() + Duration::from_millis(5 << job.attempts.min(6)));
            }
            self.queue.push_front(job);
        } else {
            self.fail_pieces(&job.pieces, &e);
        }
    }

    fn sync_done(&mut self, id: u64, result: Result<(), HixlError>) {
        let Some(pos) = self.inflight.iter().position(|f| f.id == id) else { return };
        let f = self.inflight.swap_remove(pos);
        let peer = f.job.peer;
        if let Some(p) = self.peers.get_mut(&peer) {
            p.active -= 1;
        }
        match result {
            Ok(()) => self.job_done(f.job),
            Err(e) => self.job_failed(f.job, e),
        }
        // A disconnect owed to this link can happen now that no worker uses it.
        if let Some(p) = self.peers.get_mut(&peer) {
            if p.active == 0 && p.disconnect_owed {
                p.disconnect_owed = false;
                p.connected = false;
                let (engine, removed) = (p.engine.clone(), p.removed);
                if let Err(e) = self.eng.disconnect(&engine, millis(self.plan.connect_timeout)) {
                    if e.code() != Some(HixlCode::NotConnected) {
                        warn!(peer, %engine, error = %e, "HIXL disconnect");
                    }
                }
                if removed {
                    self.peers.remove(&peer);
                }
            }
        }
    }

    /// Deregistrations, once nothing is in flight: HIXL wants every link down first.
    fn run_deferred(&mut self) {
        if self.deferred.is_empty() || !self.inflight.is_empty() {
            return;
        }
        let ids: Vec<u64> = self.peers.keys().copied().collect();
        for peer in ids {
            self.drop_link(peer);
        }
        while let Some((handle, reply)) = self.deferred.pop_front() {
            let r = self.eng.deregister(handle);
            if r.is_ok() {
                self.handles.retain(|&h| h != handle);
            }
            let _ = reply.send(r);
        }
    }

    fn shutdown(&mut self) {
        let mut rest = Vec::new();
        self.batcher.flush(Instant::now(), true, &mut rest);
        self.queue.extend(rest);
        let pieces: Vec<Piece> = self
            .queue
            .drain(..)
            .flat_map(|j| j.pieces)
            .chain(std::mem::take(&mut self.inflight).into_iter().flat_map(|f| f.job.pieces))
            .collect();
        self.fail_pieces(&pieces, &HixlError::EngineGone);
        for (_, reply) in self.deferred.drain(..) {
            let _ = reply.send(Err(HixlError::EngineGone));
        }
        // Workers finish their current TransferSync (bounded by its timeout) and exit.
        self.sync_tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        for p in self.peers.values().filter(|p| p.connected) {
            let _ = self.eng.disconnect(&p.engine, millis(self.plan.connect_timeout));
        }
        for h in self.handles.drain(..) {
            let _ = self.eng.deregister(h);
        }
        debug!("HIXL engine thread stopped");
    }
}

fn sync_worker(eng: &Engine, rx: &std::sync::Mutex<Receiver<SyncJob>>, done: &Sender<Cmd>, timeout_ms: i32) {
    // HIXL calls need the engine's ACL context on this thread.
    if let Err(e) = eng.bind_thread() {
        warn!(error = %e, "HIXL sync worker cannot take the ACL context; its transfers will fail");
    }
    loop {
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let result = eng.transfer_sync(&job.engine, job.op, &job.descs, timeout_ms);
        if done.send(Cmd::SyncDone { job: job.id, result }).is_err() {
            return;
        }
    }
}
