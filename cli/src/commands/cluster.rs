//! The commands on a cluster: block commands through the master to the storage nodes, and
//! statistics and policy administration of every place.

use super::{pin_spec, report_exists, report_removed};
use crate::args::{Cli, Cmd, PolicyCmd};
use crate::io::{display_key, out, parse_key, parse_keys, read_value, write_value};
use crate::render::{render_policies, render_stats};
use crate::{Failure, Outcome};
use kvpool_client::proto::PolicyInfo;
use kvpool_client::{ClientError, ClusterClient, ErrorCode, PutEntry, PutMode, PutOptions};

/// The block commands on a cluster: through the master to the storage nodes.
pub(crate) async fn cluster_command(cli: &Cli, cc: &ClusterClient) -> Outcome {
    let hex = cli.hex;
    match &cli.cmd {
        Cmd::Put { key, file, parent, tokens, seq_tokens, pin, pin_ttl_ms, upsert } => {
            let key = parse_key(key, hex)?;
            let value = read_value(file.as_deref(), cc.master().limits().max_value_size)?;
            let opts = PutOptions {
                parent: parent.as_deref().map(|p| parse_key(p, hex)).transpose()?,
                tokens: *tokens,
                seq_tokens: *seq_tokens,
                pin: pin_spec(*pin, *pin_ttl_ms),
            };
            let mode = if *upsert { PutMode::Upsert } else { PutMode::Insert };
            let entry = PutEntry { key: &key, value: &value, opts };
            match cc.put_batch(std::slice::from_ref(&entry), mode, cli.replicas).await?[0] {
                ErrorCode::Ok => {}
                code => {
                    return Err(Failure { exit: 1, line: format!("{code}: put of key {}", display_key(&key, hex)) })
                }
            }
        }
        Cmd::Get { key, output } => {
            let Some(value) = cc.get(parse_key(key, hex)?).await? else {
                return Err(Failure { exit: 3, line: format!("{}: key {key}", ErrorCode::NotFound) });
            };
            write_value(output.as_deref(), &value)?;
        }
        Cmd::Lookup { keys } => out(format_args!("{}\n", cc.lookup(&parse_keys(keys, hex)?).await?))?,
        Cmd::Exists { keys } => {
            let ks = parse_keys(keys, hex)?;
            report_exists(&ks, &cc.exists(&ks).await?, hex)?;
        }
        Cmd::Rm { keys, force, .. } => {
            let ks = parse_keys(keys, hex)?;
            report_removed(&ks, &cc.remove_batch(&ks, *force).await?, hex)?;
        }
        _ => unreachable!("only block commands come here"),
    }
    Ok(())
}

/// Statistics of every live storage node, one block each (as JSON: a map by node name).
pub(crate) async fn cluster_stats(json: bool, cc: &ClusterClient) -> Outcome {
    let per_node = cc.stats().await?;
    if json {
        let map: serde_json::Map<String, serde_json::Value> = per_node
            .iter()
            .map(|(n, r)| {
                let v = match r {
                    Ok(s) => serde_json::to_value(s).unwrap_or_default(),
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                };
                (n.clone(), v)
            })
            .collect();
        let text = serde_json::to_string_pretty(&map).map_err(|e| Failure::io(e.to_string()))?;
        return out(format_args!("{text}\n"));
    }
    let tenant = cc.master().tenant();
    for (n, r) in &per_node {
        match r {
            Ok(s) => out(format_args!("== {n}\n{}", render_stats(s, &tenant)))?,
            Err(e) => out(format_args!("== {n}\n{e}\n"))?,
        }
    }
    if per_node.is_empty() {
        out(format_args!("(no live storage node)\n"))?;
    }
    Ok(())
}

/// Policy administration of a cluster: placement on the master, eviction and admission on
/// every live storage node; one block of output per place, and exit 1 if any place failed.
pub(crate) async fn cluster_policy(cmd: &PolicyCmd, cc: &ClusterClient) -> Outcome {
    let per_place: Vec<(String, Result<Vec<PolicyInfo>, ClientError>)> = match cmd {
        PolicyCmd::Load { kind, file, name, params } => {
            let wasm = std::fs::read(file).map_err(|e| Failure::io(format!("{}: {e}", file.display())))?;
            let name = name.clone().unwrap_or_else(|| {
                file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into())
            });
            cc.policy_load((*kind).into(), &name, params, &wasm)
                .await?
                .into_iter()
                .map(|(n, r)| (n, r.map(|i| vec![i])))
                .collect()
        }
        PolicyCmd::Rollback { kind } => {
            cc.policy_rollback((*kind).into()).await?.into_iter().map(|(n, r)| (n, r.map(|i| vec![i]))).collect()
        }
        PolicyCmd::List { .. } => cc.policy_list().await?,
    };
    let mut failed = Vec::new();
    for (place, r) in &per_place {
        match r {
            Ok(list) => out(format_args!("== {place}\n{}", render_policies(list)))?,
            Err(e) => {
                out(format_args!("== {place}\n{e}\n"))?;
                failed.push(format!("{place}: {e}"));
            }
        }
    }
    if per_place.is_empty() {
        return Err(Failure { exit: 1, line: "no live storage node to load the module on".into() });
    }
    if !failed.is_empty() {
        return Err(Failure {
            exit: 1,
            line: format!("{} of {} places failed: {}", failed.len(), per_place.len(), failed.join("; ")),
        });
    }
    Ok(())
}
