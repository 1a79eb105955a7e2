//! The request service: hello/auth on a connection's first stream, then one request per stream.
//!
//! A request is exactly one frame, the value bytes it declares (put, policy load), then the end of
//! the stream. Every wait on the client has a deadline ([`Timeouts`]): a stalled or slow client
//! is answered `timeout`, its stream is stopped, and everything the request held (DRAM
//! reservations, leased blocks) is released when the handler returns. A client that resets its
//! stream or loses its connection cancels the request quietly.
//!
//! By file: [`stream`] (stream traits, deadlines, `Fail`), `quic` (the QUIC front door),
//! [`local`] (the Unix-socket front door), `dispatch` (the one request table), then one file per
//! verb: `put` (with the value sources in `source`), `get`, `attach`, `admin`, `cluster`,
//! `connector`, `subscribe`. `docs/SERVER-MAP.md` walks the routes.

use crate::auth::Auth;
use crate::metrics::Metrics;
use crate::store::Store;
use kvpool_proto::Limits;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod admin;
mod attach;
mod cluster;
mod connector;
mod dispatch;
mod get;
pub mod local;
pub mod memory;
mod put;
mod quic;
mod session;
mod shm;
mod source;
pub mod stream;
mod subscribe;
#[cfg(test)]
mod tests;

pub use dispatch::handle_stream;
pub use quic::{serve, PathTally, QuicServerConfigs};
pub use session::Session;
pub use shm::DataPath;
pub use stream::{BoxFuture, RequestRecv, RequestSend, Timeouts};

/// What this server is in a cluster.
pub enum Role {
    /// A node that holds blocks: alone, or as a cluster's storage node (whose link to the
    /// master runs beside the service, `crate::cluster::storage`).
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
}

impl Shared {
    /// How long a grant or a lease of `bytes` stays valid.
    fn hold_for(&self, bytes: u64) -> Duration {
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
        self.metrics.render()
    }
}
