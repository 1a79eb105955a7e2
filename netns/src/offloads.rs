//! The offloads of the veths: what a server NIC has on by default, or the veth as the kernel
//! makes it ("bare"), set with `ethtool -K` and read back with `ethtool -k`.
//!
//! A veth is made with segmentation offload on (TSO, GSO, UDP GSO) and receive offload off
//! (GRO). A NIC does GRO too. On a veth, GRO runs only through the receiving end's NAPI, which
//! the kernel uses when GRO is on there, and, when the sending end does TSO (as here), only
//! for packets of a local socket and with `rx-udp-gro-forwarding` (or `rx-gro-list`) on at the
//! receiving end (`veth_skb_is_eligible_for_gro` in `drivers/net/veth.c`). So both are set on
//! both ends of every pair; `rx-udp-gro-forwarding` also lets the bridge's ports aggregate UDP
//! flows they forward between hosts.

use crate::NetnsError;
use std::process::Command;

/// Features set on, in `ethtool -K` names, for the offloads a server NIC has.
const NIC: [&str; 5] = ["gro", "gso", "tso", "tx-udp-segmentation", "rx-udp-gro-forwarding"];
/// A bare veth: the kernel's defaults (segmentation offload on, receive offload off).
const BARE: [(&str, &str); 5] =
    [("gro", "off"), ("rx-udp-gro-forwarding", "off"), ("gso", "on"), ("tso", "on"), ("tx-udp-segmentation", "on")];
/// What is reported, as `ethtool -k` names them (its long names for `gro`, `gso`, `tso`).
pub const REPORTED: [&str; 5] = [
    "generic-receive-offload",
    "rx-udp-gro-forwarding",
    "generic-segmentation-offload",
    "tcp-segmentation-offload",
    "tx-udp-segmentation",
];

/// `ethtool` at `prefix` (a host's namespace; empty: the root's).
pub(crate) fn ethtool(prefix: &[String], args: &[&str]) -> Result<String, NetnsError> {
    if ethtool_missing() {
        return Err(NetnsError::NoEthtool);
    }
    let out = crate::command_at(prefix, "ethtool")
        .args(args)
        .output()
        .map_err(|source| NetnsError::Spawn { program: "ethtool".into(), source })?;
    if !out.status.success() {
        return Err(NetnsError::Command {
            command: format!("ethtool {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `ethtool` can be run here.
pub fn ethtool_missing() -> bool {
    matches!(Command::new("ethtool").arg("--version").output(), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

/// Set a NIC's offloads (`nic`) or a bare veth's on `dev`.
pub(crate) fn set(prefix: &[String], dev: &str, nic: bool) -> Result<(), NetnsError> {
    let mut args = vec!["-K", dev];
    if nic {
        for f in NIC {
            args.extend([f, "on"]);
        }
    } else {
        for (f, v) in BARE {
            args.extend([f, v]);
        }
    }
    ethtool(prefix, &args).map(drop)
}

/// The [`REPORTED`] features of `dev`, as `ethtool -k` reads them back.
pub(crate) fn read(prefix: &[String], dev: &str) -> Result<Vec<(String, bool)>, NetnsError> {
    Ok(parse(&ethtool(prefix, &["-k", dev])?))
}

/// The [`REPORTED`] lines of `ethtool -k`'s output ("name: on", "name: off [fixed]").
fn parse(text: &str) -> Vec<(String, bool)> {
    REPORTED
        .iter()
        .filter_map(|name| {
            text.lines().find_map(|l| {
                let (k, v) = l.trim().split_once(':')?;
                (k == *name).then(|| (k.to_string(), v.trim().starts_with("on")))
            })
        })
        .collect()
}

/// The offloads of every veth end of a set of hosts, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offloads {
    /// Whether the harness set a NIC's offloads (`false`: bare veths).
    pub nic: bool,
    /// Per feature of [`REPORTED`]: on at every veth end, off at every one, or mixed.
    pub features: Vec<(String, Feature)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    On,
    Off,
    Mixed,
}

impl Feature {
    pub fn as_str(self) -> &'static str {
        match self {
            Feature::On => "on",
            Feature::Off => "off",
            Feature::Mixed => "mixed",
        }
    }
}

impl Offloads {
    /// Fold the features read from each veth end into one state per feature.
    pub(crate) fn fold(nic: bool, ends: &[Vec<(String, bool)>]) -> Offloads {
        let features = REPORTED
            .iter()
            .map(|name| {
                let vals: Vec<bool> =
                    ends.iter().filter_map(|e| e.iter().find(|(k, _)| k == name).map(|(_, v)| *v)).collect();
                let state = if !vals.is_empty() && vals.iter().all(|v| *v) {
                    Feature::On
                } else if vals.iter().all(|v| !*v) {
                    Feature::Off
                } else {
                    Feature::Mixed
                };
                (name.to_string(), state)
            })
            .collect();
        Offloads { nic, features }
    }

    /// The state of a feature, by its `ethtool -k` name.
    pub fn get(&self, name: &str) -> Option<Feature> {
        self.features.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
    }
}

impl std::fmt::Display for Offloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.nic { "a NIC's offloads: " } else { "bare veths: " })?;
        let parts: Vec<String> = self.features.iter().map(|(k, v)| format!("{} {}", short(k), v.as_str())).collect();
        f.write_str(&parts.join(", "))
    }
}

/// `gro`, `gso`, `tso` for their long names.
fn short(name: &str) -> &str {
    match name {
        "generic-receive-offload" => "gro",
        "generic-segmentation-offload" => "gso",
        "tcp-segmentation-offload" => "tso",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ethtool_k_output_is_read_and_folded() {
        let text = "Features for eth0:\nrx-checksumming: on\ngeneric-segmentation-offload: on\n\
                    generic-receive-offload: off\ntcp-segmentation-offload: on\n\ttx-tcp-segmentation: on\n\
                    tx-udp-segmentation: on\nrx-gro-hw: off [fixed]\nrx-udp-gro-forwarding: off\n";
        let end = parse(text);
        assert_eq!(end.len(), REPORTED.len());
        assert!(end.contains(&("generic-receive-offload".into(), false)));
        assert!(end.contains(&("tx-udp-segmentation".into(), true)));
        let mut other = end.clone();
        other.iter_mut().for_each(|(k, v)| *v = *v || k == "generic-receive-offload");
        let o = Offloads::fold(false, &[end.clone(), other]);
        assert_eq!(o.get("generic-receive-offload"), Some(Feature::Mixed));
        assert_eq!(o.get("rx-udp-gro-forwarding"), Some(Feature::Off));
        assert_eq!(o.get("tcp-segmentation-offload"), Some(Feature::On));
        assert_eq!(
            o.to_string(),
            "bare veths: gro mixed, rx-udp-gro-forwarding off, gso on, tso on, tx-udp-segmentation on"
        );
        assert_eq!(
            Offloads::fold(true, &[]).get("generic-receive-offload"),
            Some(Feature::Off),
            "nothing read: not on"
        );
    }
}
