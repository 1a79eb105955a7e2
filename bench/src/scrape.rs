//! A server's own latency histograms, read from its Prometheus endpoint: the server-side time of
//! an op between two moments (the difference of two scrapes), as the server's `stats` estimates
//! quantiles (linear interpolation inside the bucket that holds the quantile).

/// Cumulative bucket counts of one op's latency histogram: (upper bound in seconds, count).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Buckets(pub(crate) Vec<(f64, u64)>);

/// The value of gauge `name` with label `kind="{kind}"` in a `/metrics` text.
pub(crate) fn kind_gauge(text: &str, name: &str, kind: &str) -> Option<f64> {
    let want = format!("{name}{{kind=\"{kind}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(want.as_str())).and_then(|v| v.trim().parse().ok())
}

/// `kvpool_op_duration_seconds` buckets of `op` from a `/metrics` text.
pub(crate) fn op_buckets(text: &str, op: &str) -> Buckets {
    let want = format!("op=\"{op}\"");
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("kvpool_op_duration_seconds_bucket{") else { continue };
        let Some((labels, value)) = rest.split_once("} ") else { continue };
        if !labels.split(',').any(|l| l == want) {
            continue;
        }
        let Some(le) = labels.split(',').find_map(|l| l.strip_prefix("le=\"")).map(|l| l.trim_end_matches('"')) else {
            continue;
        };
        let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
        if let (false, Ok(n)) = (bound.is_nan(), value.trim().parse::<u64>()) {
            out.push((bound, n));
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    Buckets(out)
}

impl Buckets {
    /// What was observed after `earlier` (a scrape of the same histogram before this one).
    pub(crate) fn since(&self, earlier: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(b, n)| {
                    let before = earlier.0.iter().find(|e| e.0 == b).map_or(0, |e| e.1);
                    (b, n.saturating_sub(before))
                })
                .collect(),
        )
    }

    pub(crate) fn count(&self) -> u64 {
        self.0.last().map_or(0, |b| b.1)
    }

    /// The `q` quantile in µs, interpolated inside its bucket as the server's `stats` does (the
    /// last finite bound when it falls in the +Inf bucket); `None` without samples.
    pub(crate) fn quantile_us(&self, q: f64) -> Option<f64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        let rank = q * count as f64;
        let (mut prev_bound, mut prev_count) = (0.0, 0u64);
        for &(bound, cum) in &self.0 {
            if cum as f64 >= rank {
                if bound.is_infinite() {
                    return Some(prev_bound * 1e6);
                }
                let in_bucket = (cum - prev_count) as f64;
                let frac = if in_bucket > 0.0 { (rank - prev_count as f64) / in_bucket } else { 1.0 };
                return Some((prev_bound + (bound - prev_bound) * frac.clamp(0.0, 1.0)) * 1e6);
            }
            (prev_bound, prev_count) = (bound, cum);
        }
        Some(prev_bound * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP kvpool_op_duration_seconds x\n\
        kvpool_op_duration_seconds_bucket{op=\"get\",le=\"0.00001\"} 7\n\
        kvpool_op_duration_seconds_bucket{op=\"lookup\",le=\"0.00001\"} 10\n\
        kvpool_op_duration_seconds_bucket{op=\"lookup\",le=\"0.00002\"} 90\n\
        kvpool_op_duration_seconds_bucket{op=\"lookup\",le=\"0.00004\"} 100\n\
        kvpool_op_duration_seconds_bucket{op=\"lookup\",le=\"+Inf\"} 100\n\
        kvpool_op_duration_seconds_sum{op=\"lookup\"} 0.002\n";

    #[test]
    fn buckets_parse_subtract_and_interpolate() {
        let b = op_buckets(TEXT, "lookup");
        assert_eq!(b.0.len(), 4);
        assert_eq!(b.count(), 100);
        // Rank 50 lies 40/80 of the way through the 10-20 µs bucket; rank 99 9/10 through 20-40.
        assert!((b.quantile_us(0.5).unwrap() - 15.0).abs() < 1e-9);
        assert!((b.quantile_us(0.99).unwrap() - 38.0).abs() < 1e-9);
        let earlier = Buckets(vec![(0.00001, 10), (0.00002, 10), (0.00004, 10), (f64::INFINITY, 10)]);
        let d = b.since(&earlier);
        assert_eq!(d.count(), 90);
        // The 80 new samples below 20 µs put the median of 90 in the 10-20 µs bucket.
        assert!((d.quantile_us(0.5).unwrap() - (10.0 + 10.0 * 45.0 / 80.0)).abs() < 1e-9);
        assert_eq!(op_buckets(TEXT, "put").quantile_us(0.5), None);
        let over = Buckets(vec![(0.00001, 0), (f64::INFINITY, 5)]);
        assert_eq!(over.quantile_us(0.99), Some(10.0));
        let heap = "kvpool_heap_bytes{kind=\"active\"} 10\nkvpool_heap_bytes{kind=\"allocated\"} 7\n";
        assert_eq!(kind_gauge(heap, "kvpool_heap_bytes", "allocated"), Some(7.0));
        assert_eq!(kind_gauge(heap, "kvpool_heap_bytes", "resident"), None);
    }
}
