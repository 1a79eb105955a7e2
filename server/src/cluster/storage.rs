//! The storage role's link to the master: join, announce the whole inventory, then report every
//! change of the node's event log (and the tiers' use) as it happens, at least every
//! `report_ms`. Any failure (master down, restarted, or it declared this node dead) ends the
//! session; the next one joins again and re-announces, so the master's view always converges
//! on the node's own index.

use crate::service::Shared;
use kvpool_client::{Client, ClientConfig, ClientError, Trust};
use kvpool_core::{Change, ChangeKind};
use kvpool_proto::{ErrorCode, KvEventKind, NodeBlock, NodeJoinRequest, NodeReportRequest, TierUse};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Where the master is: fixed, or whoever leads according to etcd.
#[derive(Debug, Clone)]
pub enum MasterAt {
    Fixed { addr: String, server_name: String, trust: Trust },
    Etcd { etcd: kvpool_etcd::Etcd, prefix: String },
}

impl std::fmt::Display for MasterAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MasterAt::Fixed { addr, .. } => f.write_str(addr),
            MasterAt::Etcd { prefix, .. } => write!(f, "the leader under {prefix} in etcd"),
        }
    }
}

/// Where the master is and how this node presents itself to it and to clients.
#[derive(Debug, Clone)]
pub struct Link {
    pub master: MasterAt,
    pub api_key: String,
    /// This node's name, client address, TLS name and certificate fingerprint.
    pub name: String,
    pub addr: String,
    pub server_name: String,
    pub fingerprint: [u8; 32],
}

#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("the event log is off; a storage node needs it")]
    NoEvents,
    #[error(transparent)]
    Etcd(#[from] kvpool_etcd::EtcdError),
    #[error("no master leads the cluster yet")]
    NoLeader,
    #[error("the leader's fingerprint in etcd is not 64 hex digits")]
    BadLeader,
}

/// Most blocks, and about the most bytes, per report (well under the default frame limit).
const REPORT_BLOCKS: usize = 4096;
const REPORT_BYTES: usize = 512 << 10;

/// Keep the node joined to the master for as long as the server runs.
pub async fn run(shared: Arc<Shared>, link: Link) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match session(&shared, &link).await {
            Ok(()) => backoff = Duration::from_millis(200),
            Err(e) => {
                warn!(master = %link.master, error = %e, "link to the master lost; joining again");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn tiers(shared: &Shared) -> Vec<TierUse> {
    shared.store.tier_usage().into_iter().map(|(t, capacity, used)| TierUse { tier: t as u8, capacity, used }).collect()
}

fn block(shared: &Shared, c: Change) -> NodeBlock {
    NodeBlock {
        kind: match c.kind {
            ChangeKind::Stored => KvEventKind::Stored,
            ChangeKind::Removed => KvEventKind::Removed,
            ChangeKind::Evicted => KvEventKind::Evicted,
        },
        tier: c.tier as u8,
        tenant: shared.auth.tenant_name(c.tenant),
        key: c.key.to_vec(),
        parent: c.parent.map(|p| p.to_vec()),
        size: c.size,
    }
}

/// Send `changes` in reports of bounded size; the first is a reset when `reset`.
async fn send(
    master: &Client,
    shared: &Shared,
    node: u32,
    incarnation: u64,
    mut reset: bool,
    changes: Vec<Change>,
) -> Result<(), ClientError> {
    let mut blocks = Vec::new();
    let mut bytes = 0;
    let mut it = changes.into_iter().peekable();
    loop {
        let last = it.peek().is_none();
        if last || blocks.len() >= REPORT_BLOCKS || bytes >= REPORT_BYTES {
            if !blocks.is_empty() || reset || last {
                let req = NodeReportRequest {
                    node,
                    incarnation,
                    reset,
                    tiers: tiers(shared),
                    blocks: std::mem::take(&mut blocks),
                };
                master.node_report(req).await?;
                shared.metrics.cluster_reports.inc();
                reset = false;
                bytes = 0;
            }
            if last {
                return Ok(());
            }
        }
        let c = it.next().expect("peeked");
        bytes += c.key.len() + 64;
        blocks.push(block(shared, c));
    }
}

async fn session(shared: &Arc<Shared>, link: &Link) -> Result<(), LinkError> {
    let log = shared.events.clone().ok_or(LinkError::NoEvents)?;
    let (addr, server_name, trust) = match &link.master {
        MasterAt::Fixed { addr, server_name, trust } => (addr.clone(), server_name.clone(), trust.clone()),
        MasterAt::Etcd { etcd, prefix } => {
            let l = etcd.leader(prefix).await?.ok_or(LinkError::NoLeader)?;
            let fp = kvpool_client::parse_fingerprint(&l.fingerprint).map_err(|_| LinkError::BadLeader)?;
            (l.addr, l.server_name, Trust::Fingerprint(fp))
        }
    };
    let mut cfg = ClientConfig::new(addr, link.api_key.clone(), trust);
    cfg.server_name = server_name;
    cfg.client_name = format!("kvpool-storage/{}", link.name);
    // The master is reached for control only: no shared memory with it.
    cfg.transport = kvpool_client::TransportChoice::Quic;
    // A master that died must not hold the node for long: it rejoins whoever leads next. A
    // report is at most half a MiB, which a second carries even between distant hosts.
    cfg.request_timeout = Duration::from_secs(1);
    let master = Client::connect(cfg).await?;
    let mut incarnation = [0u8; 8];
    getrandom::getrandom(&mut incarnation).map_err(|e| ClientError::Io(e.to_string()))?;
    let incarnation = u64::from_le_bytes(incarnation);
    let joined = master
        .node_join(NodeJoinRequest {
            name: link.name.clone(),
            addr: link.addr.clone(),
            server_name: link.server_name.clone(),
            fingerprint: link.fingerprint.to_vec(),
            incarnation,
            tiers: tiers(shared),
        })
        .await?;
    let node = joined.node;
    shared.metrics.cluster_joins.inc();
    let every = Duration::from_millis(u64::from(joined.report_ms.max(10)));
    let mut watch = log.watch();
    let (mut cursor, inventory) = shared.store.inventory();
    info!(node, copies = inventory.len(), master = %link.master, "joined the master; announcing the inventory");
    send(&master, shared, node, incarnation, true, inventory).await?;
    loop {
        // Seen: a publication after this line wakes the wait below.
        watch.borrow_and_update();
        let batch = log.read(cursor, REPORT_BLOCKS, REPORT_BLOCKS, |_| true);
        if batch.lagged > 0 {
            // Changes were lost to this reader: start the master's view of this node again.
            warn!(node, lagged = batch.lagged, "the event log outran the reports; announcing the inventory again");
            let (c, inventory) = shared.store.inventory();
            cursor = c;
            send(&master, shared, node, incarnation, true, inventory).await?;
            continue;
        }
        let more = batch.changes.len() == REPORT_BLOCKS;
        cursor = batch.next;
        let changes: Vec<Change> = batch.changes.into_iter().map(|(_, c)| c).collect();
        match send(&master, shared, node, incarnation, false, changes).await {
            Ok(()) => {}
            Err(e) if matches!(e.code(), ErrorCode::Expired | ErrorCode::NotLeader) => {
                info!(node, reason = %e, "the master no longer takes this node's reports: joining again");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        if more {
            continue;
        }
        // Wait for new changes, or report tier use (the heartbeat) when none come.
        let _ = tokio::time::timeout(every, watch.changed()).await;
    }
}
