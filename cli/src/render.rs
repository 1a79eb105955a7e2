//! The tables printed for a person: statistics, storage nodes, policy modules.

use bytesize::ByteSize;
use kvpool_client::proto::PolicyInfo;
use kvpool_client::StatsReport;

pub(crate) fn render_policies(list: &[PolicyInfo]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<10} {:<18} {:<11} {:<12} {:>10} {:>9} {:>7} {:>9}  params",
        "kind", "name", "state", "sha256", "answered", "fallback", "faults", "swap"
    );
    for p in list {
        let state = if p.quarantined {
            "quarantined"
        } else if p.active {
            "active"
        } else {
            "-"
        };
        let sha = if p.builtin { "built-in".to_string() } else { p.sha256.chars().take(12).collect() };
        let params: Vec<String> = p.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            o,
            "{:<10} {:<18} {:<11} {:<12} {:>10} {:>9} {:>7} {:>9}  {}",
            p.kind.name(),
            p.name,
            state,
            sha,
            p.answered,
            p.fallback_answers,
            p.faults_trap + p.faults_timeout + p.faults_invalid,
            micros(p.swap_us as f64),
            params.join(" ")
        );
    }
    o
}

pub(crate) fn pct(n: u64, d: u64) -> String {
    if d == 0 {
        "-".into()
    } else {
        format!("{:.1}%", n as f64 * 100.0 / d as f64)
    }
}

pub(crate) fn micros(us: f64) -> String {
    if us >= 1e6 {
        format!("{:.2} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{us:.0} us")
    }
}

pub(crate) fn uptime(s: u64) -> String {
    let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h}h {m}m")
    } else if h > 0 {
        format!("{h}h {m}m {sec}s")
    } else {
        format!("{m}m {sec}s")
    }
}

/// The report for a person: sizes, hit rates, latency percentiles.
pub(crate) fn render_nodes(nodes: &[kvpool_client::proto::NodeInfo]) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<5} {:<20} {:<22} {:<5} {:>9} {:>8}  tiers (used / capacity)",
        "node", "name", "address", "state", "silent", "copies"
    );
    for n in nodes {
        let tiers: Vec<String> = n
            .tiers
            .iter()
            .map(|t| {
                let name = match t.tier {
                    0 => "device",
                    1 => "dram",
                    2 => "ssd",
                    _ => "?",
                };
                format!("{name} {} / {}", ByteSize(t.used).to_string_as(true), ByteSize(t.capacity).to_string_as(true))
            })
            .collect();
        let _ = writeln!(
            o,
            "{:<5} {:<20} {:<22} {:<5} {:>7}ms {:>8}  {}",
            n.node,
            n.name,
            n.addr,
            if n.live { "live" } else { "dead" },
            n.silent_ms,
            n.copies,
            tiers.join(", ")
        );
    }
    if nodes.is_empty() {
        o.push_str("(no storage node has joined)\n");
    }
    o
}

pub(crate) fn render_stats(s: &StatsReport, tenant: &str) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "server     {}  (up {}, tenant {tenant})", s.server, uptime(s.uptime_s));
    // Tier hit/miss counters fall through: a read missing the first tier is counted again below,
    // so the first tier's hits + misses is the number of block reads.
    let reads = s.tiers.first().map(|t| t.hits + t.misses).unwrap_or(0);
    let hits: u64 = s.tiers.iter().map(|t| t.hits).sum();
    let _ = writeln!(o, "blocks     {}", s.blocks);
    let _ = writeln!(o, "hit rate   {} ({hits} of {reads} reads)", pct(hits, reads));
    let _ = writeln!(
        o,
        "moves      {} demotions, {} promotions; {} rejected puts, {} corrupt blocks",
        s.demotions, s.promotions, s.rejected_puts, s.corrupt_blocks
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<6} {:>11} {:>11} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "tier", "used", "capacity", "used%", "blocks", "hits", "misses", "hit%", "evicted"
    );
    for t in &s.tiers {
        let _ = writeln!(
            o,
            "{:<6} {:>11} {:>11} {:>6} {:>9} {:>9} {:>9} {:>8} {:>9}",
            t.tier,
            ByteSize(t.used_bytes).to_string_as(true),
            ByteSize(t.capacity_bytes).to_string_as(true),
            pct(t.used_bytes, t.capacity_bytes),
            t.blocks,
            t.hits,
            t.misses,
            pct(t.hits, t.hits + t.misses),
            t.evictions
        );
    }
    if !s.ops.is_empty() {
        let _ = writeln!(o);
        let _ = writeln!(o, "{:<10} {:>10} {:>8} {:>10} {:>10} {:>10}", "op", "count", "errors", "p50", "p99", "mean");
        for op in &s.ops {
            let _ = writeln!(
                o,
                "{:<10} {:>10} {:>8} {:>10} {:>10} {:>10}",
                op.op,
                op.count,
                op.errors,
                micros(op.p50_us),
                micros(op.p99_us),
                micros(op.mean_us)
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_render() {
        let s = StatsReport {
            server: "kvpool-server 0.1.0".into(),
            uptime_s: 3725,
            blocks: 3,
            tiers: vec![
                kvpool_client::TierStats {
                    tier: "dram".into(),
                    capacity_bytes: 1 << 30,
                    used_bytes: 3 << 20,
                    blocks: 3,
                    hits: 3,
                    misses: 1,
                    evictions: 0,
                },
                kvpool_client::TierStats {
                    tier: "ssd".into(),
                    capacity_bytes: 0,
                    used_bytes: 0,
                    blocks: 0,
                    hits: 0,
                    misses: 1,
                    evictions: 0,
                },
            ],
            demotions: 0,
            promotions: 0,
            rejected_puts: 0,
            corrupt_blocks: 0,
            ops: vec![kvpool_client::OpStats {
                op: "get".into(),
                count: 4,
                errors: 0,
                p50_us: 120.0,
                p99_us: 2500.0,
                mean_us: 300.0,
            }],
        };
        let text = render_stats(&s, "default");
        assert!(text.contains("75.0%"), "{text}");
        assert!(text.contains("1.0 GiB"), "{text}");
        assert!(text.contains("2.50 ms"), "{text}");
        assert!(text.contains("1h 2m 5s"), "{text}");
    }
}
