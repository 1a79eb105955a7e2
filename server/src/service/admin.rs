//! Requests about the server rather than blocks: `Stats`, `Ping`, and the policy
//! administration (`PolicyLoad`, `PolicyList`, `PolicyRollback`; admin keys only).

use super::shared::Shared;
use super::stream::{error, expect_end, read_exact_by, Fail, RequestRecv};
use crate::auth::Principal;
use kvpool_proto::{
    ErrorCode, OpStats, Ping, PolicyLoadRequest, PolicyRollbackRequest, Pong, Response, StatsReport, TierStats,
};
use tokio::time::Instant as Deadline;

/// `stats`: pool-wide for admin keys; for other keys, the caller's tenant only.
pub(super) fn stats(s: &Shared, p: &Principal) -> StatsReport {
    let m = &s.metrics;
    s.store.update_gauges();
    let usage = s.store.tier_usage();
    let ops_for = |summary: &dyn Fn(&str) -> (u64, f64, f64, f64), errors: &dyn Fn(&str) -> u64| {
        crate::metrics::OPS
            .iter()
            .map(|op| {
                let (count, p50, p99, mean) = summary(op);
                OpStats {
                    op: op.to_string(),
                    count,
                    errors: errors(op),
                    p50_us: p50 * 1e6,
                    p99_us: p99 * 1e6,
                    mean_us: mean * 1e6,
                }
            })
            .collect::<Vec<_>>()
    };
    if p.admin {
        let (blocks, dram_blocks, ssd_blocks) = s.store.counts();
        let tiers = usage
            .into_iter()
            .map(|(tier, cap, used)| {
                let name = tier.name();
                TierStats {
                    tier: name.into(),
                    capacity_bytes: cap,
                    used_bytes: used,
                    blocks: if name == "dram" { dram_blocks } else { ssd_blocks },
                    hits: m.hits.with_label_values(&[name]).get(),
                    misses: m.misses.with_label_values(&[name]).get(),
                    evictions: m.evictions.with_label_values(&[name]).get(),
                }
            })
            .collect();
        return StatsReport {
            server: s.server_name.clone(),
            uptime_s: s.started.elapsed().as_secs(),
            blocks,
            tiers,
            demotions: m.demotions.get(),
            promotions: m.promotions.get(),
            rejected_puts: m.rejected_puts.with_label_values(&["admission"]).get()
                + m.rejected_puts.with_label_values(&["no_space"]).get(),
            corrupt_blocks: m.corrupt.get(),
            ops: ops_for(&|op| m.op_summary(op), &|op| m.op_errors.with_label_values(&[op]).get()),
        };
    }
    let c = s.store.tenant_counters(p.tenant_id);
    let tiers = usage
        .into_iter()
        .map(|(tier, cap, _)| {
            let i = usize::from(tier == kvpool_policy_sdk::Tier::Ssd);
            TierStats {
                tier: tier.name().into(),
                capacity_bytes: cap,
                used_bytes: c.bytes[i],
                blocks: c.blocks[i],
                hits: c.hits[i],
                misses: c.misses[i],
                evictions: c.evictions[i],
            }
        })
        .collect();
    StatsReport {
        server: s.server_name.clone(),
        uptime_s: s.started.elapsed().as_secs(),
        blocks: c.resident,
        tiers,
        demotions: c.demotions,
        promotions: c.promotions,
        rejected_puts: c.rejected,
        corrupt_blocks: c.corrupt,
        ops: ops_for(&|op| m.tenant_op_summary(&p.tenant, op), &|op| {
            m.tenant_op_errors.with_label_values(&[&p.tenant, op]).get()
        }),
    }
}

pub(super) fn ping(ping: Ping) -> Response {
    Response::Pong(Pong {
        nonce: ping.nonce,
        server_time_us: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0),
    })
}

/// Load a policy module: its bytes follow the frame (the caller checked the key is an admin's).
pub(super) async fn policy_load<R: RequestRecv>(
    l: PolicyLoadRequest,
    recv: &mut R,
    s: &Shared,
) -> Result<Response, Fail> {
    if l.module_size > s.max_module_size {
        return Err(Fail::Reply(error(
            ErrorCode::ValueTooLarge,
            format!("module of {} bytes; the limit is {}", l.module_size, s.max_module_size),
        )));
    }
    let by = Deadline::now() + s.timeouts.transfer(l.module_size);
    let mut wasm = vec![0u8; l.module_size as usize];
    read_exact_by(recv, &mut wasm, by, "the declared module bytes").await?;
    expect_end(recv, by).await?;
    match s.policies.load(l.kind, &l.name, l.params, wasm).await {
        Ok(info) => Ok(Response::Policy(info)),
        Err(e) => Err(Fail::Reply(error(ErrorCode::PolicyError, e.to_string()))),
    }
}

pub(super) async fn policy_rollback(r: PolicyRollbackRequest, s: &Shared) -> Result<Response, Fail> {
    match s.policies.rollback(r.kind).await {
        Ok(info) => Ok(Response::Policy(info)),
        Err(crate::policy::PolicyError::NothingToRollBack(kind)) => Err(Fail::Reply(error(
            ErrorCode::NotFound,
            format!("no {kind} module is loaded (the built-in is active): nothing to roll back"),
        ))),
        Err(e) => Err(Fail::Reply(error(ErrorCode::PolicyError, e.to_string()))),
    }
}
