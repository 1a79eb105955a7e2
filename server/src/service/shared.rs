//! What every request handler shares: the store, authentication, limits, the policy engine,
//! the same-host data path, the KV event log, and the server's role in a cluster.

use super::shm::DataPath;
use super::stream::Timeouts;
use crate::auth::Auth;
use crate::metrics::Metrics;
use crate::store::Store;
use kvpool_proto::Limits;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What this server is in a cluster.
pub enum Role {
    /// A node that holds blocks: alone, or as a cluster's storage node (whose link to the
    /// master runs beside the service).
    Node,
    /// A cluster master: it holds no blocks; it knows where they are (`cluster.role = "master"`).
    Master(Arc<crate::cluster::Master>),
}

impl Role {
    /// The master's view of the cluster, on a master.
    pub fn master(&self) -> Option<&Arc<crate::cluster::Master>> {
        match self {
            Role::Master(m) => Some(m),
            Role::Node => None,
        }
    }
}

/// Everything a request handler may use, shared by every connection.
pub struct Shared {
    pub store: Arc<Store>,
    pub auth: Arc<Auth>,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    pub timeouts: Timeouts,
    pub server_name: String,
    pub started: Instant,
    pub max_connections: u32,
    pub policies: Arc<crate::policy::PolicyManager>,
    pub max_module_size: u64,
    pub paths: parking_lot::Mutex<PathTally>,
    /// The copy engine and shm socket for same-host clients (version 2).
    pub data_path: Option<DataPath>,
    /// The KV event log subscriptions read (`None`: events are off).
    pub events: Option<Arc<crate::events::EventLog>>,
    /// This node's name, as KV events give it.
    pub node: String,
    pub role: Role,
    /// The TCP bulk channel, once the server listens (`bulk.tcp`).
    pub bulk: std::sync::OnceLock<super::bulk::door::BulkDoor>,
}

impl Shared {
    /// How long a grant or a lease of `bytes` stays valid.
    pub(super) fn hold_for(&self, bytes: u64) -> Duration {
        self.timeouts.transfer(bytes)
    }

    /// The Prometheus text of `/metrics`, with gauges brought up to date.
    pub fn render_metrics(&self) -> String {
        self.store.update_gauges();
        if let Some(m) = self.role.master() {
            let nodes = m.nodes().nodes;
            let live = nodes.iter().filter(|n| n.live).count() as i64;
            self.metrics.cluster_nodes.with_label_values(&["live"]).set(live);
            self.metrics.cluster_nodes.with_label_values(&["dead"]).set(nodes.len() as i64 - live);
            for n in &nodes {
                self.metrics.cluster_node_copies.with_label_values(&[&n.name]).set(n.copies as i64);
                for t in &n.tiers {
                    let tier = match t.tier {
                        0 => "device",
                        1 => "dram",
                        _ => "ssd",
                    };
                    let g = &self.metrics.cluster_node_bytes;
                    g.with_label_values(&[&n.name, tier, "used"]).set(t.used as i64);
                    g.with_label_values(&[&n.name, tier, "capacity"]).set(t.capacity as i64);
                }
            }
        }
        self.policies.export_metrics(&self.metrics);
        let (t, mtu) = self.paths.lock().totals();
        self.metrics.set_path_stats(&t, mtu);
        self.metrics.set_udp_stats(&kvpool_net::udp_stats());
        self.metrics.render()
    }
}

/// QUIC path statistics of every connection, live and closed, for `/metrics`.
#[derive(Default)]
pub struct PathTally {
    pub(super) live: std::collections::HashMap<u64, quinn::Connection>,
    pub(super) next: u64,
    pub(super) closed: kvpool_net::PathReport,
}

impl PathTally {
    /// Totals over all connections so far, and the (min, max) path MTU of the live ones.
    pub fn totals(&self) -> (kvpool_net::PathReport, Option<(u16, u16)>) {
        let mut t = self.closed;
        let mut mtu: Option<(u16, u16)> = None;
        for c in self.live.values() {
            let r = kvpool_net::PathReport::of(c);
            t.add_counters(&r);
            mtu = Some(mtu.map_or((r.mtu, r.mtu), |(lo, hi)| (lo.min(r.mtu), hi.max(r.mtu))));
        }
        (t, mtu)
    }
}
