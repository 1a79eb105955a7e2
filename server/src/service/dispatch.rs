//! One request stream, start to end: read the frame, check what the request table
//! (`kvpool_proto::REQUESTS`) says of the request (a master holds no blocks; the request exists
//! in the negotiated version; it came through a door that may carry it; it needs an admin key;
//! nothing follows its frame), run its verb, answer, and count it. The match below is the one
//! list of handlers: a new request is its row in the table and its arm here.

use super::doors::Door;
use super::session::Session;
use super::shared::Shared;
use super::stream::{
    check_keys, error, expect_end, invalid, malformed, reply, unsupported, Fail, RequestRecv, RequestSend, Timeouts,
};
use super::{admin, attach, cluster, connector, get, put, subscribe};
use kvpool_core::RemoveStatus;
use kvpool_proto::frame::read_frame;
use kvpool_proto::{
    close, codec, message_tag, ErrorCode, ExistsResponse, LookupResponse, PolicyListResponse, ProtoError,
    RemoveAllResponse, Request, Response, StatusList, REQUEST_TAGS,
};
use std::sync::Arc;
use std::time::Instant;
use tokio::time::Instant as Deadline;
use tracing::debug;

/// Read and decode a request frame. `Ok(None)`: the stream ended before any byte.
pub(super) async fn read_request<R: RequestRecv>(
    r: &mut R,
    max_frame: u32,
    deadline: Deadline,
) -> Result<Option<Request>, Fail> {
    let body = match tokio::time::timeout_at(deadline, read_frame(r, max_frame)).await {
        Err(_) => return Err(Fail::Timeout("no complete request frame in time".into())),
        Ok(Ok(Some(b))) => b,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(ProtoError::Cancelled(_))) => return Err(Fail::Cancelled),
        Ok(Err(e)) => return Err(Fail::Reply(error(e.code(), e.to_string()))),
    };
    match codec::decode::<Request>(&body) {
        Ok(r) => Ok(Some(r)),
        Err(e) => match message_tag(&body) {
            Some(tag) if tag >= REQUEST_TAGS => {
                Err(Fail::Reply(error(ErrorCode::UnknownMessage, format!("unknown request type {tag}"))))
            }
            _ => Err(malformed(e.to_string())),
        },
    }
}

/// End a failed request the way its failure asks; returns the error code counted, if any.
pub(super) async fn conclude<R: RequestRecv, W: RequestSend>(
    fail: Fail,
    recv: &mut R,
    send: &mut W,
    timeouts: &Timeouts,
) -> Option<ErrorCode> {
    let deadline = Deadline::now() + timeouts.request;
    match fail {
        Fail::Reply(body) => {
            let code = body.code;
            if reply(send, &Response::Error(body), deadline).await.is_err() {
                send.reset(close::TIMEOUT);
            }
            recv.stop(close::PROTOCOL);
            Some(code)
        }
        Fail::Timeout(message) => {
            if reply(send, &Response::Error(error(ErrorCode::Timeout, message)), deadline).await.is_err() {
                send.reset(close::TIMEOUT);
            }
            recv.stop(close::TIMEOUT);
            Some(ErrorCode::Timeout)
        }
        Fail::Stalled => {
            send.reset(close::TIMEOUT);
            recv.stop(close::TIMEOUT);
            Some(ErrorCode::Timeout)
        }
        Fail::Cancelled => {
            send.reset(close::OK);
            recv.stop(close::OK);
            None
        }
    }
}

/// Serve one request stream of an authenticated connection, start to end.
pub async fn handle_stream<R: RequestRecv, W: RequestSend>(
    recv: &mut R,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
) {
    let p = &session.principal;
    let start = Instant::now();
    let deadline = Deadline::now() + s.timeouts.request;
    let (facts, result) = match read_request(recv, s.limits.max_frame, deadline).await {
        Ok(None) => return,
        Err(f) => (None, Err(f)),
        Ok(Some(req)) => {
            let facts = req.facts();
            (Some(facts), dispatch(req, recv, send, session, s, deadline).await)
        }
    };
    let op = facts.map(|f| f.name);
    let failed = match result {
        Ok(()) => None,
        Err(Fail::Cancelled) => {
            // Counted as cancelled: not an error, not a latency sample.
            s.metrics.cancelled.with_label_values(&[op.unwrap_or("unknown")]).inc();
            conclude(Fail::Cancelled, recv, send, &s.timeouts).await;
            return;
        }
        Err(f) => {
            debug!(?f, "request failed");
            conclude(f, recv, send, &s.timeouts).await
        }
    };
    // A client asks `Nodes` at connect to learn whether this is a master: a server's
    // `unsupported` is the expected answer to that probe, not an error to count.
    let failed = failed.filter(|&c| !(op == Some("nodes") && c == ErrorCode::Unsupported));
    if let Some(code) = failed {
        s.metrics.errors.with_label_values(&[code.name()]).inc();
    }
    let Some(facts) = facts else { return };
    if facts.streams {
        // A subscription lasts as long as its client wants: not a latency sample.
        return;
    }
    let op = facts.name;
    let secs = start.elapsed().as_secs_f64();
    s.metrics.op_seconds.with_label_values(&[op]).observe(secs);
    s.metrics.tenant_op_seconds.with_label_values(&[&p.tenant, op]).observe(secs);
    if failed.is_some() {
        s.metrics.op_errors.with_label_values(&[op]).inc();
        s.metrics.tenant_op_errors.with_label_values(&[&p.tenant, op]).inc();
    }
}

/// What the request table says every request of a kind must satisfy, checked before its
/// handler runs: nothing of a refused request takes effect.
async fn admit<R: RequestRecv>(
    req: &Request,
    recv: &mut R,
    session: &Session,
    s: &Shared,
    deadline: Deadline,
) -> Result<(), Fail> {
    let facts = req.facts();
    if s.role.master().is_some() && facts.holds_blocks {
        return Err(Fail::Reply(error(
            ErrorCode::Unsupported,
            "this server is a cluster master and holds no blocks: ask it where blocks are (Route, Place) \
             and move them to and from the storage nodes (kvpool_client::ClusterClient does both)",
        )));
    }
    if session.version < facts.min_version {
        return Err(unsupported(format!("this request needs a version {} hello", facts.min_version)));
    }
    if facts.quic_only && recv.door() != Door::Quic {
        // It binds a channel to the QUIC connection, or its answer is a stream that lasts.
        return Err(invalid(format!("{} is asked on the QUIC connection, not on a channel bound to it", facts.name)));
    }
    if facts.admin && !session.principal.admin {
        return Err(Fail::Reply(error(ErrorCode::Forbidden, format!("{} needs an admin api key", facts.name))));
    }
    if !facts.values_follow {
        // Nothing follows the frame; nothing takes effect before the end of the stream is seen.
        expect_end(recv, deadline).await?;
    }
    Ok(())
}

/// Each request to its verb, once [`admit`] let it through.
async fn dispatch<R: RequestRecv, W: RequestSend>(
    req: Request,
    recv: &mut R,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
    deadline: Deadline,
) -> Result<(), Fail> {
    admit(&req, recv, session, s, deadline).await?;
    let p = &session.principal;
    let store = &s.store;
    let t = p.tenant_id;
    let resp = match req {
        Request::Hello(_) => return Err(malformed("hello is only valid as the first request of a connection")),
        // ---- put: bytes in band, from shared buffers, or written one-sidedly
        Request::Put(put) => put::put(put.items, put.mode, recv, p, s).await?,
        Request::NodePut(np) => put::node_put(np, recv, s).await?,
        Request::PutFrom(r) => put::put_from(r, session, s).await?,
        Request::PutIntent(r) => put::put_intent(r, session, s).await?,
        Request::Write(w) => put::write(w, recv, session, s).await?,
        Request::PutDone(d) => put::put_done(d, session, s).await?,
        // ---- get: bytes in band, into shared buffers, or read one-sidedly
        Request::Get(g) => {
            check_keys(&g.keys, g.keys.len(), &s.limits)?;
            // Answered with its frame and raw bytes already.
            return get::get(&g.keys, send, t, s).await;
        }
        Request::GetInto(g) => get::get_into(g, session, s).await?,
        Request::GetLocate(g) => get::get_locate(&g.keys, session, s).await?,
        Request::Read(r) => return get::read(r, send, session, s).await,
        Request::Release(r) => get::release(r, session)?,
        // ---- lookups and removal
        Request::Lookup(l) => {
            check_keys(&l.chain, l.chain.len(), &s.limits)?;
            Response::Lookup(LookupResponse { resident: store.lookup(t, &l.chain) })
        }
        Request::LookupLease(l) => connector::lookup_lease(l, session, s)?,
        Request::Exists(e) => {
            check_keys(&e.keys, e.keys.len(), &s.limits)?;
            Response::Exists(ExistsResponse { present: store.exists(t, &e.keys) })
        }
        Request::Remove(r) => {
            check_keys(&r.keys, r.keys.len(), &s.limits)?;
            let results = store.remove(t, &r.keys, r.force).into_iter().map(remove_code).collect();
            Response::Remove(StatusList { results })
        }
        Request::RemoveAll(r) => {
            let (removed, skipped) = store.remove_all(t, r.force);
            Response::RemoveAll(RemoveAllResponse { removed, skipped })
        }
        Request::RemoveMatching(r) => connector::remove_matching(r, session, s)?,
        // ---- same-host attachments, the bulk channel, and KV events
        Request::ShmAttach => attach::shm_attach(session, s)?,
        Request::LocalAttach => attach::local_attach(session, s)?,
        Request::BulkAttach(r) => attach::bulk_attach(r, session, s)?,
        Request::Subscribe(sub) => return subscribe::subscribe(sub, send, session, s).await,
        // ---- the server itself
        Request::Stats => Response::Stats(admin::stats(s, p)),
        Request::Ping(ping) => admin::ping(ping),
        Request::PolicyLoad(l) => admin::policy_load(l, recv, s).await?,
        Request::PolicyList => Response::PolicyList(PolicyListResponse { policies: s.policies.list() }),
        Request::PolicyRollback(r) => admin::policy_rollback(r, s).await?,
        // ---- cluster
        Request::NodeJoin(j) => cluster::node_join(j, s)?,
        Request::NodeReport(r) => cluster::node_report(r, s)?,
        Request::Nodes => cluster::nodes(s)?,
        Request::Route(r) => cluster::route(r, session, s)?,
        Request::Place(r) => cluster::place(r, session, s)?,
    };
    reply(send, &resp, Deadline::now() + s.timeouts.request).await
}

/// The wire answer for a remove item's outcome.
pub(super) fn remove_code(s: RemoveStatus) -> ErrorCode {
    match s {
        RemoveStatus::Ok => ErrorCode::Ok,
        RemoveStatus::NotFound => ErrorCode::NotFound,
        RemoveStatus::Leased => ErrorCode::Leased,
    }
}
