//! Prometheus metrics, served as text on `/metrics` and summarised by the `stats` request.

use prometheus::{
    exponential_buckets, Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Every request's name, from the request table: each gets its latency and error series.
pub const OPS: [&str; kvpool_proto::REQUESTS.len()] = kvpool_proto::REQUEST_NAMES;

/// The process heap as its allocator counts it, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes the program holds.
    pub allocated: u64,
    /// Bytes in pages that hold allocations (allocated plus fragmentation inside them).
    pub active: u64,
    /// Bytes of the allocator's pages that are resident (its metadata and dirty free pages too).
    pub resident: u64,
    /// Address space kept mapped but returned to the OS (not resident).
    pub retained: u64,
}

/// Reads [`HeapStats`] from the global allocator; the binary that picks the allocator installs
/// it ([`set_heap_probe`]), the library cannot know which one it runs on.
pub type HeapProbe = fn() -> Option<HeapStats>;

static HEAP_PROBE: std::sync::OnceLock<HeapProbe> = std::sync::OnceLock::new();

/// Install the heap probe `/metrics` reads (once per process; later calls are ignored).
pub fn set_heap_probe(probe: HeapProbe) {
    let _ = HEAP_PROBE.set(probe);
}

pub struct Metrics {
    pub registry: Registry,
    pub hits: IntCounterVec,
    pub misses: IntCounterVec,
    pub bytes_used: IntGaugeVec,
    pub capacity: IntGaugeVec,
    pub blocks: IntGaugeVec,
    pub evictions: IntCounterVec,
    /// Blocks removed by the chain rule (descendants of a victim that lost its last copy).
    pub evictions_cascaded: IntCounter,
    /// Victims kept by the chain rule (a descendant was leased, in flight or hard-pinned).
    pub evictions_refused: IntCounter,
    pub demotions: IntCounter,
    pub promotions: IntCounter,
    pub rejected_puts: IntCounterVec,
    pub corrupt: IntCounter,
    pub op_seconds: HistogramVec,
    pub op_errors: IntCounterVec,
    /// Request-level errors answered, by error code name.
    pub errors: IntCounterVec,
    /// Requests abandoned by the client (stream reset, connection lost): not errors.
    pub cancelled: IntCounterVec,
    /// Per-tenant request latency for tenant-scoped `stats`; not exported (tenant labels would
    /// multiply every series), hence not registered.
    pub tenant_op_seconds: HistogramVec,
    pub tenant_op_errors: IntCounterVec,
    /// QUIC path counters over every connection (server side), by counter.
    pub quic_path: IntCounterVec,
    /// Current path MTU of live connections: `min` and `max`.
    pub quic_mtu: IntGaugeVec,
    /// The UDP socket's calls and datagrams each way (`kvpool_udp_*_total`), in the order of
    /// [`udp_series`].
    pub udp: Vec<IntCounter>,
    pub connections: IntGauge,
    /// The process heap as its allocator reports it (`kvpool_heap_bytes{kind}`), when the
    /// binary installed a [`HeapProbe`].
    pub heap: IntGaugeVec,
    /// Requests answered on the same-host control socket, and control sockets refused.
    pub local_requests: IntCounter,
    pub local_refused: IntCounter,
    /// Requests answered on TCP bulk connections, and bulk connections refused.
    pub bulk_requests: IntCounter,
    pub bulk_refused: IntCounter,
    /// TCP bulk connections bound to a session (clients keep theirs for the next request).
    pub bulk_bound: IntCounter,
    /// KV events logged, by kind; subscriptions open; events subscribers missed.
    pub events: IntCounterVec,
    pub event_subscribers: IntGauge,
    /// Put items admitted and neither committed nor given up yet (each holds its block's id).
    pub put_plans: IntGauge,
    /// Value bytes moved, and the time one request took to move them, by transport (`quic`,
    /// `local`: in band on the same-host control socket, `shm`: copied to or from a client's
    /// shared buffers) and direction (`in`: into the pool, `out`: to the client).
    pub transfer_bytes: IntCounterVec,
    pub transfer_seconds: HistogramVec,
    pub events_lagged: IntCounter,
    pub auth_failures: IntCounter,
    pub lookup_blocks: IntCounterVec,
    /// Master: storage nodes by state (live, dead).
    pub cluster_nodes: IntGaugeVec,
    /// Master: per storage node, copies it reported and bytes used per tier.
    pub cluster_node_copies: IntGaugeVec,
    pub cluster_node_bytes: IntGaugeVec,
    /// Storage: joins to the master, and reports sent.
    pub cluster_joins: IntCounter,
    pub cluster_reports: IntCounter,
    /// Storage: DRAM victims moved into another node's free DRAM instead of SSD, by outcome.
    pub cluster_offloads: IntCounterVec,
    pub policy_faults: IntGaugeVec,
    pub policy_quarantined: IntGaugeVec,
}

fn counter_vec(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition");
    reg.register(Box::new(c.clone())).expect("unique metric name");
    c
}

fn gauge_vec(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric definition");
    reg.register(Box::new(g.clone())).expect("unique metric name");
    g
}

fn counter(reg: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("static metric definition");
    reg.register(Box::new(c.clone())).expect("unique metric name");
    c
}

impl Metrics {
    /// Count one request's value bytes moved over `transport` in `direction`.
    pub fn transferred(&self, transport: &str, direction: &str, bytes: u64, took: std::time::Duration) {
        if bytes == 0 {
            return;
        }
        self.transfer_bytes.with_label_values(&[transport, direction]).inc_by(bytes);
        self.transfer_seconds.with_label_values(&[transport, direction]).observe(took.as_secs_f64());
    }

    pub fn new() -> Metrics {
        let reg = Registry::new_custom(Some("kvpool".into()), None).expect("valid prefix");
        let op_seconds = HistogramVec::new(
            HistogramOpts::new(
                "op_duration_seconds",
                "Request latency by operation, from header read to last byte written",
            )
            .buckets(exponential_buckets(10e-6, 1.5, 36).expect("valid buckets")),
            &["op"],
        )
        .expect("static metric definition");
        reg.register(Box::new(op_seconds.clone())).expect("unique metric name");
        let tenant_op_seconds = HistogramVec::new(
            HistogramOpts::new("tenant_op_duration_seconds", "Request latency by tenant and operation")
                .buckets(exponential_buckets(10e-6, 1.5, 36).expect("valid buckets")),
            &["tenant", "op"],
        )
        .expect("static metric definition");
        let tenant_op_errors = IntCounterVec::new(
            Opts::new("tenant_op_errors_total", "Requests answered with an error"),
            &["tenant", "op"],
        )
        .expect("static metric definition");
        let transfer_seconds = HistogramVec::new(
            HistogramOpts::new(
                "transfer_seconds",
                "Time one request took to move its value bytes, by transport and direction",
            )
            .buckets(exponential_buckets(10e-6, 1.5, 36).expect("valid buckets")),
            &["transport", "direction"],
        )
        .expect("static metric definition");
        reg.register(Box::new(transfer_seconds.clone())).expect("unique metric name");
        let connections = IntGauge::new("connections", "Open client connections").expect("static metric");
        reg.register(Box::new(connections.clone())).expect("unique metric name");
        let m = Metrics {
            hits: counter_vec(&reg, "hits_total", "Block reads served, by tier", &["tier"]),
            misses: counter_vec(
                &reg,
                "misses_total",
                "Block reads not served by a tier (fell through or missing)",
                &["tier"],
            ),
            bytes_used: gauge_vec(&reg, "bytes_used", "Bytes allocated, by tier", &["tier"]),
            capacity: gauge_vec(&reg, "capacity_bytes", "Capacity, by tier", &["tier"]),
            blocks: gauge_vec(&reg, "blocks", "Block copies resident, by tier", &["tier"]),
            evictions: counter_vec(&reg, "evictions_total", "Block copies evicted from a tier", &["tier"]),
            evictions_cascaded: counter(
                &reg,
                "evictions_cascaded_total",
                "Blocks evicted by the chain rule along with an ancestor that lost its last copy",
            ),
            evictions_refused: counter(
                &reg,
                "evictions_refused_total",
                "Victims kept by the chain rule (a descendant was leased, in flight or hard-pinned)",
            ),
            demotions: counter(&reg, "demotions_total", "Blocks copied DRAM -> SSD on eviction"),
            promotions: counter(&reg, "promotions_total", "Blocks copied SSD -> DRAM on a hit"),
            rejected_puts: counter_vec(&reg, "rejected_puts_total", "Put items not stored, by reason", &["reason"]),
            corrupt: counter(&reg, "corrupt_blocks_total", "Blocks dropped because their checksum failed"),
            op_errors: counter_vec(&reg, "op_errors_total", "Requests answered with an error, by operation", &["op"]),
            errors: counter_vec(&reg, "errors_total", "Request-level errors answered, by error code", &["code"]),
            cancelled: counter_vec(
                &reg,
                "requests_cancelled_total",
                "Requests the client abandoned (stream reset or connection lost), by operation",
                &["op"],
            ),
            tenant_op_seconds,
            tenant_op_errors,
            quic_path: counter_vec(
                &reg,
                "quic_path_total",
                "QUIC path events over all client connections (server side): sent_packets, lost_packets, \
                 lost_bytes, congestion_events, black_holes",
                &["counter"],
            ),
            quic_mtu: gauge_vec(&reg, "quic_path_mtu_bytes", "Path MTU of live client connections", &["stat"]),
            udp: udp_series(&kvpool_net::UdpStats::default())
                .into_iter()
                .map(|(name, help, _)| counter(&reg, name, help))
                .collect(),
            auth_failures: counter(&reg, "auth_failures_total", "Hellos refused"),
            events: counter_vec(&reg, "events_total", "KV events logged for subscribers, by kind", &["kind"]),
            transfer_bytes: counter_vec(
                &reg,
                "transfer_bytes_total",
                "Value bytes moved, by transport (quic, local, shm) and direction (in, out)",
                &["transport", "direction"],
            ),
            transfer_seconds,
            event_subscribers: {
                let g = IntGauge::new("event_subscribers", "KV event subscriptions open").expect("static metric");
                reg.register(Box::new(g.clone())).expect("unique metric name");
                g
            },
            put_plans: {
                let g = IntGauge::new("put_plans", "Put items admitted whose bytes are not committed yet")
                    .expect("static metric");
                reg.register(Box::new(g.clone())).expect("unique metric name");
                g
            },
            events_lagged: counter(
                &reg,
                "events_lagged_total",
                "KV events dropped before a subscriber read them (it fell behind the buffer)",
            ),
            local_requests: counter(&reg, "local_requests_total", "Requests answered on the same-host control socket"),
            local_refused: counter(
                &reg,
                "local_refused_total",
                "Control socket connections refused (user, token, socket limit, or too many waiting for a token)",
            ),
            bulk_requests: counter(&reg, "bulk_requests_total", "Requests answered on TCP bulk connections"),
            bulk_bound: counter(&reg, "bulk_connections_total", "TCP bulk connections bound to a QUIC session"),
            bulk_refused: counter(
                &reg,
                "bulk_refused_total",
                "TCP bulk connections refused (TLS handshake or ALPN, token, address, plaintext, or connection limits)",
            ),
            lookup_blocks: counter_vec(
                &reg,
                "lookup_blocks_total",
                "Blocks asked about by lookup, by result",
                &["result"],
            ),
            cluster_nodes: gauge_vec(&reg, "cluster_nodes", "Master: storage nodes, by state (live, dead)", &["state"]),
            cluster_node_copies: gauge_vec(
                &reg,
                "cluster_node_copies",
                "Master: block copies a storage node reported holding",
                &["node"],
            ),
            cluster_node_bytes: gauge_vec(
                &reg,
                "cluster_node_bytes",
                "Master: a storage node's tier use as reported (stat = used, capacity)",
                &["node", "tier", "stat"],
            ),
            cluster_joins: counter(
                &reg,
                "cluster_joins_total",
                "Storage: joins to the master (each re-announces the inventory)",
            ),
            cluster_reports: counter(&reg, "cluster_reports_total", "Storage: reports sent to the master"),
            cluster_offloads: counter_vec(
                &reg,
                "cluster_offloads_total",
                "Storage: DRAM victims offered to another node's free DRAM before SSD, by outcome (moved, kept)",
                &["outcome"],
            ),
            policy_faults: gauge_vec(
                &reg,
                "policy_faults",
                "Faults of the active policy module (answered by the native fallback)",
                &["kind", "module", "fault"],
            ),
            policy_quarantined: gauge_vec(
                &reg,
                "policy_quarantined",
                "1 when the active policy module is quarantined",
                &["kind", "module"],
            ),
            heap: gauge_vec(
                &reg,
                "heap_bytes",
                "Process heap as the allocator counts it (kind = allocated, active, resident, retained)",
                &["kind"],
            ),
            op_seconds,
            connections,
            registry: reg,
        };
        for op in OPS {
            m.op_seconds.with_label_values(&[op]);
            m.op_errors.with_label_values(&[op]);
        }
        for t in ["dram", "ssd"] {
            m.hits.with_label_values(&[t]);
            m.misses.with_label_values(&[t]);
            m.evictions.with_label_values(&[t]);
        }
        m
    }

    pub fn render(&self) -> String {
        if let Some(heap) = HEAP_PROBE.get().and_then(|probe| probe()) {
            for (kind, v) in [
                ("allocated", heap.allocated),
                ("active", heap.active),
                ("resident", heap.resident),
                ("retained", heap.retained),
            ] {
                self.heap.with_label_values(&[kind]).set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    /// (count, p50 s, p99 s, mean s) of an op's latency, estimated from the histogram buckets
    /// by linear interpolation inside the bucket that holds the quantile.
    pub fn op_summary(&self, op: &str) -> (u64, f64, f64, f64) {
        summary(&self.op_seconds.with_label_values(&[op]))
    }

    /// Bring the QUIC path series up to `totals` (counters only ever grow: closed connections
    /// keep their share in the totals).
    pub fn set_path_stats(&self, totals: &kvpool_net::PathReport, mtu: Option<(u16, u16)>) {
        for (name, v) in [
            ("sent_packets", totals.sent_packets),
            ("lost_packets", totals.lost_packets),
            ("lost_bytes", totals.lost_bytes),
            ("congestion_events", totals.congestion_events),
            ("black_holes", totals.black_holes),
        ] {
            let c = self.quic_path.with_label_values(&[name]);
            c.inc_by(v.saturating_sub(c.get()));
        }
        let (lo, hi) = mtu.unwrap_or((0, 0));
        self.quic_mtu.with_label_values(&["min"]).set(lo.into());
        self.quic_mtu.with_label_values(&["max"]).set(hi.into());
    }

    /// Bring the UDP series up to `s` (this process's counters only grow).
    pub fn set_udp_stats(&self, s: &kvpool_net::UdpStats) {
        for (c, (_, _, v)) in self.udp.iter().zip(udp_series(s)) {
            c.inc_by(v.saturating_sub(c.get()));
        }
    }

    /// As [`Metrics::op_summary`], for one tenant's requests only.
    pub fn tenant_op_summary(&self, tenant: &str, op: &str) -> (u64, f64, f64, f64) {
        summary(&self.tenant_op_seconds.with_label_values(&[tenant, op]))
    }
}

/// Name, help and value of each UDP series. Datagrams per received message is GRO's batch:
/// `udp_recv_datagrams_total / udp_recv_messages_total`.
fn udp_series(s: &kvpool_net::UdpStats) -> [(&'static str, &'static str, u64); 7] {
    [
        ("udp_recv_calls_total", "UDP receive calls (recvmmsg) that returned data", s.recv_calls),
        ("udp_recv_messages_total", "UDP messages received (one recvmsg each; a GRO batch)", s.recv_messages),
        ("udp_recv_datagrams_total", "UDP datagrams (QUIC packets) in the messages received", s.recv_datagrams),
        ("udp_recv_bytes_total", "UDP payload bytes received", s.recv_bytes),
        ("udp_send_calls_total", "UDP send calls (sendmsg) the kernel took", s.send_calls),
        ("udp_send_datagrams_total", "UDP datagrams in those sends (several per call with GSO)", s.send_datagrams),
        ("udp_send_bytes_total", "UDP payload bytes sent", s.send_bytes),
    ]
}

fn summary(h: &prometheus::Histogram) -> (u64, f64, f64, f64) {
    let count = h.get_sample_count();
    if count == 0 {
        return (0, 0.0, 0.0, 0.0);
    }
    let mf = prometheus::core::Collector::collect(h);
    let Some(proto) = mf.first().and_then(|f| f.get_metric().first()) else {
        return (count, 0.0, 0.0, 0.0);
    };
    let hist = proto.get_histogram();
    let buckets: Vec<(f64, u64)> =
        hist.get_bucket().iter().map(|b| (b.get_upper_bound(), b.get_cumulative_count())).collect();
    let q = |quantile: f64| {
        let rank = quantile * count as f64;
        let mut prev_bound = 0.0;
        let mut prev_count = 0u64;
        for &(bound, cum) in &buckets {
            if cum as f64 >= rank {
                let in_bucket = (cum - prev_count) as f64;
                let frac = if in_bucket > 0.0 { (rank - prev_count as f64) / in_bucket } else { 1.0 };
                return prev_bound + (bound - prev_bound) * frac.clamp(0.0, 1.0);
            }
            prev_bound = bound;
            prev_count = cum;
        }
        prev_bound
    };
    (count, q(0.5), q(0.99), h.get_sample_sum() / count as f64)
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
