//! KV event subscriptions (PROTOCOL.md 11.7): the blocks the pool stored, removed and evicted,
//! as a stream a KV-aware router follows.

use crate::{read_response, Client, ClientError, Result};
use kvpool_proto::{frame, EventBatch, EventScope, Request, Response, SubscribeRequest};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Batches read ahead of the caller.
const QUEUE: usize = 16;

/// What to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscribeOptions {
    /// First sequence number wanted (a `next` from an earlier batch to resume); `None` for the
    /// events after the subscription starts.
    pub from: Option<u64>,
    /// The caller's tenant, or every tenant (admin keys).
    pub scope: EventScope,
    /// Most events per batch (0: the server's choice).
    pub max_batch: u32,
    /// The `log_id` that `from` belongs to: when the server's log is another one (it restarted),
    /// subscribing fails with `Status { code: Expired }` instead of reading a stranger's numbers.
    pub log_id: Option<u64>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions { from: None, scope: EventScope::Tenant, max_batch: 0, log_id: None }
    }
}

/// An open subscription. Batches arrive in order; dropping it ends the subscription.
#[derive(Debug)]
pub struct Subscription {
    rx: mpsc::Receiver<Result<EventBatch>>,
    reader: tokio::task::JoinHandle<()>,
    /// Batches the reader dropped because the queue was full, not yet reported.
    dropped: Arc<Mutex<Dropped>>,
    log_id: u64,
    next: u64,
}

/// What the reader dropped while the caller was behind: events (and the server's lag they
/// carried), and the cursor after the last one.
#[derive(Debug, Default)]
struct Dropped {
    lagged: u64,
    next: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Dropping the stream tells the server to stop (STOP_SENDING).
        self.reader.abort();
    }
}

impl Subscription {
    /// The server log these sequence numbers belong to (a restarted server has another).
    pub fn log_id(&self) -> u64 {
        self.log_id
    }

    /// The sequence number to subscribe `from` to resume after the last batch returned.
    pub fn resume_from(&self) -> u64 {
        self.next
    }

    /// The next batch: events, and how many were lost before them (`lagged`: the server's log
    /// moved past them, or this subscription's queue of 16 batches was full because the caller
    /// was behind). Waits for as long as the pool is quiet; cancel-safe (wrap it in a timeout
    /// freely).
    pub async fn next(&mut self) -> Result<EventBatch> {
        let item = {
            let mut d = self.dropped.lock().unwrap_or_else(|p| p.into_inner());
            match self.rx.try_recv() {
                Ok(item) => Some(item),
                // Everything queued was read: tell of what was dropped after it, at once (the
                // pool may stay quiet, and no later batch would carry it).
                Err(mpsc::error::TryRecvError::Empty) if d.lagged > 0 => {
                    let b = EventBatch { log_id: self.log_id, lagged: d.lagged, next: d.next, events: Vec::new() };
                    d.lagged = 0;
                    Some(Ok(b))
                }
                // With the queue empty the reader cannot drop anything until it has queued 16
                // more batches, so waiting unlocked misses no report.
                Err(_) => None,
            }
        };
        let item = match item {
            Some(item) => Some(item),
            None => self.rx.recv().await,
        };
        match item {
            Some(Ok(b)) => {
                self.next = b.next;
                Ok(b)
            }
            Some(Err(e)) => Err(e),
            None => Err(ClientError::Closed("the subscription has ended".into())),
        }
    }

    /// [`Subscription::next`] within `wait`; `Ok(None)` when nothing came.
    pub async fn next_within(&mut self, wait: Duration) -> Result<Option<EventBatch>> {
        match tokio::time::timeout(wait, self.next()).await {
            Ok(r) => r.map(Some),
            Err(_) => Ok(None),
        }
    }
}

impl Client {
    /// Follow the pool's KV events. Returns once the server has accepted the subscription (its
    /// first batch, possibly empty, is the first [`Subscription::next`]).
    pub async fn subscribe(&self, opts: SubscribeOptions) -> Result<Subscription> {
        // On a cluster: the master's stream, which covers the whole pool.
        let c = self.control();
        let req =
            Request::Subscribe(SubscribeRequest { from: opts.from, scope: opts.scope, max_batch: opts.max_batch });
        let frame = frame::encode_frame(&req)?;
        let (conn, mut tx, mut rx) = c.open().await?;
        let first = c
            .timed(async {
                tx.write_all(&frame).await?;
                tx.finish()?;
                match read_response(&conn, &mut rx).await? {
                    Response::Events(b) => Ok(b),
                    other => Err(crate::unexpected("Events", &other)),
                }
            })
            .await?;
        let (log_id, next) = (first.log_id, first.next);
        if let Some(want) = opts.log_id.filter(|&w| w != log_id) {
            return Err(ClientError::Status {
                code: kvpool_proto::ErrorCode::Expired,
                message: format!(
                    "the server's event log is {log_id:016x}, not {want:016x} (it restarted): sequence numbers \
                     of the old log mean nothing; rebuild from a subscription without `from`"
                ),
            });
        }
        // Batches are read off the stream as they come, into a short queue: the server never
        // waits on us. When the caller is behind and the queue is full, a batch is dropped and
        // counted into the `lagged` of the next batch the caller reads (one that fits in the
        // queue, or an empty one `next` makes), as the server does with its log.
        let (send, recv) = mpsc::channel(QUEUE);
        send.try_send(Ok(first)).expect("an empty queue has room");
        let dropped = Arc::new(Mutex::new(Dropped::default()));
        let shared = dropped.clone();
        let reader = tokio::spawn(async move {
            let _tx = tx;
            loop {
                let mut b = match read_response(&conn, &mut rx).await {
                    Ok(Response::Events(b)) => b,
                    other => {
                        let e = match other {
                            Ok(other) => crate::unexpected("Events", &other),
                            Err(e) => e,
                        };
                        let _ = send.send(Err(e)).await;
                        return;
                    }
                };
                let mut d = shared.lock().unwrap_or_else(|p| p.into_inner());
                b.lagged += std::mem::take(&mut d.lagged);
                match send.try_send(Ok(b)) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(Ok(b))) => {
                        d.lagged = b.lagged + b.events.len() as u64;
                        d.next = b.next;
                    }
                    Err(_) => return,
                }
            }
        });
        Ok(Subscription { rx: recv, reader, dropped, log_id, next })
    }
}
