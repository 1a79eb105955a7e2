//! Every put, whatever carries its bytes: one path, [`stage`] then [`commit`].
//!
//! 1. plan: the store decides every item before any byte moves ([`Store::plan_put`]: existing
//!    keys, admission, placement);
//! 2. place: each stored item gets where its bytes land, a reserved DRAM range (or a buffer
//!    bound for SSD) ([`Store::reserve_for`]);
//! 3. fill: a [`ValueSource`] moves the bytes there and hashes them as they land;
//! 4. commit: the store publishes each filled block under its checksum.
//!
//! The sources are in [`super::source`]: the request's own stream (`Put`, `NodePut`, over QUIC,
//! the Unix socket or the TCP bulk channel), the copy engine (`PutFrom`, shared memory), and one-sided writes
//! (`PutIntent`, then `Write` or a transport such as HIXL, then `PutDone`). A one-sided put
//! spans requests: its [`Staged`] items wait in the [`Session`] between them.
//!
//! The core's plan of an item travels unchanged, inside its [`Placed`](crate::store::put::Placed),
//! from the plan to the commit.
//!
//! [`Store::plan_put`]: crate::store::Store::plan_put
//! [`Store::reserve_for`]: crate::store::Store::reserve_for

use super::session::{expired, Session};
use super::shared::Shared;
use super::shm::shm_peer;
use super::source::{Granted, ShmSource, StreamSource, ValueSource};
use super::staged::Staged;
use super::stream::{check_keys, error, expect_end, invalid, read_exact_by, Fail, RequestRecv};
use crate::auth::Principal;
use crate::store::put::{Landing, PutError};
use kvpool_core::{PinRequest, PutRefusal, PutSpec};
use kvpool_proto::{
    ErrorCode, Grant, Limits, Location, NodePutRequest, PinSpec, PutDoneRequest, PutFromRequest, PutIntentRequest,
    PutItem, PutMode, Response, StatusList, WriteRequest,
};
use std::sync::Arc;
use tokio::time::Instant as Deadline;

/// The index's view of a wire item.
fn spec(item: &PutItem) -> PutSpec<'_> {
    PutSpec {
        key: &item.key,
        size: item.size,
        parent: item.parent.as_deref(),
        tokens: item.tokens,
        seq_tokens: item.seq_tokens,
        pin: match item.pin {
            PinSpec::None => PinRequest::None,
            PinSpec::Hard => PinRequest::Hard,
            PinSpec::Soft { ttl_ms } => PinRequest::Soft { ttl_ms },
        },
    }
}

/// The wire answer for a put item the store did not take.
fn put_code(e: &PutError) -> ErrorCode {
    match e {
        PutError::Refused(r) => refusal_code(*r),
        // The client sees `internal`, as before; the log keeps the cause.
        PutError::SsdWrite(_) | PutError::SsdTask(_) | PutError::Length { .. } => ErrorCode::Internal,
    }
}

fn refusal_code(r: PutRefusal) -> ErrorCode {
    match r {
        PutRefusal::AlreadyExists => ErrorCode::AlreadyExists,
        PutRefusal::Leased => ErrorCode::Leased,
        PutRefusal::Rejected => ErrorCode::Rejected,
        PutRefusal::NoSpace => ErrorCode::NoSpace,
    }
}

/// Request-level checks of put items (limits, empty keys); the sum of their sizes.
pub(super) fn check_put(items: &[PutItem], l: &Limits) -> Result<u64, Fail> {
    check_keys(items.iter().map(|i| &i.key), items.len(), l)?;
    let mut total = 0u64;
    for it in items {
        if it.size > l.max_value_size {
            return Err(Fail::Reply(error(
                ErrorCode::ValueTooLarge,
                format!("value of {} bytes; the limit is {}", it.size, l.max_value_size),
            )));
        }
        if let Some(parent) = &it.parent {
            if parent.len() > l.max_key_len as usize {
                return Err(Fail::Reply(error(ErrorCode::KeyTooLong, "parent key too long")));
            }
            if parent.is_empty() {
                return Err(Fail::Reply(error(ErrorCode::InvalidArgument, "empty parent key")));
            }
        }
        total += it.size;
    }
    Ok(total)
}

/// Plan, place and fill every item of a put. Reservations live in the returned items until
/// they are committed: dropping them (any early return) releases all of them.
async fn stage<S: ValueSource>(
    items: Vec<PutItem>,
    mode: PutMode,
    tenant: u32,
    src: &mut S,
    s: &Shared,
) -> Result<Vec<Staged>, Fail> {
    let upsert = mode == PutMode::Upsert;
    // Space is waited for once per request, not per item.
    let space_by = Deadline::now() + s.store.cfg.put_wait;
    // Each admitted plan holds its block's id until it is committed: those still here at an
    // early return are dropped with it and give their ids back.
    let plans = {
        let specs: Vec<PutSpec<'_>> = items.iter().map(spec).collect();
        s.store.plan_put(tenant, &specs, upsert)
    };
    let space_by = src.begin(space_by);
    let into_dram = src.lands_in_dram();
    let mut staged = Vec::with_capacity(items.len());
    for (item, plan) in items.into_iter().zip(plans) {
        let placed = match plan {
            Err(refusal) => Err(refusal_code(refusal)),
            Ok(plan) => s.store.reserve_for(plan, item.size, into_dram, space_by).await.map_err(|e| put_code(&e)),
        };
        let mut st = Staged { item, placed };
        src.arrive(&mut st).await?;
        staged.push(st);
    }
    src.settle(staged).await
}

/// Publish one filled item; its answer.
async fn commit_one(st: Staged, s: &Shared) -> ErrorCode {
    let placed = match st.placed {
        Ok(p) => p,
        Err(code) => return code,
    };
    match s.store.commit(&spec(&st.item), placed).await {
        Ok(()) => ErrorCode::Ok,
        Err(e) => put_code(&e),
    }
}

/// Publish every filled item, in order; their answers.
async fn commit(staged: Vec<Staged>, s: &Shared) -> Vec<ErrorCode> {
    let mut results = Vec::with_capacity(staged.len());
    for st in staged {
        results.push(commit_one(st, s).await);
    }
    results
}

/// `Put`: the values follow the frame on the request's stream.
pub(super) async fn put<R: RequestRecv>(
    items: Vec<PutItem>,
    mode: PutMode,
    recv: &mut R,
    p: &Principal,
    s: &Shared,
) -> Result<Response, Fail> {
    let total = check_put(&items, &s.limits)?;
    let mut src = StreamSource::new(recv, total, s);
    let staged = stage(items, mode, p.tenant_id, &mut src, s).await?;
    Ok(Response::Put(StatusList { results: commit(staged, s).await }))
}

/// `NodePut`: another storage node hands over blocks it evicts (into this node's free DRAM): a
/// put on behalf of their tenant, allowed to the cluster's admin keys only (the request table
/// says so).
pub(super) async fn node_put<R: RequestRecv>(np: NodePutRequest, recv: &mut R, s: &Shared) -> Result<Response, Fail> {
    // Only a tenant this node has a key for: the cluster's nodes share their keys, and
    // a node put must not conjure up a tenant nobody can read.
    let Some(tenant_id) = s.auth.tenant_id_of(&np.tenant) else {
        return Err(Fail::Reply(error(
            ErrorCode::InvalidArgument,
            format!("node put for tenant {:?}, which no api key of this node names", np.tenant),
        )));
    };
    let on_behalf = Principal { tenant_id, tenant: np.tenant, admin: false };
    put(np.items, np.mode, recv, &on_behalf, s).await
}

/// `PutFrom`: the server copies the values from the client's shared buffers.
pub(super) async fn put_from(p: PutFromRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    let total = check_put(&p.items, &s.limits)?;
    if p.sources.len() != p.items.len() {
        return Err(invalid(format!("{} items but {} sources", p.items.len(), p.sources.len())));
    }
    if let Some((i, src)) =
        p.items.iter().zip(&p.sources).enumerate().find(|(_, (it, src))| src.len != it.size).map(|(i, (_, s))| (i, s))
    {
        return Err(invalid(format!("source {i} holds {} bytes for a value of {}", src.len, p.items[i].size)));
    }
    let (dp, peer) = shm_peer(session, s.data_path.as_ref())?;
    let tenant = session.principal.tenant_id;
    let mut src = ShmSource::new(dp, peer, p.sources, s.timeouts.transfer(total), &s.metrics);
    let staged = stage(p.items, p.mode, tenant, &mut src, s).await?;
    Ok(Response::Put(StatusList { results: commit(staged, s).await }))
}

/// `PutIntent`: places for values the client will write one-sidedly; each granted item waits in
/// the session (for its time) until `PutDone` commits it.
pub(super) async fn put_intent(p: PutIntentRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    check_put(&p.items, &s.limits)?;
    let staged = stage(p.items, p.mode, session.principal.tenant_id, &mut Granted, s).await?;
    let none = Grant {
        status: ErrorCode::Ok,
        reservation: 0,
        location: Location { node: 0, region: 0, offset: 0 },
        expires_ms: 0,
    };
    let mut grants = Vec::with_capacity(staged.len());
    for st in staged {
        let offset = match &st.placed {
            Err(code) => {
                grants.push(Grant { status: *code, ..none });
                continue;
            }
            Ok(placed) => match &placed.landing {
                Landing::Dram(blk) => blk.offset(),
                // `Granted` lands every stored item in DRAM.
                Landing::Ssd(_) => {
                    return Err(Fail::Reply(error(ErrorCode::Internal, "a one-sided put staged for SSD")))
                }
            },
        };
        let ttl = s.hold_for(st.item.size);
        let reservation = session.grant(st, ttl);
        grants.push(Grant {
            status: ErrorCode::Ok,
            reservation,
            location: Location { node: 0, region: 0, offset },
            expires_ms: ttl.as_millis().min(u32::MAX as u128) as u32,
        });
    }
    Ok(Response::PutGrant(kvpool_proto::PutGrant { grants }))
}

/// `Write`: bytes of a granted item, at an offset, on the request's stream.
pub(super) async fn write<R: RequestRecv>(
    w: WriteRequest,
    recv: &mut R,
    session: &Arc<Session>,
    s: &Shared,
) -> Result<Response, Fail> {
    let r = session.reservation(w.reservation).ok_or_else(|| expired("reservation", w.reservation))?;
    let by = Deadline::now() + s.timeouts.transfer(w.size);
    let mut guard = r.lock().await;
    let block = guard
        .as_mut()
        .and_then(|st| st.placed.as_mut().ok())
        .map(|p| p.bytes_mut())
        .ok_or_else(|| expired("reservation", w.reservation))?;
    let len = block.len() as u64;
    let end = w
        .offset
        .checked_add(w.size)
        .filter(|&e| e <= len)
        .ok_or_else(|| invalid(format!("write of {} bytes at {} into a block of {}", w.size, w.offset, len)))?;
    let started = std::time::Instant::now();
    read_exact_by(recv, &mut block[w.offset as usize..end as usize], by, "the declared bytes").await?;
    expect_end(recv, by).await?;
    s.metrics.transferred(recv.transport(), "in", w.size, started.elapsed());
    Ok(Response::Done)
}

/// `PutDone`: commit granted items whose bytes are complete (hashed here: nobody saw them land).
pub(super) async fn put_done(d: PutDoneRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    if d.reservations.len() > s.limits.max_batch as usize {
        return Err(Fail::Reply(error(ErrorCode::BatchTooLarge, "too many reservations")));
    }
    let mut results = Vec::with_capacity(d.reservations.len());
    for id in d.reservations {
        let Some(r) = session.take_reservation(id) else {
            results.push(ErrorCode::Expired);
            continue;
        };
        let staged = r.lock().await.take();
        results.push(match staged {
            Some(st) => commit_one(st, s).await,
            None => ErrorCode::Expired,
        });
    }
    Ok(Response::Put(StatusList { results }))
}
