//! Every get, whatever carries its bytes out: in band after the answer's frame (`Get`), copied
//! into the client's shared buffers (`GetInto`), or leased in place for one-sided reads
//! (`GetLocate`, then `Read` and `Release`).
//!
//! All of them locate the keys under the index lock ([`Store::plan_get`](crate::store::Store))
//! and [`fetch`] each block's bytes (an SSD copy is read, verified and maybe promoted) before
//! they part ways: a value sink differs too much by route (a frame first, a hashed copy, a
//! lease) for one trait to pay for itself.

use super::session::{expired, LeaseHold, Session};
use super::shared::Shared;
use super::shm::{copy, register, shm_peer, xfer};
use super::stream::{error, invalid, write_by, write_owned_by, Fail, RequestSend};
use crate::store::read::{GetPlan, ReadError, Served};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{
    DataHeader, ErrorCode, GetIntoRequest, GetItem, GetResponse, Located, LocatedItem, Location, ReadRequest,
    ReleaseRequest, Response,
};
use kvpool_transport::{Op, Transport};
use std::sync::Arc;
use std::time::Instant;
use tokio::time::Instant as Deadline;
use tracing::{debug, warn};

/// Location of bytes that are not in registered memory (read them with `Read`).
const NOT_REGISTERED: u32 = u32::MAX;

/// Bytes of a located block, for any route out.
async fn fetch(s: &Shared, plan: GetPlan) -> Result<Served, ErrorCode> {
    match plan {
        GetPlan::Missing => Err(ErrorCode::NotFound),
        GetPlan::Dram { block, checksum } => Ok(Served::Dram(block, checksum, kvpool_policy_sdk::Tier::Dram)),
        GetPlan::Ssd { id, file, size, checksum } => {
            s.store.read_ssd(id, file, size, checksum).await.map_err(|e| match e {
                ReadError::NoSsd => ErrorCode::NotFound,
                ReadError::Corrupt => ErrorCode::Corrupt,
            })
        }
    }
}

fn missing(status: ErrorCode) -> GetItem {
    GetItem { status, size: 0, tier: 0, checksum: 0, lease_ms: 0 }
}

fn found(sv: &Served, lease_ms: u32) -> GetItem {
    GetItem {
        status: ErrorCode::Ok,
        size: sv.bytes().len() as u64,
        tier: sv.tier() as u8,
        checksum: sv.checksum(),
        lease_ms,
    }
}

/// `Get`: the answer's frame, then each found value's bytes, on the request's stream.
pub(super) async fn get<W: RequestSend>(keys: &[Vec<u8>], send: &mut W, tenant: u32, s: &Shared) -> Result<(), Fail> {
    let plans = s.store.plan_get(tenant, keys);
    let lease_ms = s.store.cfg.lease_ttl.as_millis().min(u32::MAX as u128) as u32;
    let mut items = Vec::with_capacity(plans.len());
    let mut served: Vec<Served> = Vec::new();
    for plan in plans {
        match fetch(s, plan).await {
            Ok(sv) => {
                items.push(found(&sv, lease_ms));
                served.push(sv);
            }
            Err(code) => items.push(missing(code)),
        }
    }
    // The client must take the bytes at the minimum rate: a reader that stalls would otherwise
    // pin these blocks' memory for ever.
    let total: u64 = served.iter().map(|sv| sv.bytes().len() as u64).sum();
    let by = Deadline::now() + s.timeouts.transfer(total);
    let frame = encode_frame(&Response::Get(GetResponse { items }))
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let started = Instant::now();
    write_by(send, &frame, by).await?;
    for sv in served {
        // DRAM blocks go out from the segment itself; the chunk keeps the block alive until sent.
        write_owned_by(send, sv.into_bytes(), by).await?;
    }
    send.finish();
    s.metrics.transferred(send.transport(), "out", total, started.elapsed());
    Ok(())
}

/// `GetInto`: the server copies each found value into the client's shared buffer.
pub(super) async fn get_into(g: GetIntoRequest, session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    super::stream::check_keys(&g.keys, g.keys.len(), &s.limits)?;
    if g.dests.len() != g.keys.len() {
        return Err(invalid(format!("{} keys but {} destinations", g.keys.len(), g.dests.len())));
    }
    let (dp, peer) = shm_peer(session, s.data_path.as_ref())?;
    let t: &dyn Transport = &*dp.transport;
    let plans = s.store.plan_get(session.principal.tenant_id, &g.keys);
    let mut items = Vec::with_capacity(plans.len());
    // What the copies read from, owned until they settled.
    let mut held: Vec<Option<Served>> = Vec::with_capacity(plans.len());
    let mut temps = Vec::new();
    let mut xfers = Vec::new();
    let mut total = 0;
    for (plan, dest) in plans.into_iter().zip(&g.dests) {
        let (item, out) = match fetch(s, plan).await {
            Err(code) => (missing(code), None),
            Ok(sv) => {
                let item = found(&sv, 0);
                if item.size > dest.len {
                    (GetItem { status: ErrorCode::ValueTooLarge, ..item }, None)
                } else {
                    let (region, offset) = match &sv {
                        Served::Dram(b, _, _) => (dp.segment, b.offset()),
                        Served::Owned(v, _, _) => {
                            // SAFETY: `held` owns the bytes until the copy settled.
                            let r = unsafe { register(t, v) }?;
                            temps.push(r);
                            (r, 0)
                        }
                    };
                    xfers.push(xfer(region, offset, dest, item.size));
                    total += item.size;
                    (item, Some(sv))
                }
            }
        };
        items.push(item);
        held.push(out);
    }
    let (held, sums) = copy(dp, peer, Op::Write, &xfers, held, temps, s.timeouts.transfer(total), &s.metrics).await?;
    // Every block copied was hashed as it landed in the client's buffer: an item is `Ok` only
    // if that matches the checksum recorded at put, so no failed block is ever served.
    let mut sums = (0..sums.len()).map(|i| sums.get(i));
    let tenant = session.principal.tenant_id;
    for ((item, out), key) in items.iter_mut().zip(&held).zip(&g.keys) {
        let Some(sv) = out else { continue };
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
        *item = missing(ErrorCode::Corrupt);
    }
    Ok(Response::Filled(GetResponse { items }))
}

/// `GetLocate`: lease the found blocks in place and answer where they are.
pub(super) async fn get_locate(keys: &[Vec<u8>], session: &Arc<Session>, s: &Shared) -> Result<Response, Fail> {
    super::stream::check_keys(keys, keys.len(), &s.limits)?;
    let plans = s.store.plan_get(session.principal.tenant_id, keys);
    let mut items = Vec::with_capacity(plans.len());
    let mut blocks = Vec::with_capacity(plans.len());
    let mut total = 0;
    for plan in plans {
        match fetch(s, plan).await {
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
    let ttl = s.hold_for(total).max(s.store.cfg.lease_ttl);
    let lease =
        if blocks.iter().any(Option::is_some) { session.lease(LeaseHold { blocks, held: None }, ttl) } else { 0 };
    Ok(Response::Located(Located { lease, lease_ms: ttl.as_millis().min(u32::MAX as u128) as u32, items }))
}

/// `Read`: bytes of a leased block, in band (for blocks not in registered memory).
pub(super) async fn read<W: RequestSend>(
    r: ReadRequest,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
) -> Result<(), Fail> {
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
    let frame = encode_frame(&Response::Data(DataHeader { size: r.size }))
        .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
    let started = Instant::now();
    write_by(send, &frame, by).await?;
    write_by(send, &bytes[r.offset as usize..end as usize], by).await?;
    send.finish();
    s.metrics.transferred(send.transport(), "out", r.size, started.elapsed());
    Ok(())
}

/// `Release`: end a lease early.
pub(super) fn release(r: ReleaseRequest, session: &Session) -> Result<Response, Fail> {
    let ReleaseRequest { lease } = r;
    if !session.release(lease) {
        return Err(Fail::Reply(error(ErrorCode::Expired, format!("no lease {lease} on this connection"))));
    }
    Ok(Response::Done)
}
