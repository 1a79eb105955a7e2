//! The master's view of the pool: storage nodes (liveness, tier use) and which node holds which
//! block, as the nodes report it; and the placement of new blocks over the live nodes.
//!
//! The storage nodes are the truth: each keeps its own index in its own sled and reports every
//! copy it stores or drops (its whole inventory after it joins). The master only routes, so a
//! master that restarts, or a node that returns, rebuilds this view from the nodes' reports
//! with nothing lost. A node silent past the timeout is dead: it leaves every route at once, so
//! clients see misses, never a route to a node that cannot answer; its copies are forgotten
//! right after, one shard of the map at a time, while routes go on (`map`).

use crate::events::EventLog;
use kvpool_core::{Change, ChangeKind};
use kvpool_policy_sdk::{NodeSet, PlaceBatch, PlacementPolicy, Placements, Tier, NO_NODE, NO_PARENT};
use kvpool_proto::{
    KvEventKind, NodeAddr, NodeInfo, NodeJoinRequest, NodeJoined, NodeList, NodeReportRequest, PutItem, Routes, TierUse,
};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

mod map;
use map::BlockMap;

/// Why a report was refused: the node must join again (and then re-announce its inventory).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("node {0} is not known to this master (it restarted, or the node was declared dead): join again")]
    Unknown(u32),
    #[error("node {0} joined again since (another incarnation): this report is stale")]
    Stale(u32),
}

struct NodeEntry {
    name: String,
    addr: String,
    server_name: String,
    fingerprint: Vec<u8>,
    incarnation: u64,
    live: bool,
    last: Instant,
    tiers: Vec<TierUse>,
    copies: u64,
    /// Bytes placed on the node since its last report (not in its reported use yet), so that
    /// back-to-back placements between two reports spread out.
    placed: u64,
}

impl NodeEntry {
    fn free(&self, tier: Tier) -> u64 {
        let t = self.tiers.iter().find(|u| u.tier == tier as u8);
        let free = t.map_or(0, |u| u.capacity.saturating_sub(u.used));
        if tier == Tier::Dram {
            free.saturating_sub(self.placed)
        } else {
            free
        }
    }

    /// DRAM fill in permille: the load a placement policy sees.
    fn load(&self) -> u32 {
        let Some(d) = self.tiers.iter().find(|u| u.tier == Tier::Dram as u8) else { return 1000 };
        let used = d.used.saturating_add(self.placed).min(d.capacity);
        (used.saturating_mul(1000) / d.capacity.max(1)) as u32
    }

    fn addr(&self, id: u32) -> NodeAddr {
        NodeAddr {
            node: id,
            addr: self.addr.clone(),
            server_name: self.server_name.clone(),
            fingerprint: self.fingerprint.clone(),
        }
    }
}

#[derive(Default)]
struct Nodes {
    /// Node `i + 1` is `list[i]`; ids stay with a name for the master's life.
    list: Vec<NodeEntry>,
    by_name: HashMap<String, u32>,
}

impl Nodes {
    fn node(&self, id: u32) -> Option<&NodeEntry> {
        self.list.get((id as usize).checked_sub(1)?)
    }

    fn node_mut(&mut self, id: u32) -> Option<&mut NodeEntry> {
        self.list.get_mut((id as usize).checked_sub(1)?)
    }

    /// The one live node whose address is `ip`: an engine's own node, when the engine connects
    /// from its host's address. `None` when no node, or more than one (several nodes on one
    /// host, as on a test machine), has that address.
    fn node_at(&self, ip: std::net::IpAddr) -> Option<u32> {
        let mut at = self.list.iter().enumerate().filter(|(_, n)| {
            n.live && n.addr.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().to_canonical() == ip.to_canonical())
        });
        let (i, _) = at.next()?;
        at.next().is_none().then_some(i as u32 + 1)
    }

    fn live(&self, id: u32) -> bool {
        self.node(id).is_some_and(|e| e.live)
    }

    fn routes(&self, items: Vec<Vec<u32>>) -> Routes {
        let mut named: Vec<u32> = items.iter().flatten().copied().collect();
        named.sort_unstable();
        named.dedup();
        let nodes = named.into_iter().filter_map(|id| Some(self.node(id)?.addr(id))).collect();
        Routes { nodes, items }
    }
}

/// Tenant name -> id (the server's own tenant ids, so that KV event subscriptions filter by
/// tenant as on any server), and back.
#[derive(Default)]
struct Tenants {
    ids: HashMap<String, u32>,
    names: HashMap<u32, String>,
}

fn change(
    kind: ChangeKind,
    tier: Tier,
    tenant: u32,
    key: &[u8],
    parent: Option<&[u8]>,
    size: u64,
    node: u32,
) -> Change {
    Change { kind, tier, tenant, key: key.into(), parent: parent.map(Into::into), size, time_ms: 0, node }
}

/// The master role's state.
///
/// Locks: `membership` orders forgets against reports (reports share it; a forget of a dead
/// node, a join and a change of leadership take it alone, so no report lands in the middle of
/// a forget); `nodes` is taken before a shard of `blocks` when both are held. Routes take
/// neither `membership` nor a shard for longer than one key.
pub struct Master {
    membership: RwLock<()>,
    nodes: RwLock<Nodes>,
    tenants: RwLock<Tenants>,
    blocks: BlockMap,
    /// KV events of the whole pool (its nodes' copies), for subscriptions to the master.
    events: Option<Arc<EventLog>>,
    /// A tenant name's id on this server.
    resolve: Box<dyn Fn(&str) -> u32 + Send + Sync>,
    /// Whether this master leads: always with no etcd; with etcd, while it holds the leader
    /// key's lease. A master that does not lead answers cluster requests `not-leader`.
    leading: std::sync::atomic::AtomicBool,
    /// The leader etcd names, for the `not-leader` answers of a follower.
    leader: Mutex<Option<String>>,
    /// How often nodes report.
    pub report_ms: u32,
    /// Silence after which a node is dead.
    pub timeout: Duration,
}

impl Master {
    /// `resolve` gives a tenant name's id (as the server's auth does), `events` is the log of
    /// the pool's KV events.
    pub fn new(
        report_ms: u32,
        timeout: Duration,
        resolve: Box<dyn Fn(&str) -> u32 + Send + Sync>,
        events: Option<Arc<EventLog>>,
    ) -> Master {
        Master {
            membership: RwLock::new(()),
            nodes: RwLock::new(Nodes::default()),
            tenants: RwLock::new(Tenants::default()),
            // Keys for the events of a forget: as many as the ring holds.
            blocks: BlockMap::new(events.as_ref().map_or(0, |e| e.capacity())),
            events,
            resolve,
            leading: true.into(),
            leader: Mutex::new(None),
            report_ms,
            timeout,
        }
    }

    pub fn is_leading(&self) -> bool {
        self.leading.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Start or stop leading. Either way the view starts empty: a new leader learns the pool
    /// from the storage nodes' joins and announcements, and one that stopped must not answer
    /// from a view that no longer follows the nodes.
    pub fn set_leading(&self, on: bool) {
        let _alone = self.membership.write();
        let ids = 1..=self.nodes.read().list.len() as u32;
        for id in ids {
            self.forget(id);
        }
        self.blocks.clear();
        *self.nodes.write() = Nodes::default();
        *self.tenants.write() = Tenants::default();
        self.leading.store(on, std::sync::atomic::Ordering::Release);
    }

    fn publish(&self, changes: Vec<Change>) {
        if let Some(log) = &self.events {
            log.publish(changes);
        }
    }

    /// Forget every copy on `node`, shard by shard; its `Removed` events are logged as each
    /// shard is walked. The caller holds `membership` alone, or is the node's own report.
    fn forget(&self, node: u32) {
        if self.nodes.read().node(node).is_none_or(|n| n.copies == 0) {
            return;
        }
        let done = self.blocks.forget(node, |gone| self.publish(gone));
        if done.unknown > 0 {
            if let Some(log) = &self.events {
                log.skip(done.unknown);
            }
        }
        if let Some(n) = self.nodes.write().node_mut(node) {
            n.copies = 0;
        }
    }

    /// Name of a storage node, for its KV events.
    pub fn node_name(&self, id: u32) -> String {
        self.nodes.read().node(id).map_or_else(|| format!("node-{id}"), |n| n.name.clone())
    }

    /// Name of a tenant id the nodes reported.
    pub fn tenant_name(&self, id: u32) -> Option<String> {
        self.tenants.read().names.get(&id).cloned()
    }

    fn tenant_id(&self, name: &str) -> Option<u32> {
        self.tenants.read().ids.get(name).copied()
    }

    fn tenant(&self, name: &str) -> u32 {
        if let Some(t) = self.tenant_id(name) {
            return t;
        }
        let mut ts = self.tenants.write();
        if let Some(&t) = ts.ids.get(name) {
            return t;
        }
        let t = (self.resolve)(name);
        ts.ids.insert(name.to_string(), t);
        ts.names.insert(t, name.to_string());
        t
    }

    /// Who leads, as last read from etcd (for followers' answers).
    pub fn set_leader(&self, addr: Option<String>) {
        *self.leader.lock() = addr;
    }

    pub fn leader(&self) -> Option<String> {
        self.leader.lock().clone()
    }

    /// A node joins (or joins again under its name, keeping its id): its earlier copies are
    /// forgotten until it re-announces them.
    pub fn join(&self, req: NodeJoinRequest) -> NodeJoined {
        let _alone = self.membership.write();
        let entry = NodeEntry {
            name: req.name.clone(),
            addr: req.addr,
            server_name: req.server_name,
            fingerprint: req.fingerprint,
            incarnation: req.incarnation,
            live: true,
            last: Instant::now(),
            tiers: req.tiers,
            copies: 0,
            placed: 0,
        };
        let known = self.nodes.read().by_name.get(&req.name).copied();
        let id = match known {
            Some(id) => {
                if let Some(old) = self.nodes.read().node(id).filter(|n| n.live && n.addr != entry.addr) {
                    // Two live nodes under one name would take turns replacing each other.
                    warn!(node = id, name = %req.name, old = %old.addr, new = %entry.addr,
                        "a node joined under the name of a live node at another address: it replaces it \
                         (give every storage node its own cluster.node_name)");
                }
                self.forget(id);
                *self.nodes.write().node_mut(id).expect("named nodes exist") = entry;
                id
            }
            None => {
                let mut nodes = self.nodes.write();
                nodes.list.push(entry);
                let id = nodes.list.len() as u32;
                nodes.by_name.insert(req.name.clone(), id);
                id
            }
        };
        info!(node = id, name = %req.name, "storage node joined");
        NodeJoined { node: id, report_ms: self.report_ms }
    }

    /// Apply a node's report (also its heartbeat).
    pub fn report(&self, req: NodeReportRequest) -> Result<(), ReportError> {
        let _shared = self.membership.read();
        {
            let mut nodes = self.nodes.write();
            let n = nodes.node_mut(req.node).filter(|n| n.live).ok_or(ReportError::Unknown(req.node))?;
            if n.incarnation != req.incarnation {
                return Err(ReportError::Stale(req.node));
            }
            n.last = Instant::now();
            n.tiers = req.tiers;
            n.placed = 0;
        }
        if req.reset {
            self.forget(req.node);
        }
        let mut changes = Vec::new();
        let mut delta: i64 = 0;
        // A report names one tenant for long runs: resolve it once per run.
        let mut last: Option<(String, u32)> = None;
        for b in req.blocks {
            let Some(tier) = Tier::from_u8(b.tier) else { continue };
            let tenant = match &last {
                Some((name, t)) if *name == b.tenant => *t,
                _ => {
                    let t = self.tenant(&b.tenant);
                    last = Some((b.tenant.clone(), t));
                    t
                }
            };
            let (changed, d) = self.blocks.apply(req.node, tenant, &b.key, b.kind, tier, b.size);
            delta += d;
            if changed {
                let kind = match b.kind {
                    KvEventKind::Stored => ChangeKind::Stored,
                    KvEventKind::Removed => ChangeKind::Removed,
                    KvEventKind::Evicted => ChangeKind::Evicted,
                };
                changes.push(change(kind, tier, tenant, &b.key, b.parent.as_deref(), b.size, req.node));
            }
        }
        if delta != 0 {
            if let Some(n) = self.nodes.write().node_mut(req.node) {
                n.copies = n.copies.saturating_add_signed(delta);
            }
        }
        self.publish(changes);
        Ok(())
    }

    /// Declare dead every live node silent for longer than the timeout; returns how many.
    /// A dead node is out of every route at once; its copies are forgotten after, shard by
    /// shard, while routes go on.
    pub fn sweep(&self, now: Instant) -> usize {
        let dead: Vec<u32> = {
            let mut nodes = self.nodes.write();
            let dead: Vec<u32> = (1..=nodes.list.len() as u32)
                .filter(|&id| {
                    nodes.node(id).is_some_and(|n| n.live && now.saturating_duration_since(n.last) > self.timeout)
                })
                .collect();
            for &id in &dead {
                let n = nodes.node_mut(id).expect("listed");
                n.live = false;
                warn!(node = id, name = %n.name, "storage node is silent past the timeout: dead, its blocks are misses");
            }
            dead
        };
        if !dead.is_empty() {
            let _alone = self.membership.write();
            for &id in &dead {
                // It may have joined again while this waited: its join forgot the copies then.
                if !self.nodes.read().live(id) {
                    self.forget(id);
                }
            }
        }
        dead.len()
    }

    pub fn nodes(&self) -> NodeList {
        let st = self.nodes.read();
        let now = Instant::now();
        let nodes = st
            .list
            .iter()
            .enumerate()
            .map(|(i, n)| NodeInfo {
                node: i as u32 + 1,
                name: n.name.clone(),
                addr: n.addr.clone(),
                server_name: n.server_name.clone(),
                fingerprint: n.fingerprint.clone(),
                live: n.live,
                silent_ms: now.saturating_duration_since(n.last).as_millis() as u64,
                copies: n.copies,
                tiers: n.tiers.clone(),
            })
            .collect();
        NodeList { nodes }
    }

    /// (live nodes, copies known) for the gauges.
    pub fn counts(&self) -> (usize, u64) {
        let st = self.nodes.read();
        (st.list.iter().filter(|n| n.live).count(), st.list.iter().map(|n| n.copies).sum())
    }

    /// Live holders of `key` of `tenant`, DRAM copies first.
    fn holders(&self, nodes: &Nodes, tenant: Option<u32>, key: &[u8]) -> Vec<u32> {
        match tenant {
            Some(t) => self.blocks.holders(t, key, |n| nodes.live(n)),
            None => Vec::new(),
        }
    }

    /// Where each key of `tenant` is: live holders, DRAM copies first.
    pub fn route(&self, tenant: &str, keys: &[Vec<u8>]) -> Routes {
        let t = self.tenant_id(tenant);
        let nodes = self.nodes.read();
        let items = match t {
            Some(t) => self.blocks.holders_many(t, keys, |n| nodes.live(n)),
            None => vec![Vec::new(); keys.len()],
        };
        nodes.routes(items)
    }

    /// Choose nodes for new blocks of `tenant`: `policy` (the master's placement module) when
    /// it gives a valid answer, else the built-in least-loaded placement. An item gets no node
    /// when no node is live.
    pub fn place(
        &self,
        tenant: &str,
        items: &[PutItem],
        replicas: u32,
        client: Option<std::net::IpAddr>,
        policy: impl FnOnce(&PlaceBatch, &NodeSet) -> Option<Placements>,
    ) -> Routes {
        let t = self.tenant_id(tenant);
        let mut st = self.nodes.write();
        let mut nodes = NodeSet::default();
        for (i, n) in st.list.iter().enumerate().filter(|(_, n)| n.live) {
            nodes.push(i as u64 + 1, [0, n.free(Tier::Dram), n.free(Tier::Ssd)], n.load());
        }
        if nodes.is_empty() {
            return Routes { nodes: Vec::new(), items: vec![Vec::new(); items.len()] };
        }
        let mut batch = self.place_batch(&st, t, items, replicas);
        batch.client_node = client.and_then(|ip| st.node_at(ip)).map_or(NO_NODE, u64::from);
        let r = batch.effective_replicas(nodes.len());
        let valid = |p: &Placements| {
            p.node.len() == items.len() * r
                && p.node.chunks(r.max(1)).all(|c| {
                    c.iter().all(|n| nodes.id.contains(n)) && c.iter().enumerate().all(|(i, n)| !c[..i].contains(n))
                })
        };
        let chosen = match policy(&batch, &nodes) {
            Some(p) if valid(&p) => p,
            Some(_) => {
                warn!("the placement policy's answer names unknown or repeated nodes: placed least-loaded");
                kvpool_policies::LeastLoaded.place(&batch, &nodes)
            }
            None => kvpool_policies::PrefixAffinity::default().place(&batch, &nodes),
        };
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); items.len()];
        if r > 0 {
            for (i, c) in chosen.node.chunks(r).enumerate().take(items.len()) {
                out[i] = c.iter().map(|&n| n as u32).collect();
                for &n in c {
                    if let Some(e) = st.node_mut(n as u32) {
                        e.placed = e.placed.saturating_add(items[i].size);
                    }
                }
            }
        }
        st.routes(out)
    }

    /// The placement question: blocks in request order, a parent in the same batch named by
    /// its position, a parent already in the pool by the node that holds it.
    fn place_batch(&self, nodes: &Nodes, tenant: Option<u32>, items: &[PutItem], replicas: u32) -> PlaceBatch {
        let mut b = PlaceBatch { replicas: replicas.max(1), ..PlaceBatch::default() };
        let mut pos: HashMap<&[u8], u64> = HashMap::new();
        for (i, it) in items.iter().enumerate() {
            let id = i as u64 + 1;
            let (parent, parent_node) = match it.parent.as_deref() {
                None => (NO_PARENT, NO_NODE),
                Some(p) => match pos.get(p) {
                    Some(&pid) => (pid, NO_NODE),
                    None => (NO_PARENT, self.holders(nodes, tenant, p).first().map_or(NO_NODE, |&n| u64::from(n))),
                },
            };
            b.id.push(id);
            b.size.push(it.size);
            b.tokens.push(it.tokens);
            b.parent.push(parent);
            b.parent_node.push(parent_node);
            b.tier.push(Tier::Dram as u8);
            pos.insert(&it.key, id);
        }
        b
    }
}

#[cfg(test)]
mod tests;
