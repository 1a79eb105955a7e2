//! Version 2 requests: the same-host shared-memory path (`ShmAttach`, `PutFrom`, `GetInto`) and
//! the one-sided descriptors (`PutIntent` / `Write` / `PutDone`, `GetLocate` / `Read` /
//! `Release`) on which transports such as HIXL build.

use super::session::{LeaseHold, Reserved, Session};
use super::{
    check_keys, check_put, error, expect_end, malformed, read_exact_by, write_by, Fail, RequestRecv, RequestSend,
    Shared,
};
use crate::store::{DramBlock, GetPlan, PutPlan, Served};
use kvpool_proto::{
    BufSlice, DataHeader, ErrorCode, GetIntoRequest, GetItem, GetResponse, Grant, Located, LocatedItem, Location,
    PutDoneRequest, PutFromRequest, PutIntentRequest, ReadRequest, ReleaseRequest, Request, Response, ShmOffer,
    StatusList, WriteRequest,
};
use kvpool_transport::local::Digests;
use kvpool_transport::{MemKind, Op, Region, RegionId, Transport, Xfer};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant as Deadline;
use tracing::{debug, warn};

/// The copy engine for same-host clients: the DRAM segment is its local region.
pub struct DataPath {
    pub transport: Arc<kvpool_transport::local::LocalTransport>,
    pub segment: RegionId,
    /// The Unix socket same-host clients attach their buffers through; `None` when disabled.
    pub shm: Option<kvpool_transport::shm::ShmServer>,
    /// The same-host control channel (requests over a Unix socket); `None` when disabled.
    pub local: Option<super::local::LocalControl>,
}

/// Location of bytes that are not in registered memory (read them with `Read`).
const NOT_REGISTERED: u32 = u32::MAX;

fn unsupported(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::Unsupported, message))
}

fn invalid(message: impl Into<String>) -> Fail {
    Fail::Reply(error(ErrorCode::InvalidArgument, message))
}

pub(super) async fn dispatch<R: RequestRecv, W: RequestSend>(
    req: Request,
    recv: &mut R,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
    deadline: Deadline,
) -> Result<Option<Response>, Fail> {
    if session.version < 2 {
        return Err(unsupported("this request needs a version 2 hello"));
    }
    let resp = match req {
        Request::Subscribe(sub) => {
            super::subscribe::subscribe(sub, recv, send, session, s, deadline).await?;
            return Ok(None);
        }
        Request::ShmAttach => {
            expect_end(recv, deadline).await?;
            shm_attach(session, s)?
        }
        Request::LocalAttach => {
            expect_end(recv, deadline).await?;
            local_attach(session, s)?
        }
        Request::PutFrom(p) => {
            expect_end(recv, deadline).await?;
            put_from(p, session, s).await?
        }
        Request::GetInto(g) => {
            expect_end(recv, deadline).await?;
            get_into(g, session, s).await?
        }
        Request::PutIntent(p) => {
            expect_end(recv, deadline).await?;
            put_intent(p, session, s).await?
        }
        Request::Write(w) => write(w, recv, session, s).await?,
        Request::PutDone(d) => {
            expect_end(recv, deadline).await?;
            put_done(d, session, s).await?
        }
        Request::GetLocate(g) => {
            expect_end(recv, deadline).await?;
            get_locate(&g.keys, session, s).await?
        }
        Request::Read(r) => {
            expect_end(recv, deadline).await?;
            // Answered with its frame and raw bytes already.
            read(r, send, session, s).await?;
            return Ok(None);
        }
        Request::Release(ReleaseRequest { lease }) => {
            expect_end(recv, deadline).await?;
            if !session.release(lease) {
                return Err(Fail::Reply(error(ErrorCode::Expired, format!("no lease {lease} on this connection"))));
            }
            Response::Done
        }
        Request::LookupLease(l) => {
            expect_end(recv, deadline).await?;
            super::connector::lookup_lease(l, session, s)?
        }
        Request::RemoveMatching(r) => {
            expect_end(recv, deadline).await?;
            super::connector::remove_matching(r, session, s)?
        }
        other => return Err(malformed(format!("{other:?} is not a version 2 request"))),
    };
    Ok(Some(resp))
}

fn shm_attach(session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let shm = s.data_path.as_ref().and_then(|d| d.shm.as_ref()).ok_or_else(|| {
        unsupported("this server offers no shared-memory transport (transport.protocol is not \"shm\")")
    })?;
    let ticket = shm.issue().map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let offer = ShmOffer { socket_path: shm.path().display().to_string(), token: ticket.token.to_vec() };
    session.set_shm(ticket);
    Ok(Response::ShmOffer(offer))
}

fn local_attach(session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let local = s.data_path.as_ref().and_then(|d| d.local.as_ref()).ok_or_else(|| {
        unsupported("this server offers no same-host control channel (transport.protocol is not \"shm\", or its socket could not be bound)")
    })?;
    let (ticket, offer) = local.issue(session).map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    session.set_local(ticket);
    Ok(Response::LocalOffer(offer))
}

/// The data path and this connection's attached peer, or why shm cannot be used.
fn shm_peer<'a>(session: &Session, s: &'a Shared) -> Result<(&'a DataPath, kvpool_transport::PeerId), Fail> {
    let dp =
        s.data_path.as_ref().filter(|d| d.shm.is_some()).ok_or_else(|| unsupported("no shared-memory transport"))?;
    let peer = session
        .shm_peer()
        .ok_or_else(|| unsupported("no shared buffers attached on this connection (ShmAttach first)"))?;
    Ok((dp, peer))
}

/// A put item whose bytes are being copied in.
enum Staged {
    Skip(ErrorCode),
    Dram(u64, DramBlock),
    /// Bound for SSD: staged in a buffer registered with the engine for the copy.
    Ssd(u64, Vec<u8>, Option<RegionId>),
}

/// Register a heap buffer with the engine for one transfer.
fn register_vec(t: &dyn Transport, v: &mut [u8]) -> Result<RegionId, Fail> {
    // SAFETY: the buffer is owned by the staged item, which outlives the transfer (it is only
    // dropped after the transfer settled) and is deregistered then.
    unsafe { t.register(Region { addr: v.as_mut_ptr() as usize, len: v.len(), kind: MemKind::Host }) }
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))
}

async fn put_from(p: PutFromRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let total = check_put(&p.items, &s.limits)?;
    if p.sources.len() != p.items.len() {
        return Err(invalid(format!("{} items but {} sources", p.items.len(), p.sources.len())));
    }
    if let Some((i, src)) =
        p.items.iter().zip(&p.sources).enumerate().find(|(_, (it, src))| src.len != it.size).map(|(i, (_, s))| (i, s))
    {
        return Err(invalid(format!("source {i} holds {} bytes for a value of {}", src.len, p.items[i].size)));
    }
    let (dp, peer) = shm_peer(session, s)?;
    let tenant = session.principal.tenant_id;
    let plans = s.store.plan_put(tenant, &p.items, p.mode);
    let space_by = Deadline::now() + s.store.cfg.put_wait;
    let t: &dyn Transport = &*dp.transport;
    let mut staged = Vec::with_capacity(p.items.len());
    let mut xfers = Vec::new();
    for ((it, plan), src) in p.items.iter().zip(plans).zip(&p.sources) {
        let st = match plan {
            PutPlan::Skip(code) => Staged::Skip(code),
            PutPlan::Dram(id) => match s.store.reserve(tenant, it.size, space_by).await {
                Err(code) => Staged::Skip(code),
                Ok(blk) => {
                    xfers.push(xfer(dp.segment, blk.offset(), src, it.size));
                    Staged::Dram(id, blk)
                }
            },
            PutPlan::Ssd(id) => {
                let mut v = vec![0u8; it.size as usize];
                let r = register_vec(t, &mut v)?;
                xfers.push(xfer(r, 0, src, it.size));
                Staged::Ssd(id, v, Some(r))
            }
        };
        staged.push(st);
    }
    let (staged, sums) = copy(dp, peer, Op::Read, &xfers, staged, s.timeouts.transfer(total), &s.metrics).await?;
    // The copy threads hashed each block as it landed in server memory: that is its checksum.
    let mut sums = (0..sums.len()).map(|i| sums.get(i));
    let mut results = Vec::with_capacity(staged.len());
    for (it, st) in p.items.iter().zip(staged) {
        results.push(match st {
            Staged::Skip(code) => code,
            Staged::Dram(id, blk) => s.store.commit(tenant, id, it, p.mode, blk, sums.next()),
            Staged::Ssd(id, data, _) => s.store.commit_ssd(tenant, id, it, p.mode, data, sums.next()).await,
        });
    }
    Ok(Response::Put(StatusList { results }))
}

fn xfer(local: RegionId, local_offset: u64, remote: &BufSlice, len: u64) -> Xfer {
    Xfer { local, local_offset, remote: RegionId(remote.region), remote_offset: remote.offset, len }
}

/// Anything that owns memory a transfer touches, and may hold a temporary registration.
trait Holds: Send + 'static {
    fn temp_region(&self) -> Option<RegionId>;
}

impl Holds for Staged {
    fn temp_region(&self) -> Option<RegionId> {
        match self {
            Staged::Ssd(_, _, r) => *r,
            _ => None,
        }
    }
}

/// Post one batch and wait for it in a task that owns `held` (the memory the batch touches), so
/// that a cancelled request can never free that memory under a running copy. Temporary
/// registrations are dropped once the batch settled. Returns the xxh3-64 of each descriptor's
/// bytes as written, which the copy threads compute while the bytes are in cache.
async fn copy<H: Holds>(
    dp: &DataPath,
    peer: kvpool_transport::PeerId,
    op: Op,
    xfers: &[Xfer],
    held: Vec<H>,
    timeout: Duration,
    metrics: &crate::metrics::Metrics,
) -> Result<(Vec<H>, Digests), Fail> {
    let t = dp.transport.clone();
    let started = std::time::Instant::now();
    let bytes: u64 = xfers.iter().map(|x| x.len).sum();
    let direction = if op == Op::Read { "in" } else { "out" };
    let unregister = |t: &kvpool_transport::local::LocalTransport, held: &[H]| {
        for r in held.iter().filter_map(Holds::temp_region) {
            let _ = t.deregister(r);
        }
    };
    if xfers.is_empty() {
        unregister(&t, &held);
        return Ok((held, Digests::default()));
    }
    let (id, sums) = match t.post_hashed(peer, op, xfers) {
        Ok(x) => x,
        Err(e) => {
            unregister(&t, &held);
            return Err(invalid(format!("transfer refused: {e}")));
        }
    };
    // Small batches are copied during the post: nothing to wait for.
    if let Ok(kvpool_transport::XferStatus::Done) = t.status(id) {
        unregister(&t, &held);
        metrics.transferred("shm", direction, bytes, started.elapsed());
        return Ok((held, sums));
    }
    let task = tokio::spawn(async move {
        let r = kvpool_transport::wait(&*t, id, timeout).await;
        unregister(&t, &held);
        (r, held)
    });
    match task.await {
        Ok((Ok(()), held)) => {
            metrics.transferred("shm", direction, bytes, started.elapsed());
            Ok((held, sums))
        }
        Ok((Err(kvpool_transport::TransportError::Timeout(_)), _)) => {
            Err(Fail::Reply(error(ErrorCode::Timeout, "the copy did not finish in time")))
        }
        Ok((Err(e), _)) => Err(Fail::Reply(error(ErrorCode::Internal, format!("copy failed: {e}")))),
        Err(e) => Err(Fail::Reply(error(ErrorCode::Internal, format!("copy task failed: {e}")))),
    }
}

/// A get item being copied out.
struct Out {
    served: Option<Served>,
    temp: Option<RegionId>,
}

impl Holds for Out {
    fn temp_region(&self) -> Option<RegionId> {
        self.temp
    }
}

/// Bytes of a located block, for a read or a copy.
async fn serve(s: &Shared, plan: GetPlan) -> Result<Served, ErrorCode> {
    match plan {
        GetPlan::Missing => Err(ErrorCode::NotFound),
        GetPlan::Dram { block, checksum } => Ok(Served::Dram(block, checksum, kvpool_policy_sdk::Tier::Dram)),
        GetPlan::Ssd { id, file, size, checksum } => s.store.read_ssd(id, file, size, checksum).await,
    }
}

async fn get_into(g: GetIntoRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    check_keys(&g.keys, g.keys.len(), &s.limits)?;
    if g.dests.len() != g.keys.len() {
        return Err(invalid(format!("{} keys but {} destinations", g.keys.len(), g.dests.len())));
    }
    let (dp, peer) = shm_peer(session, s)?;
    let t: &dyn Transport = &*dp.transport;
    let plans = s.store.plan_get(session.principal.tenant_id, &g.keys);
    let mut items = Vec::with_capacity(plans.len());
    let mut held = Vec::with_capacity(plans.len());
    let mut xfers = Vec::new();
    let mut total = 0;
    for (plan, dest) in plans.into_iter().zip(&g.dests) {
        let mut out = Out { served: None, temp: None };
        let item = match serve(s, plan).await {
            Err(code) => GetItem { status: code, size: 0, tier: 0, checksum: 0, lease_ms: 0 },
            Ok(sv) => {
                let size = sv.bytes().len() as u64;
                let item = GetItem {
                    status: ErrorCode::Ok,
                    size,
                    tier: sv.tier() as u8,
                    checksum: sv.checksum(),
                    lease_ms: 0,
                };
                if size > dest.len {
                    GetItem { status: ErrorCode::ValueTooLarge, ..item }
                } else {
                    let (region, offset) = match &sv {
                        Served::Dram(b, _, _) => (dp.segment, b.offset()),
                        Served::Owned(v, _, _) => {
                            // SAFETY: as for `register_vec`: `out` owns the bytes until the copy settled.
                            let r = unsafe {
                                t.register(Region { addr: v.as_ptr() as usize, len: v.len(), kind: MemKind::Host })
                            }
                            .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
                            out.temp = Some(r);
                            (r, 0)
                        }
                    };
                    xfers.push(xfer(region, offset, dest, size));
                    total += size;
                    out.served = Some(sv);
                    item
                }
            }
        };
        items.push(item);
        held.push(out);
    }
    let (held, sums) = copy(dp, peer, Op::Write, &xfers, held, s.timeouts.transfer(total), &s.metrics).await?;
    // Every block copied was hashed as it landed in the client's buffer: an item is `Ok` only
    // if that matches the checksum recorded at put, so no failed block is ever served.
    let mut sums = (0..sums.len()).map(|i| sums.get(i));
    let tenant = session.principal.tenant_id;
    for ((item, out), key) in items.iter_mut().zip(&held).zip(&g.keys) {
        let Some(sv) = &out.served else { continue };
        if sums.next() == Some(item.checksum) {
            continue;
        }
        if crate::store::checksum(sv.bytes()) != item.checksum {
            // The server's own copy fails its checksum: drop the block, never serve it.
            warn!(key = %String::from_utf8_lossy(key), "checksum mismatch on a shared-memory get; block dropped");
            s.store.drop_corrupt_key(tenant, key);
        } else {
            // The server's copy is sound: the destination was written during the copy.
            debug!(key = %String::from_utf8_lossy(key), "destination changed while it was filled");
        }
        *item = GetItem { status: ErrorCode::Corrupt, size: 0, tier: 0, checksum: 0, lease_ms: 0 };
    }
    Ok(Response::Filled(GetResponse { items }))
}

/// How long a grant or a lease of `bytes` stays valid.
fn hold_for(s: &Shared, bytes: u64) -> Duration {
    s.timeouts.transfer(bytes)
}

async fn put_intent(p: PutIntentRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    check_put(&p.items, &s.limits)?;
    let tenant = session.principal.tenant_id;
    let plans = s.store.plan_put(tenant, &p.items, p.mode);
    let space_by = Deadline::now() + s.store.cfg.put_wait;
    let mut grants = Vec::with_capacity(p.items.len());
    for (it, plan) in p.items.iter().zip(plans) {
        let none = Grant {
            status: ErrorCode::Ok,
            reservation: 0,
            location: Location { node: 0, region: 0, offset: 0 },
            expires_ms: 0,
        };
        // One-sided writes land in DRAM; a block admission sent to SSD is demoted later.
        let id = match plan {
            PutPlan::Skip(code) => {
                grants.push(Grant { status: code, ..none });
                continue;
            }
            PutPlan::Dram(id) | PutPlan::Ssd(id) => id,
        };
        match s.store.reserve(tenant, it.size, space_by).await {
            Err(code) => grants.push(Grant { status: code, ..none }),
            Ok(blk) => {
                let offset = blk.offset();
                let ttl = hold_for(s, it.size);
                let r = Reserved { id, item: it.clone(), mode: p.mode, block: tokio::sync::Mutex::new(Some(blk)) };
                let reservation = session.grant(r, ttl);
                grants.push(Grant {
                    status: ErrorCode::Ok,
                    reservation,
                    location: Location { node: 0, region: 0, offset },
                    expires_ms: ttl.as_millis().min(u32::MAX as u128) as u32,
                });
            }
        }
    }
    Ok(Response::PutGrant(kvpool_proto::PutGrant { grants }))
}

fn expired(what: &str, id: u64) -> Fail {
    Fail::Reply(error(
        ErrorCode::Expired,
        format!("no {what} {id} on this connection (expired, used, or never granted)"),
    ))
}

async fn write<R: RequestRecv>(
    w: WriteRequest,
    recv: &mut R,
    session: &Arc<Session>,
    s: &Shared,
) -> Result<Response, Fail> {
    let r = session.reservation(w.reservation).ok_or_else(|| expired("reservation", w.reservation))?;
    let by = Deadline::now() + s.timeouts.transfer(w.size);
    let mut guard = r.block.lock().await;
    let blk = guard.as_mut().ok_or_else(|| expired("reservation", w.reservation))?;
    let end =
        w.offset.checked_add(w.size).filter(|&e| e <= blk.len()).ok_or_else(|| {
            invalid(format!("write of {} bytes at {} into a block of {}", w.size, w.offset, blk.len()))
        })?;
    let started = std::time::Instant::now();
    read_exact_by(recv, &mut blk.bytes_mut()[w.offset as usize..end as usize], by, "the declared bytes").await?;
    expect_end(recv, by).await?;
    s.metrics.transferred(recv.transport(), "in", w.size, started.elapsed());
    Ok(Response::Done)
}

async fn put_done(d: PutDoneRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    if d.reservations.len() > s.limits.max_batch as usize {
        return Err(Fail::Reply(error(ErrorCode::BatchTooLarge, "too many reservations")));
    }
    let tenant = session.principal.tenant_id;
    let mut results = Vec::with_capacity(d.reservations.len());
    for id in d.reservations {
        let Some(r) = session.take_reservation(id) else {
            results.push(ErrorCode::Expired);
            continue;
        };
        let blk = r.block.lock().await.take();
        results.push(match blk {
            Some(blk) => s.store.commit(tenant, r.id, &r.item, r.mode, blk, None),
            None => ErrorCode::Expired,
        });
    }
    Ok(Response::Put(StatusList { results }))
}

async fn get_locate(keys: &[Vec<u8>], session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    check_keys(keys, keys.len(), &s.limits)?;
    let plans = s.store.plan_get(session.principal.tenant_id, keys);
    let mut items = Vec::with_capacity(plans.len());
    let mut blocks = Vec::with_capacity(plans.len());
    let mut total = 0;
    for plan in plans {
        match serve(s, plan).await {
            Err(code) => {
                items.push(LocatedItem {
                    status: code,
                    size: 0,
                    tier: 0,
                    checksum: 0,
                    location: Location { node: 0, region: 0, offset: 0 },
                });
                blocks.push(None);
            }
            Ok(sv) => {
                let location = match &sv {
                    Served::Dram(b, _, _) => Location { node: 0, region: 0, offset: b.offset() },
                    Served::Owned(..) => Location { node: 0, region: NOT_REGISTERED, offset: 0 },
                };
                let size = sv.bytes().len() as u64;
                total += size;
                items.push(LocatedItem {
                    status: ErrorCode::Ok,
                    size,
                    tier: sv.tier() as u8,
                    checksum: sv.checksum(),
                    location,
                });
                blocks.push(Some(sv));
            }
        }
    }
    let ttl = hold_for(s, total).max(s.store.cfg.lease_ttl);
    let lease =
        if blocks.iter().any(Option::is_some) { session.lease(LeaseHold { blocks, held: None }, ttl) } else { 0 };
    Ok(Response::Located(Located { lease, lease_ms: ttl.as_millis().min(u32::MAX as u128) as u32, items }))
}

async fn read<W: RequestSend>(r: ReadRequest, send: &mut W, session: &Arc<Session>, s: &Shared) -> Result<(), Fail> {
    let hold = session.leased(r.lease).ok_or_else(|| expired("lease", r.lease))?;
    let sv = hold
        .blocks
        .get(r.index as usize)
        .and_then(Option::as_ref)
        .ok_or_else(|| invalid(format!("lease {} has no block {}", r.lease, r.index)))?;
    let bytes = sv.bytes();
    let end =
        r.offset.checked_add(r.size).filter(|&e| e <= bytes.len() as u64).ok_or_else(|| {
            invalid(format!("read of {} bytes at {} from a block of {}", r.size, r.offset, bytes.len()))
        })?;
    let by = Deadline::now() + s.timeouts.transfer(r.size);
    let frame = kvpool_proto::frame::encode_frame(&Response::Data(DataHeader { size: r.size }))
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let started = std::time::Instant::now();
    write_by(send, &frame, by).await?;
    write_by(send, &bytes[r.offset as usize..end as usize], by).await?;
    send.finish();
    s.metrics.transferred(send.transport(), "out", r.size, started.elapsed());
    Ok(())
}
