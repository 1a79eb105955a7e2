//! The master's view of the pool: storage nodes (liveness, tier use) and which node holds which
//! block, as the nodes report it; and the placement of new blocks over the live nodes.
//!
//! The storage nodes are the truth: each keeps its own index in its own sled and reports every
//! copy it stores or drops (its whole inventory after it joins). The master only routes, so a
//! master that restarts, or a node that returns, rebuilds this view from the nodes' reports
//! with nothing lost. A node silent past the timeout is dead: its copies are forgotten at
//! once, so clients see misses, never a route to a node that cannot answer.

use crate::events::EventLog;
use kvpool_core::{Change, ChangeKind};
use kvpool_policy_sdk::{NodeSet, PlaceBatch, PlacementPolicy, Placements, Tier, NO_NODE, NO_PARENT};
use kvpool_proto::{
    KvEventKind, NodeAddr, NodeBlock, NodeInfo, NodeJoinRequest, NodeJoined, NodeList, NodeReportRequest, PutItem,
    Routes, TierUse,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

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

/// A block in the pool: its size, and its copies as (node, bit per tier).
#[derive(Default)]
struct Copies {
    size: u64,
    on: Vec<(u32, u8)>,
}

#[derive(Default)]
struct State {
    /// Node `i + 1` is `nodes[i]`; ids stay with a name for the master's life.
    nodes: Vec<NodeEntry>,
    by_name: HashMap<String, u32>,
    /// Tenant name -> id (the server's own tenant ids, so that KV event subscriptions filter
    /// by tenant as on any server), and back.
    tenants: HashMap<String, u32>,
    names: HashMap<u32, String>,
    /// Per tenant id: key -> copies, in `SHARDS` maps by key hash (a dead node is forgotten a
    /// shard at a time, so routes are not held up for the whole walk).
    blocks: HashMap<u32, Vec<BlockMap>>,
}

/// Key -> copies (one shard of a tenant's blocks).
type BlockMap = HashMap<Box<[u8]>, Copies>;

/// Shards of each tenant's block map.
const SHARDS: usize = 64;

fn shard_of(key: &[u8]) -> usize {
    (xxhash_rust::xxh3::xxh3_64(key) % SHARDS as u64) as usize
}

impl State {
    fn node(&self, id: u32) -> Option<&NodeEntry> {
        self.nodes.get((id as usize).checked_sub(1)?)
    }

    /// The one live node whose address is `ip`: an engine's own node, when the engine connects
    /// from its host's address. `None` when no node, or more than one (several nodes on one
    /// host, as on a test machine), has that address.
    fn node_at(&self, ip: std::net::IpAddr) -> Option<u32> {
        let mut at = self.nodes.iter().enumerate().filter(|(_, n)| {
            n.live && n.addr.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().to_canonical() == ip.to_canonical())
        });
        let (i, _) = at.next()?;
        at.next().is_none().then_some(i as u32 + 1)
    }

    fn node_mut(&mut self, id: u32) -> Option<&mut NodeEntry> {
        self.nodes.get_mut((id as usize).checked_sub(1)?)
    }

    fn tenant(&mut self, name: &str, resolve: &dyn Fn(&str) -> u32) -> u32 {
        if let Some(&t) = self.tenants.get(name) {
            return t;
        }
        let t = resolve(name);
        self.tenants.insert(name.to_string(), t);
        self.names.insert(t, name.to_string());
        t
    }

    /// Forget every copy on `node`; one `Removed` change per copy forgotten.
    fn forget(&mut self, node: u32) -> Vec<Change> {
        let gone = (0..SHARDS).flat_map(|s| self.forget_shard(node, s)).collect();
        if let Some(n) = self.node_mut(node) {
            n.copies = 0;
        }
        gone
    }

    /// [`State::forget`] in shard `shard` of every tenant's map.
    fn forget_shard(&mut self, node: u32, shard: usize) -> Vec<Change> {
        let mut gone = Vec::new();
        for (&tenant, shards) in self.blocks.iter_mut() {
            shards[shard].retain(|key, c| {
                if let Some(i) = c.on.iter().position(|&(n, _)| n == node) {
                    let (_, bits) = c.on.swap_remove(i);
                    for tier in Tier::ALL.into_iter().filter(|&t| bits & (1 << t as u8) != 0) {
                        gone.push(change(ChangeKind::Removed, tier, tenant, key, None, c.size, node));
                    }
                }
                !c.on.is_empty()
            });
        }
        gone
    }

    /// Apply one reported copy; the change to log when it changed the view.
    fn apply(&mut self, node: u32, b: NodeBlock, resolve: &dyn Fn(&str) -> u32) -> Option<Change> {
        let tier = Tier::from_u8(b.tier)?;
        let bit = 1u8 << (tier as u8);
        let tenant = self.tenant(&b.tenant, resolve);
        let shards = self.blocks.entry(tenant).or_insert_with(|| (0..SHARDS).map(|_| HashMap::new()).collect());
        let map = &mut shards[shard_of(&b.key)];
        let mut delta: i64 = 0;
        let changed = match b.kind {
            KvEventKind::Stored => {
                let c = map.entry(b.key.as_slice().into()).or_default();
                c.size = b.size;
                match c.on.iter_mut().find(|(n, _)| *n == node) {
                    Some((_, bits)) => std::mem::replace(bits, *bits | bit) & bit == 0,
                    None => {
                        c.on.push((node, bit));
                        delta = 1;
                        true
                    }
                }
            }
            KvEventKind::Removed | KvEventKind::Evicted => {
                let mut had = false;
                if let Some(c) = map.get_mut(b.key.as_slice()) {
                    if let Some(i) = c.on.iter().position(|&(n, _)| n == node) {
                        had = c.on[i].1 & bit != 0;
                        c.on[i].1 &= !bit;
                        if c.on[i].1 == 0 {
                            c.on.swap_remove(i);
                            delta = -1;
                        }
                    }
                    if c.on.is_empty() {
                        map.remove(b.key.as_slice());
                    }
                }
                had
            }
        };
        if let Some(n) = self.node_mut(node) {
            n.copies = n.copies.saturating_add_signed(delta);
        }
        let kind = match b.kind {
            KvEventKind::Stored => ChangeKind::Stored,
            KvEventKind::Removed => ChangeKind::Removed,
            KvEventKind::Evicted => ChangeKind::Evicted,
        };
        changed.then(|| change(kind, tier, tenant, &b.key, b.parent.as_deref(), b.size, node))
    }

    /// Live nodes holding `key` of `tenant`, DRAM copies first.
    fn holders(&self, tenant: Option<u32>, key: &[u8]) -> Vec<u32> {
        let Some(copies) = tenant.and_then(|t| self.blocks.get(&t)).and_then(|m| m[shard_of(key)].get(key)) else {
            return Vec::new();
        };
        let mut out: Vec<(bool, u32)> = copies
            .on
            .iter()
            .filter(|&&(n, _)| self.node(n).is_some_and(|e| e.live))
            .map(|&(n, bits)| (bits & (1 << Tier::Dram as u8) == 0, n))
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, n)| n).collect()
    }

    fn routes(&self, items: Vec<Vec<u32>>) -> Routes {
        let mut named: Vec<u32> = items.iter().flatten().copied().collect();
        named.sort_unstable();
        named.dedup();
        let nodes = named.into_iter().filter_map(|id| Some(self.node(id)?.addr(id))).collect();
        Routes { nodes, items }
    }
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
pub struct Master {
    state: Mutex<State>,
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
            state: Mutex::new(State::default()),
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
        let mut st = self.state.lock();
        let gone: Vec<Change> = (1..=st.nodes.len() as u32).flat_map(|id| st.forget(id)).collect();
        self.publish(gone);
        *st = State::default();
        self.leading.store(on, std::sync::atomic::Ordering::Release);
    }

    /// Log changes (the caller holds the state lock, so the log's order is the view's).
    fn publish(&self, changes: Vec<Change>) {
        if let Some(log) = &self.events {
            log.publish(changes);
        }
    }

    /// Name of a storage node, for its KV events.
    pub fn node_name(&self, id: u32) -> String {
        self.state.lock().node(id).map_or_else(|| format!("node-{id}"), |n| n.name.clone())
    }

    /// Name of a tenant id the nodes reported.
    pub fn tenant_name(&self, id: u32) -> Option<String> {
        self.state.lock().names.get(&id).cloned()
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
        let mut st = self.state.lock();
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
        let id = match st.by_name.get(&req.name).copied() {
            Some(id) => {
                if let Some(old) = st.node(id).filter(|n| n.live && n.addr != entry.addr) {
                    // Two live nodes under one name would take turns replacing each other.
                    warn!(node = id, name = %req.name, old = %old.addr, new = %entry.addr,
                        "a node joined under the name of a live node at another address: it replaces it \
                         (give every storage node its own cluster.node_name)");
                }
                let gone = st.forget(id);
                self.publish(gone);
                *st.node_mut(id).expect("named nodes exist") = entry;
                id
            }
            None => {
                st.nodes.push(entry);
                let id = st.nodes.len() as u32;
                st.by_name.insert(req.name.clone(), id);
                id
            }
        };
        info!(node = id, name = %req.name, "storage node joined");
        NodeJoined { node: id, report_ms: self.report_ms }
    }

    /// Apply a node's report (also its heartbeat).
    pub fn report(&self, req: NodeReportRequest) -> Result<(), ReportError> {
        let mut st = self.state.lock();
        let n = st.node_mut(req.node).filter(|n| n.live).ok_or(ReportError::Unknown(req.node))?;
        if n.incarnation != req.incarnation {
            return Err(ReportError::Stale(req.node));
        }
        n.last = Instant::now();
        n.tiers = req.tiers;
        n.placed = 0;
        let mut changes = if req.reset { st.forget(req.node) } else { Vec::new() };
        for b in req.blocks {
            changes.extend(st.apply(req.node, b, &*self.resolve));
        }
        self.publish(changes);
        Ok(())
    }

    /// Declare dead every live node silent for longer than the timeout; returns how many.
    pub fn sweep(&self, now: Instant) -> usize {
        let dead: Vec<u32> = {
            let mut st = self.state.lock();
            let dead: Vec<u32> = (1..=st.nodes.len() as u32)
                .filter(|&id| {
                    st.node(id).is_some_and(|n| n.live && now.saturating_duration_since(n.last) > self.timeout)
                })
                .collect();
            for &id in &dead {
                // Routes skip a node that is not live: from here on none names it.
                let n = st.node_mut(id).expect("listed");
                n.live = false;
                warn!(node = id, name = %n.name, "storage node is silent past the timeout: dead, its blocks are misses");
            }
            dead
        };
        // Its copies go a shard at a time, the lock released in between, so routes and reports
        // are held up for a shard's walk, not the whole map's. A node that joins again meanwhile
        // was forgotten whole by its join: what is left is its new inventory.
        for &id in &dead {
            for shard in 0..SHARDS {
                let mut st = self.state.lock();
                if st.node(id).is_none_or(|n| n.live) {
                    break;
                }
                let gone = st.forget_shard(id, shard);
                self.publish(gone);
                if shard + 1 == SHARDS {
                    if let Some(n) = st.node_mut(id) {
                        n.copies = 0;
                    }
                }
            }
        }
        dead.len()
    }

    pub fn nodes(&self) -> NodeList {
        let st = self.state.lock();
        let now = Instant::now();
        let nodes = st
            .nodes
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
        let st = self.state.lock();
        (st.nodes.iter().filter(|n| n.live).count(), st.nodes.iter().map(|n| n.copies).sum())
    }

    /// Where each key of `tenant` is: live holders, DRAM copies first.
    pub fn route(&self, tenant: &str, keys: &[Vec<u8>]) -> Routes {
        let st = self.state.lock();
        let t = st.tenants.get(tenant).copied();
        let items = keys.iter().map(|k| st.holders(t, k)).collect();
        st.routes(items)
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
        let mut st = self.state.lock();
        let t = st.tenants.get(tenant).copied();
        let mut nodes = NodeSet::default();
        for (i, n) in st.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            nodes.push(i as u64 + 1, [0, n.free(Tier::Dram), n.free(Tier::Ssd)], n.load());
        }
        if nodes.is_empty() {
            return Routes { nodes: Vec::new(), items: vec![Vec::new(); items.len()] };
        }
        let mut batch = place_batch(&st, t, items, replicas);
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
}

/// The placement question: blocks in request order, a parent in the same batch named by its
/// position, a parent already in the pool by the node that holds it.
fn place_batch(st: &State, tenant: Option<u32>, items: &[PutItem], replicas: u32) -> PlaceBatch {
    let mut b = PlaceBatch { replicas: replicas.max(1), ..PlaceBatch::default() };
    let mut pos: HashMap<&[u8], u64> = HashMap::new();
    for (i, it) in items.iter().enumerate() {
        let id = i as u64 + 1;
        let (parent, parent_node) = match it.parent.as_deref() {
            None => (NO_PARENT, NO_NODE),
            Some(p) => match pos.get(p) {
                Some(&pid) => (pid, NO_NODE),
                None => (NO_PARENT, st.holders(tenant, p).first().map_or(NO_NODE, |&n| u64::from(n))),
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_proto::PinSpec;

    fn master(timeout: Duration) -> Master {
        let ids = std::sync::Mutex::new(HashMap::<String, u32>::new());
        let resolve = move |name: &str| {
            let mut ids = ids.lock().unwrap();
            let n = ids.len() as u32;
            *ids.entry(name.to_string()).or_insert(n)
        };
        Master::new(100, timeout, Box::new(resolve), None)
    }

    fn join(m: &Master, name: &str, dram: u64) -> u32 {
        m.join(NodeJoinRequest {
            name: name.into(),
            addr: format!("{name}:1"),
            server_name: "localhost".into(),
            fingerprint: vec![0; 32],
            incarnation: 7,
            tiers: vec![TierUse { tier: 1, capacity: dram, used: 0 }],
        })
        .node
    }

    fn stored(key: &str, tier: u8) -> NodeBlock {
        NodeBlock {
            kind: KvEventKind::Stored,
            tier,
            tenant: "t".into(),
            key: key.as_bytes().to_vec(),
            parent: None,
            size: 10,
        }
    }

    fn report(m: &Master, node: u32, reset: bool, blocks: Vec<NodeBlock>) -> Result<(), ReportError> {
        let tiers = vec![TierUse { tier: 1, capacity: 10_000, used: 0 }];
        m.report(NodeReportRequest { node, incarnation: 7, reset, tiers, blocks })
    }

    fn item(key: &str, parent: Option<&str>) -> PutItem {
        PutItem {
            key: key.into(),
            size: 100,
            parent: parent.map(|p| p.as_bytes().to_vec()),
            tokens: 16,
            seq_tokens: 0,
            pin: PinSpec::None,
        }
    }

    #[test]
    fn reports_route_and_death_forgets() {
        let m = master(Duration::from_millis(300));
        let (a, b) = (join(&m, "a", 1000), join(&m, "b", 1000));
        report(&m, a, true, vec![stored("k1", 1), stored("k2", 2)]).unwrap();
        report(&m, b, true, vec![stored("k1", 2)]).unwrap();
        let r = m.route("t", &[b"k1".to_vec(), b"k2".to_vec(), b"k3".to_vec()]);
        // DRAM holders first.
        assert_eq!(r.items, vec![vec![a, b], vec![a], vec![]]);
        assert_eq!(r.nodes.len(), 2);
        // Another tenant sees nothing.
        assert_eq!(m.route("u", &[b"k1".to_vec()]).items, vec![Vec::<u32>::new()]);
        // An eviction of the only tier drops the node's copy.
        report(&m, a, false, vec![NodeBlock { kind: KvEventKind::Evicted, ..stored("k1", 1) }]).unwrap();
        assert_eq!(m.route("t", &[b"k1".to_vec()]).items, vec![vec![b]]);
        // Silence kills; a dead node's reports are refused until it joins again.
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(m.sweep(later), 2);
        assert!(m.route("t", &[b"k2".to_vec()]).items[0].is_empty());
        assert_eq!(report(&m, a, false, vec![]), Err(ReportError::Unknown(a)));
        assert_eq!(join(&m, "a", 1000), a, "a node keeps its id across joins");
        assert_eq!(
            m.report(NodeReportRequest { node: a, incarnation: 8, reset: true, tiers: vec![], blocks: vec![] }),
            Err(ReportError::Stale(a))
        );
        report(&m, a, true, vec![stored("k2", 2)]).unwrap();
        assert_eq!(m.route("t", &[b"k2".to_vec()]).items, vec![vec![a]]);
        let list = m.nodes();
        assert_eq!(list.nodes.iter().map(|n| (n.live, n.copies)).collect::<Vec<_>>(), vec![(true, 1), (false, 0)]);
    }

    #[test]
    fn placement_keeps_chains_spreads_replicas_and_checks_the_policy() {
        let m = master(Duration::from_secs(3));
        let (a, b, c) = (join(&m, "a", 10_000), join(&m, "b", 10_000), join(&m, "c", 10_000));
        report(&m, b, true, vec![stored("root", 1)]).unwrap();
        // A chain continues where its parent is, and stays together within the batch.
        let items = vec![item("x1", Some("root")), item("x2", Some("x1"))];
        let r = m.place("t", &items, 1, None, |_, _| None);
        assert_eq!(r.items, vec![vec![b], vec![b]]);
        // Replicas land on distinct nodes.
        let r = m.place("t", &[item("y", None)], 3, None, |_, _| None);
        let mut got = r.items[0].clone();
        got.sort_unstable();
        assert_eq!(got, vec![a, b, c]);
        // A policy that names a node that does not exist is overruled.
        let r = m.place("t", &[item("z", None)], 1, None, |_, _| Some(Placements { node: vec![99], tier: vec![1] }));
        assert!(r.items[0].len() == 1 && r.items[0][0] != 99);
        // A valid answer is followed.
        let r = m.place("t", &[item("z", None)], 1, None, |_, _| {
            Some(Placements { node: vec![u64::from(c)], tier: vec![1] })
        });
        assert_eq!(r.items, vec![vec![c]]);
        // With no live node nothing is placed.
        m.sweep(Instant::now() + Duration::from_secs(10));
        assert_eq!(m.place("t", &[item("w", None)], 1, None, |_, _| None).items, vec![Vec::<u32>::new()]);
    }

    #[test]
    fn an_engines_blocks_go_to_the_node_at_its_address() {
        let m = master(Duration::from_secs(3));
        let at = |name: &str, addr: &str| {
            m.join(NodeJoinRequest {
                name: name.into(),
                addr: addr.into(),
                server_name: "localhost".into(),
                fingerprint: vec![0; 32],
                incarnation: 7,
                tiers: vec![TierUse { tier: 1, capacity: 10_000, used: 0 }],
            })
            .node
        };
        let (_a, b) = (at("a", "10.0.0.1:7100"), at("b", "10.0.0.2:7100"));
        let mut seen = None;
        let r = m.place("t", &[item("k", None)], 1, Some("10.0.0.2".parse().unwrap()), |batch, _| {
            seen = Some(batch.client_node);
            None
        });
        assert_eq!(seen, Some(u64::from(b)), "the policy is told the client's node");
        assert_eq!(r.items, vec![vec![b]], "the default placement puts it there");
        // An address no node has, or that two nodes share, names none.
        let _c = at("c", "10.0.0.2:7200");
        for ip in ["10.0.0.9", "10.0.0.2"] {
            let mut seen = None;
            m.place("t", &[item("k2", None)], 1, Some(ip.parse().unwrap()), |batch, _| {
                seen = Some(batch.client_node);
                None
            });
            assert_eq!(seen, Some(NO_NODE), "{ip}");
        }
    }
}
