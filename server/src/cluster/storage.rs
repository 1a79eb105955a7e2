//! The storage role's link to the master: join, announce the whole inventory, then report every
//! change of the node's event log (and the tiers' use) as it happens, at least every
//! `report_ms`. Any failure (master down, restarted, or it declared this node dead) ends the
//! session; the next one joins again and re-announces, so the master's view always converges
//! on the node's own index.

use crate::auth::Auth;
use crate::events::EventLog;
use crate::metrics::Metrics;
use crate::store::Store;
use kvpool_client::{Client, ClientConfig, ClientError, Trust};
use kvpool_core::{Change, ChangeKind};
use kvpool_policy_sdk::Tier;
use kvpool_proto::{ErrorCode, KvEventKind, NodeBlock, NodeJoinRequest, NodeReportRequest, TierUse};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// What the link needs of the node it speaks for.
#[derive(Clone)]
pub struct ThisNode {
    pub store: Arc<Store>,
    /// Tenant names by id (reports and node puts name tenants).
    pub auth: Arc<Auth>,
    pub metrics: Arc<Metrics>,
    /// The node's KV event log (a storage node needs it: it reports from it).
    pub events: Option<Arc<EventLog>>,
}

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
    /// This node's id once joined (0 before).
    pub me: Arc<std::sync::atomic::AtomicU32>,
    /// This node's name, client address, TLS name and certificate fingerprint.
    pub name: String,
    pub addr: String,
    pub server_name: String,
    pub fingerprint: [u8; 32],
    /// How blocks move to other storage nodes (`bulk.peers`), and the networks this node
    /// trusts for plaintext (`bulk.trusted_networks`).
    pub peers: kvpool_client::BulkChoice,
    pub trusted_networks: Vec<ipnet::IpNet>,
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
pub async fn run(this: ThisNode, link: Link) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match session(&this, &link).await {
            Ok(()) => backoff = Duration::from_millis(200),
            Err(e) => {
                warn!(master = %link.master, error = %e, "link to the master lost; joining again");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

fn tiers(this: &ThisNode) -> Vec<TierUse> {
    this.store.tier_usage().into_iter().map(|(t, capacity, used)| TierUse { tier: t as u8, capacity, used }).collect()
}

fn block(this: &ThisNode, c: Change) -> NodeBlock {
    NodeBlock {
        kind: match c.kind {
            ChangeKind::Stored => KvEventKind::Stored,
            ChangeKind::Removed => KvEventKind::Removed,
            ChangeKind::Evicted => KvEventKind::Evicted,
        },
        tier: c.tier as u8,
        tenant: this.auth.tenant_name(c.tenant),
        key: c.key.to_vec(),
        parent: c.parent.map(|p| p.to_vec()),
        size: c.size,
    }
}

/// Send `changes` in reports of bounded size; the first is a reset when `reset`.
async fn send(
    master: &Client,
    this: &ThisNode,
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
                    tiers: tiers(this),
                    blocks: std::mem::take(&mut blocks),
                };
                master.node_report(req).await?;
                this.metrics.cluster_reports.inc();
                reset = false;
                bytes = 0;
            }
            if last {
                return Ok(());
            }
        }
        let c = it.next().expect("peeked");
        bytes += c.key.len() + 64;
        blocks.push(block(this, c));
    }
}

/// A connection to the master `link` names (the leader, with etcd).
async fn connect_master(link: &Link) -> Result<Client, LinkError> {
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
    cfg.bulk = kvpool_client::BulkChoice::Quic;
    // A master that died must not hold the node for long: it rejoins whoever leads next. A
    // report is at most half a MiB, which a second carries even between distant hosts.
    cfg.request_timeout = Duration::from_secs(1);
    Ok(Client::connect_direct(cfg).await?)
}

async fn session(this: &ThisNode, link: &Link) -> Result<(), LinkError> {
    let log = this.events.clone().ok_or(LinkError::NoEvents)?;
    let master = connect_master(link).await?;
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
            tiers: tiers(this),
        })
        .await?;
    let node = joined.node;
    link.me.store(node, std::sync::atomic::Ordering::Release);
    this.metrics.cluster_joins.inc();
    let every = Duration::from_millis(u64::from(joined.report_ms.max(10)));
    let mut watch = log.watch();
    let (mut cursor, inventory) = this.store.inventory();
    info!(node, copies = inventory.len(), master = %link.master, "joined the master; announcing the inventory");
    send(&master, this, node, incarnation, true, inventory).await?;
    loop {
        // Seen: a publication after this line wakes the wait below.
        watch.borrow_and_update();
        let batch = log.read(cursor, REPORT_BLOCKS, REPORT_BLOCKS, |_| true);
        if batch.lagged > 0 {
            // Changes were lost to this reader: start the master's view of this node again.
            warn!(node, lagged = batch.lagged, "the event log outran the reports; announcing the inventory again");
            let (c, inventory) = this.store.inventory();
            cursor = c;
            send(&master, this, node, incarnation, true, inventory).await?;
            continue;
        }
        let more = batch.changes.len() == REPORT_BLOCKS;
        cursor = batch.next;
        let changes: Vec<Change> = batch.changes.into_iter().map(|(_, c)| c).collect();
        match send(&master, this, node, incarnation, false, changes).await {
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

// ---- offload: DRAM victims into another node's free DRAM, before SSD --------------------------

/// Moves this node's DRAM victims into the free DRAM of another storage node (the store asks
/// before it demotes them to SSD), so that the pool's DRAM is used as one. A peer takes them
/// only while its DRAM stays below `max_fill` of its capacity with them, so blocks do not bounce
/// between full nodes.
pub struct Offloader {
    link: Link,
    auth: Arc<Auth>,
    max_fill: f64,
    conns: tokio::sync::Mutex<Conns>,
}

#[derive(Default)]
struct Conns {
    master: Option<Client>,
    nodes: std::collections::HashMap<u32, (String, Client)>,
    /// The master's node list and when it was read.
    view: Option<(std::time::Instant, Vec<kvpool_proto::NodeInfo>)>,
}

/// How long one offer may take (it runs on the eviction path), and how old a node list may be.
const OFFLOAD_BUDGET: Duration = Duration::from_millis(500);
const VIEW_AGE: Duration = Duration::from_millis(200);

impl Offloader {
    pub fn new(link: Link, auth: Arc<Auth>, max_fill: f64) -> Offloader {
        Offloader { link, auth, max_fill, conns: tokio::sync::Mutex::default() }
    }

    async fn try_offload(&self, blocks: &[(Change, &[u8])]) -> Result<Vec<bool>, LinkError> {
        let me = self.link.me.load(std::sync::atomic::Ordering::Acquire);
        if me == 0 || blocks.is_empty() {
            return Ok(vec![false; blocks.len()]);
        }
        let mut conns = self.conns.lock().await;
        if conns.view.as_ref().is_none_or(|(at, _)| at.elapsed() > VIEW_AGE) {
            if conns.master.is_none() {
                conns.master = Some(connect_master(&self.link).await?);
            }
            let list = match conns.master.as_ref().expect("just set").nodes().await {
                Ok(l) => l,
                Err(e) => {
                    conns.master = None;
                    return Err(e.into());
                }
            };
            conns.view = Some((std::time::Instant::now(), list));
        }
        let total: u64 = blocks.iter().map(|(_, b)| b.len() as u64).sum();
        let dram = |n: &kvpool_proto::NodeInfo| n.tiers.iter().find(|t| t.tier == Tier::Dram as u8).copied();
        let (_, view) = conns.view.as_mut().expect("just read");
        let target = view
            .iter_mut()
            .filter(|n| n.live && n.node != me)
            .filter_map(|n| {
                let d = dram(n)?;
                let after = d.used.saturating_add(total);
                (after as f64 <= self.max_fill * d.capacity as f64).then_some((d.capacity - d.used, n))
            })
            .max_by_key(|(free, _)| *free)
            .map(|(_, n)| n);
        let Some(target) = target else { return Ok(vec![false; blocks.len()]) };
        // Count what this offer adds until the next node list, so offers do not pile onto it.
        if let Some(t) = target.tiers.iter_mut().find(|t| t.tier == Tier::Dram as u8) {
            t.used = t.used.saturating_add(total);
        }
        let (id, addr, server_name, fp) =
            (target.node, target.addr.clone(), target.server_name.clone(), target.fingerprint.clone());
        let fresh = !matches!(conns.nodes.get(&id), Some((a, _)) if *a == addr);
        if fresh {
            let fp: [u8; 32] = fp.as_slice().try_into().map_err(|_| LinkError::BadLeader)?;
            let mut cfg = ClientConfig::new(addr.clone(), self.link.api_key.clone(), Trust::Fingerprint(fp));
            cfg.server_name = server_name;
            cfg.client_name = format!("kvpool-storage/{}", self.link.name);
            cfg.transport = kvpool_client::TransportChoice::Quic;
            cfg.bulk = self.link.peers;
            cfg.trusted_networks = self.link.trusted_networks.clone();
            cfg.request_timeout = OFFLOAD_BUDGET;
            conns.nodes.insert(id, (addr, Client::connect_direct(cfg).await?));
        }
        let peer = conns.nodes.get(&id).expect("just connected").1.clone();
        drop(conns);
        // One put per tenant: the peer stores them as that tenant's blocks.
        let mut by_tenant: std::collections::BTreeMap<u32, Vec<usize>> = std::collections::BTreeMap::new();
        for (i, (c, _)) in blocks.iter().enumerate() {
            by_tenant.entry(c.tenant).or_default().push(i);
        }
        let mut out = vec![false; blocks.len()];
        for (tenant, idx) in by_tenant {
            let entries: Vec<kvpool_client::PutEntry<'_>> = idx
                .iter()
                .map(|&i| kvpool_client::PutEntry {
                    key: &blocks[i].0.key,
                    value: blocks[i].1,
                    opts: kvpool_client::PutOptions {
                        parent: blocks[i].0.parent.as_deref().map(<[u8]>::to_vec),
                        ..Default::default()
                    },
                })
                .collect();
            let codes =
                match peer.node_put(&self.auth.tenant_name(tenant), &entries, kvpool_proto::PutMode::Insert).await {
                    Ok(c) => c,
                    Err(e) => {
                        self.conns.lock().await.nodes.remove(&id);
                        return Err(e.into());
                    }
                };
            for (&i, c) in idx.iter().zip(codes) {
                out[i] = matches!(c, ErrorCode::Ok | ErrorCode::AlreadyExists);
            }
        }
        Ok(out)
    }
}

impl crate::store::Offload for Offloader {
    fn offload<'a>(&'a self, blocks: Vec<(Change, &'a [u8])>) -> crate::store::BoxFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let n = blocks.len();
            match tokio::time::timeout(OFFLOAD_BUDGET, self.try_offload(&blocks)).await {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "offload to a peer failed: the victims go to SSD");
                    vec![false; n]
                }
                Err(_) => vec![false; n],
            }
        })
    }
}
