//! Connections to a cluster's storage nodes, and what a client does when one of them dies.
//!
//! A killed node sends no close: a call on its connection would wait for the idle timeout
//! (`dead_after`), which an engine cannot afford. So a node call that has not answered after a
//! quarter of [`ClientConfig::node_answer_within`] sends a ping on the same connection; when
//! neither answers within the bound, the node is taken for down. A node that is down is skipped
//! with no network round trip (its calls fail at once, so a read falls back to other holders
//! or misses) while a background task reconnects, with backoff, and puts it back in use.

use crate::{Client, ClientConfig, ClientError, Result, Trust};
use kvpool_proto::NodeAddr;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// Connections to storage nodes, by node id. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Nodes {
    inner: Arc<Inner>,
}

struct Inner {
    /// How to connect to a node (server, name and trust are replaced per node).
    template: ClientConfig,
    slots: Mutex<HashMap<u32, Slot>>,
}

struct Slot {
    addr: NodeAddr,
    /// The connection while the node is up; `None` while the reviver is connecting.
    up: watch::Receiver<Option<Client>>,
    /// Wakes the reviver from its backoff: someone wanted the node.
    kick: Arc<Notify>,
}

/// Backoff of the reviver between connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

impl Nodes {
    pub(crate) fn new(template: ClientConfig) -> Nodes {
        Nodes { inner: Arc::new(Inner { template, slots: Mutex::default() }) }
    }

    fn within(&self) -> Duration {
        self.inner.template.node_answer_within
    }

    /// Run `f` on node `a`'s connection, watched: a node that stops answering fails the call
    /// within `node_answer_within` and is marked down. Errors of the node itself (a status, a
    /// refused value) pass through and leave the node up.
    pub(crate) async fn call<T, F, Fut>(&self, a: &NodeAddr, f: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let c = self.client(a).await?;
        let r = watched(&c, f(c.clone()), self.within()).await;
        if let Err(e) = &r {
            if is_down(e) {
                tracing::debug!(node = a.node, error = %e, "storage node failed: down until a reconnect succeeds");
                self.down(a.node, &c);
            }
        }
        r
    }

    /// The live connection to node `a`. A node seen for the first time gets up to four times
    /// `node_answer_within` for its handshake (nothing says it is down yet; past that the
    /// handshake goes on in the background); a node already down fails at once.
    async fn client(&self, a: &NodeAddr) -> Result<Client> {
        let mut up = {
            let mut slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
            match slots.get(&a.node) {
                // A new address (the node moved) needs a new connection.
                Some(s) if s.addr == *a => {
                    if let Some(c) = s.up.borrow().clone() {
                        return Ok(c);
                    }
                    s.kick.notify_one();
                    return Err(down_err(a, self.within()));
                }
                _ => {
                    let cfg = node_config(&self.inner.template, a)?;
                    let (tx, rx) = watch::channel(None);
                    let kick = Arc::new(Notify::new());
                    slots.insert(a.node, Slot { addr: a.clone(), up: rx.clone(), kick: kick.clone() });
                    tokio::spawn(revive(cfg, a.node, tx, kick));
                    rx
                }
            }
        };
        let wait = (self.within() * 4).min(self.inner.template.request_timeout);
        let got = match tokio::time::timeout(wait, up.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone(),
            _ => None,
        };
        got.ok_or_else(|| down_err(a, wait))
    }

    /// Mark node `id` down when `failed` is still its connection (a newer one stays), and
    /// start reconnecting in the background.
    fn down(&self, id: u32, failed: &Client) {
        let mut slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = slots.get_mut(&id) else { return };
        if !s.up.borrow().as_ref().is_some_and(|c| c.same_connection(failed)) {
            return;
        }
        let Ok(cfg) = node_config(&self.inner.template, &s.addr) else { return };
        let (tx, rx) = watch::channel(None);
        let kick = Arc::new(Notify::new());
        s.up = rx;
        s.kick = kick.clone();
        tokio::spawn(revive(cfg, id, tx, kick));
    }
}

impl Nodes {
    /// The data path of each node connection that is up, by node id: `shm` for a node on
    /// this host (when the configuration allows it), else `quic`.
    pub(crate) fn transports(&self) -> Vec<(u32, &'static str)> {
        let slots = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(u32, &'static str)> =
            slots.iter().filter_map(|(&id, s)| s.up.borrow().as_ref().map(|c| (id, c.transport_in_use()))).collect();
        out.sort_unstable();
        out
    }
}

fn down_err(a: &NodeAddr, within: Duration) -> ClientError {
    ClientError::Connect {
        addr: a.addr.clone(),
        message: format!(
            "storage node {} is down (no answer within {within:?}); skipped until a reconnect succeeds",
            a.node
        ),
    }
}

/// Errors that say the connection or the node is gone, as opposed to an answer from it.
fn is_down(e: &ClientError) -> bool {
    matches!(e, ClientError::Connect { .. } | ClientError::Closed(_) | ClientError::Timeout(_) | ClientError::Io(_))
}

/// `call` on `c`, but a node that answers neither it nor a ping within `within` fails it.
/// The first ping goes out after a quarter of `within`, and must answer in the rest; while
/// pings answer, a long call (a large batch) runs on, pinged at growing intervals.
async fn watched<T>(c: &Client, call: impl Future<Output = Result<T>>, within: Duration) -> Result<T> {
    tokio::pin!(call);
    let mut quiet = within / 4;
    loop {
        tokio::select! {
            r = &mut call => return r,
            _ = tokio::time::sleep(quiet) => {}
        }
        let probe = tokio::time::timeout(within - within / 4, c.ping());
        tokio::pin!(probe);
        tokio::select! {
            r = &mut call => return r,
            p = &mut probe => match p {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(ClientError::Timeout(within)),
            },
        }
        quiet = (quiet * 2).min(Duration::from_secs(1));
    }
}

/// Connect to a node (`cfg`) until it answers (backoff `BACKOFF_MIN`..`BACKOFF_MAX`, cut
/// short by a kick, but never to less than `BACKOFF_MIN` between attempts), then publish the
/// connection. Ends when nobody waits on it any more (the client was dropped, or the node moved).
async fn revive(cfg: ClientConfig, node: u32, tx: watch::Sender<Option<Client>>, kick: Arc<Notify>) {
    // A handshake to a silent node never completes; attempts are cut short and repeated, so a
    // node that comes back is found within a backoff of its return.
    let attempt = cfg.node_answer_within.max(Duration::from_millis(300));
    let mut backoff = BACKOFF_MIN;
    loop {
        let began = tokio::time::Instant::now();
        match tokio::time::timeout(attempt, Client::connect_direct(cfg.clone())).await {
            Ok(Ok(c)) => {
                if tx.send(Some(c.clone())).is_ok() {
                    tracing::debug!(node, "storage node is up");
                } else {
                    c.close().await;
                }
                return;
            }
            Ok(Err(e)) => tracing::debug!(node, error = %e, "storage node still down"),
            Err(_) => tracing::debug!(node, "storage node still down (no handshake)"),
        }
        if tx.is_closed() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = kick.notified() => {}
        }
        // An attempt on a killed node fails within a round trip (its host refuses), and every
        // call to the node kicks: without a floor the attempts, each a socket and a handshake,
        // would run as fast as the calls come.
        tokio::time::sleep_until(began + BACKOFF_MIN).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

fn node_config(template: &ClientConfig, a: &NodeAddr) -> Result<ClientConfig> {
    let fp: [u8; 32] = a.fingerprint.as_slice().try_into().map_err(|_| {
        ClientError::Protocol(format!("node {} has a fingerprint of {} bytes", a.node, a.fingerprint.len()))
    })?;
    let mut cfg = template.clone();
    cfg.server = a.addr.clone();
    cfg.server_name = a.server_name.clone();
    cfg.trust = Trust::Fingerprint(fp);
    Ok(cfg)
}
