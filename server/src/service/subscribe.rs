//! `Subscribe`: a stream of KV events (PROTOCOL.md 11.7). The server writes `Events` frames
//! from the subscriber's cursor until the client stops the stream or the connection ends.
//! Nothing waits on a subscriber: it reads the log at its own pace and is told what it missed.

use super::session::Session;
use super::shared::Shared;
use super::stream::{error, write_by, Fail, RequestSend};
use kvpool_core::{Change, ChangeKind};
use kvpool_proto::{frame, ErrorCode, EventBatch, EventScope, KvEvent, KvEventKind, Response, SubscribeRequest};
use std::sync::Arc;
use tokio::time::Instant as Deadline;

/// Events per frame when the client leaves it to the server, and the most it may ask for.
pub const DEFAULT_BATCH: u32 = 256;
pub const MAX_BATCH: u32 = 1024;
const FRAME_BUDGET: usize = 1 << 20;
/// Changes looked at per frame at least, whatever the batch size asked for.
const SCAN: usize = 4096;

fn event(seq: u64, c: Change, node: &str, s: &Shared) -> KvEvent {
    KvEvent {
        seq,
        kind: match c.kind {
            ChangeKind::Stored => KvEventKind::Stored,
            ChangeKind::Removed => KvEventKind::Removed,
            ChangeKind::Evicted => KvEventKind::Evicted,
        },
        tier: c.tier as u8,
        // A master logs its storage nodes' copies under their ids.
        node: match (s.role.master(), c.node) {
            (Some(m), n) if n != 0 => m.node_name(n),
            _ => node.to_string(),
        },
        tenant: s.role.master().and_then(|m| m.tenant_name(c.tenant)).unwrap_or_else(|| s.auth.tenant_name(c.tenant)),
        key: c.key.to_vec(),
        parent: c.parent.map(|p| p.to_vec()),
        size: c.size,
        time_ms: c.time_ms,
    }
}

pub(super) async fn subscribe<W: RequestSend>(
    req: SubscribeRequest,
    send: &mut W,
    session: &Arc<Session>,
    s: &Shared,
) -> Result<(), Fail> {
    let p = &session.principal;
    let Some(log) = s.events.as_ref().filter(|l| l.capacity() > 0) else {
        return Err(Fail::Reply(error(ErrorCode::Unsupported, "KV events are off on this server (events.buffer = 0)")));
    };
    let all = req.scope == EventScope::All;
    if all && !p.admin {
        return Err(Fail::Reply(error(ErrorCode::Forbidden, "the events of every tenant need an admin api key")));
    }
    let newest = log.next_seq();
    let mut cursor = match req.from {
        None => newest,
        Some(f) if f > newest => {
            return Err(Fail::Reply(error(
                ErrorCode::InvalidArgument,
                format!(
                    "from {f} is past the next event ({newest}) of log {:016x}: a cursor of another log (a restarted \
                     server) means nothing here; subscribe without `from`",
                    log.log_id
                ),
            )))
        }
        Some(f) => f,
    };
    let Some(_place) = log.join() else {
        return Err(Fail::Reply(error(
            ErrorCode::Rejected,
            "too many KV event subscriptions are open (events.max_subscribers)",
        )));
    };
    // Frames stay near a megabyte at most, whatever the key limit (a client refuses frames
    // over 64 MiB): an event is its two keys, the node and tenant names and 50 bytes more.
    let per_event = 2 * s.limits.max_key_len as usize + s.node.len() + s.auth.longest_tenant_name() + 64;
    let max = (match req.max_batch {
        0 => DEFAULT_BATCH,
        n => n.min(MAX_BATCH),
    } as usize)
        .min((FRAME_BUDGET / per_event).max(1));
    let tenant = p.tenant_id;
    let node = s.node.as_str();
    let mut news = log.watch();
    let mut first = true;
    loop {
        // Seen before reading: a publish after the read still wakes the wait below.
        news.borrow_and_update();
        // A filtered subscriber looks at a bounded stretch per frame, so a busy pool of other
        // tenants never keeps it from answering.
        let b = log.read(cursor, max, SCAN.max(16 * max), |c| all || c.tenant == tenant);
        let moved = b.next != cursor;
        cursor = b.next;
        if first || b.lagged > 0 || !b.changes.is_empty() {
            first = false;
            let batch = EventBatch {
                log_id: log.log_id,
                lagged: b.lagged,
                next: b.next,
                events: b.changes.into_iter().map(|(seq, c)| event(seq, c, node, s)).collect(),
            };
            let frame = frame::encode_frame(&Response::Events(batch))
                .map_err(|e| Fail::Reply(error(ErrorCode::Internal, e.to_string())))?;
            // A subscriber that stops reading altogether is let go; one that reads slowly lags.
            write_by(send, &frame, Deadline::now() + s.timeouts.transfer(frame.len() as u64)).await?;
        }
        if moved {
            // More to read: go on, but let other tasks of this worker run between stretches
            // (a subscriber far behind in a busy pool must not hold its thread).
            tokio::task::consume_budget().await;
            continue;
        }
        tokio::select! {
            r = news.changed() => if r.is_err() { return Err(Fail::Cancelled) },
            _ = send.stopped() => return Err(Fail::Cancelled),
            _ = session.ended() => return Err(Fail::Cancelled),
        }
    }
}
