//! What each command does against one server (a cluster's master answers `events`, `nodes` and
//! `ping` the same way), and the reports that a cluster's block commands share.

mod cluster;

pub(crate) use cluster::{cluster_command, cluster_policy, cluster_stats};

use crate::args::{Cli, Cmd, PinArg, PolicyCmd};
use crate::io::{display_key, out, parse_key, parse_keys, read_value, write_value};
use crate::render::{render_nodes, render_policies, render_stats};
use crate::{Failure, Outcome};
use kvpool_client::proto::EventScope;
use kvpool_client::{Client, ErrorCode, PinSpec, PutOptions, SubscribeOptions};
use std::time::Duration;

pub(crate) async fn command(cli: &Cli, client: &Client) -> Outcome {
    let hex = cli.hex;
    match &cli.cmd {
        Cmd::Put { key, file, parent, tokens, seq_tokens, pin, pin_ttl_ms, upsert } => {
            let key = parse_key(key, hex)?;
            let value = read_value(file.as_deref(), client.limits().max_value_size)?;
            let opts = PutOptions {
                parent: parent.as_deref().map(|p| parse_key(p, hex)).transpose()?,
                tokens: *tokens,
                seq_tokens: *seq_tokens,
                pin: pin_spec(*pin, *pin_ttl_ms),
            };
            if *upsert {
                client.upsert_with(&key, &value, opts).await?;
            } else {
                client.put_with(&key, &value, opts).await?;
            }
        }
        Cmd::Get { key, output } => {
            let k = parse_key(key, hex)?;
            let Some(value) = client.get(&k).await? else {
                return Err(Failure { exit: 3, line: format!("{}: key {key}", ErrorCode::NotFound) });
            };
            write_value(output.as_deref(), &value)?;
        }
        Cmd::Lookup { keys } => {
            let chain = parse_keys(keys, hex)?;
            out(format_args!("{}\n", client.lookup(&chain).await?))?;
        }
        Cmd::Exists { keys } => {
            let ks = parse_keys(keys, hex)?;
            report_exists(&ks, &client.exists(&ks).await?, hex)?;
        }
        Cmd::Rm { keys, all: true, force } => {
            debug_assert!(keys.is_empty());
            let r = client.remove_all(*force).await?;
            out(format_args!("removed {} blocks, kept {} leased\n", r.removed, r.skipped))?;
        }
        Cmd::Rm { keys, all: false, force } => {
            let ks = parse_keys(keys, hex)?;
            report_removed(&ks, &client.remove_batch(&ks, *force).await?, hex)?;
        }
        Cmd::Events { from, log_id, all, count, idle_ms } => {
            let scope = if *all { EventScope::All } else { EventScope::Tenant };
            let opts = SubscribeOptions { from: *from, scope, max_batch: 0, log_id: *log_id };
            let mut sub = client.subscribe(opts).await?;
            let idle = idle_ms.map(Duration::from_millis).unwrap_or(Duration::MAX);
            let (mut seen, mut last_seq) = (0u64, None);
            while count.is_none_or(|c| seen < c) {
                let Some(b) = sub.next_within(idle).await? else { break };
                if b.lagged > 0 {
                    let line = serde_json::json!({ "lagged": b.lagged, "next": b.next, "log_id": format!("{:016x}", b.log_id) });
                    out(format_args!("{line}\n"))?;
                }
                for e in b.events.iter().take(count.map_or(usize::MAX, |c| (c - seen) as usize)) {
                    last_seq = Some(e.seq);
                    let line = serde_json::json!({
                        "seq": e.seq,
                        "kind": format!("{:?}", e.kind).to_lowercase(),
                        "tier": match e.tier { 0 => "device", 1 => "dram", 2 => "ssd", _ => "unknown" },
                        "node": e.node,
                        "tenant": e.tenant,
                        "key": display_key(&e.key, hex),
                        "parent": e.parent.as_deref().map(|p| display_key(p, hex)),
                        "size": e.size,
                        "time_ms": e.time_ms,
                    });
                    out(format_args!("{line}\n"))?;
                    seen += 1;
                }
            }
            // Resume after the last event printed (not past events of a batch cut by --count).
            let next = last_seq.map_or(sub.resume_from(), |s| s + 1);
            let line = serde_json::json!({ "next": next, "log_id": format!("{:016x}", sub.log_id()) });
            out(format_args!("{line}\n"))?;
        }
        Cmd::Nodes { json } => {
            let nodes = client.nodes().await?;
            if *json {
                let text = serde_json::to_string_pretty(&nodes).map_err(|e| Failure::io(e.to_string()))?;
                out(format_args!("{text}\n"))?;
            } else {
                out(format_args!("{}", render_nodes(&nodes)))?;
            }
        }
        Cmd::Stats { json } => {
            let s = client.stats().await?;
            if *json {
                out(format_args!("{}\n", serde_json::to_string_pretty(&s).map_err(|e| Failure::io(e.to_string()))?))?;
            } else {
                out(format_args!("{}", render_stats(&s, &client.tenant())))?;
            }
        }
        Cmd::Policy { cmd: PolicyCmd::Load { kind, file, name, params } } => {
            let wasm = std::fs::read(file).map_err(|e| Failure::io(format!("{}: {e}", file.display())))?;
            let name = name.clone().unwrap_or_else(|| {
                file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into())
            });
            let info = client.policy_load((*kind).into(), &name, params, &wasm).await?;
            out(format_args!("{}", render_policies(std::slice::from_ref(&info))))?;
        }
        Cmd::Policy { cmd: PolicyCmd::List { json } } => {
            let list = client.policy_list().await?;
            if *json {
                let text = serde_json::to_string_pretty(&list).map_err(|e| Failure::io(e.to_string()))?;
                out(format_args!("{text}\n"))?;
            } else {
                out(format_args!("{}", render_policies(&list)))?;
            }
        }
        Cmd::Policy { cmd: PolicyCmd::Rollback { kind } } => {
            let info = client.policy_rollback((*kind).into()).await?;
            out(format_args!("{}", render_policies(std::slice::from_ref(&info))))?;
        }
        Cmd::Ping { count } => {
            let mut times = Vec::new();
            for i in 0..(*count).max(1) {
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let rtt = client.ping().await?;
                out(format_args!("pong from {}: time={:.3} ms\n", client.config().server, rtt.as_secs_f64() * 1e3))?;
                times.push(rtt.as_secs_f64() * 1e3);
            }
            if times.len() > 1 {
                let min = times.iter().cloned().fold(f64::INFINITY, f64::min);
                let max = times.iter().cloned().fold(0.0, f64::max);
                let avg = times.iter().sum::<f64>() / times.len() as f64;
                out(format_args!("{} pings: min/avg/max = {min:.3}/{avg:.3}/{max:.3} ms\n", times.len()))?;
            }
        }
    }
    Ok(())
}

pub(crate) fn pin_spec(pin: PinArg, ttl_ms: u64) -> PinSpec {
    match pin {
        PinArg::None => PinSpec::None,
        PinArg::Soft => PinSpec::Soft { ttl_ms },
        PinArg::Hard => PinSpec::Hard,
    }
}

/// One line per key; exit 3 when any is absent.
pub(crate) fn report_exists(ks: &[Vec<u8>], present: &[bool], hex: bool) -> Outcome {
    for (k, p) in ks.iter().zip(present) {
        out(format_args!("{}\t{}\n", display_key(k, hex), if *p { "yes" } else { "no" }))?;
    }
    if present.iter().any(|p| !p) {
        return Err(Failure {
            exit: 3,
            line: format!(
                "{}: {} of {} keys absent",
                ErrorCode::NotFound,
                present.iter().filter(|p| !**p).count(),
                present.len()
            ),
        });
    }
    Ok(())
}

/// Exit 3 when only missing keys were not removed, 1 for any other refusal.
pub(crate) fn report_removed(ks: &[Vec<u8>], st: &[ErrorCode], hex: bool) -> Outcome {
    let failed: Vec<(String, ErrorCode)> =
        ks.iter().zip(st).filter(|(_, c)| **c != ErrorCode::Ok).map(|(k, c)| (display_key(k, hex), *c)).collect();
    if let Some((_, code)) = failed.first() {
        let names: Vec<String> = failed.iter().map(|(k, c)| format!("{k} ({c})")).collect();
        return Err(Failure {
            exit: if failed.iter().all(|(_, c)| *c == ErrorCode::NotFound) { 3 } else { 1 },
            line: format!("{code}: {} of {} keys not removed: {}", failed.len(), ks.len(), names.join(", ")),
        });
    }
    Ok(())
}
