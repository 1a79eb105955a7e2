//! Hosts as network namespaces on one machine: a bridge in the root namespace, one namespace
//! per host joined to it by a veth pair, every host on one /24. The root namespace is a host
//! too (the bridge's address), where the caller itself runs.
//!
//! Traffic between hosts crosses the veth pairs and the bridge at the link's MTU (and, when set,
//! a `tbf` rate), as between machines: no 64 KB loopback datagrams, no loopback shortcuts. The
//! filesystem is shared, so data directories work as on one host. Needs root and iproute2;
//! everything made is deleted on drop. The same layout as `python/tests/netns.py`.
//!
//! Every veth gets the offloads a server NIC has on by default (GRO, GSO, TSO, UDP GSO, UDP
//! GRO forwarding; set with `ethtool`, see [`offloads`]), unless bare veths are asked for
//! ([`Hosts::bare_veths`], or `KVPOOL_NETNS_BARE=1`): the veth as the kernel makes it.

pub mod offloads;

pub use offloads::{Feature, Offloads};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespaces are not available here: {0}")]
    Unavailable(String),
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("running `{program}`: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("no host {0}")]
    NoHost(usize),
    #[error(
        "ethtool is not installed: the hosts' veths get a NIC's offloads with it (Debian/Ubuntu: \
         `apt-get install ethtool`), or ask for bare veths (KVPOOL_NETNS_BARE=1)"
    )]
    NoEthtool,
}

/// Whether `KVPOOL_NETNS_BARE=1` asks for bare veths.
pub fn bare_from_env() -> bool {
    std::env::var("KVPOOL_NETNS_BARE").as_deref() == Ok("1")
}

/// `None` when namespaces can be made here, else why not.
pub fn unavailable() -> Option<String> {
    match Command::new("ip").args(["netns", "list"]).output() {
        Err(e) => Some(format!("no iproute2 (`ip`): {e}")),
        Ok(o) if !o.status.success() => Some(format!("`ip netns list`: {}", String::from_utf8_lossy(&o.stderr).trim())),
        // Making one is the only sure test of the privilege.
        Ok(_) => {
            // Unique per call: tests in one process probe at the same time.
            static PROBES: AtomicU32 = AtomicU32::new(0);
            let probe = format!("kvpprobe{}-{}", std::process::id(), PROBES.fetch_add(1, Ordering::Relaxed));
            match ip(&["netns", "add", &probe]) {
                Ok(()) => {
                    let _ = ip(&["netns", "del", &probe]);
                    None
                }
                Err(e) => Some(e.to_string()),
            }
        }
    }
}

fn ip(args: &[&str]) -> Result<(), NetnsError> {
    run("ip", args)
}

fn tc(args: &[&str]) -> Result<(), NetnsError> {
    run("tc", args)
}

fn run(program: &str, args: &[&str]) -> Result<(), NetnsError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| NetnsError::Spawn { program: program.into(), source })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetnsError::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// `program` behind an argv `prefix` (from [`Hosts::prefix`]; empty: run here).
pub fn command_at(prefix: &[String], program: impl AsRef<std::ffi::OsStr>) -> Command {
    match prefix.split_first() {
        None => Command::new(program),
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(program);
            c
        }
    }
}

/// `n` hosts, numbered 1..=n, at [`Hosts::ip`]; the root namespace at [`Hosts::root_ip`].
pub struct Hosts {
    bridge: String,
    /// Root-namespace ends of the veth pairs, by host.
    veths: Vec<String>,
    names: Vec<String>,
    net: String,
    mtu: u32,
    /// Whether the veths have a NIC's offloads (else they are bare).
    nic: bool,
}

impl Hosts {
    /// Build `n` hosts on a bridge at link MTU `mtu`, their veths with a NIC's offloads (bare
    /// with `KVPOOL_NETNS_BARE=1`).
    pub fn new(n: usize, mtu: u32) -> Result<Hosts, NetnsError> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Interface names are at most 15 bytes; the tag keeps concurrent processes apart.
        let tag = format!("{}{}", pid % 100_000, seq % 100);
        let net = format!("10.{}.{}", 200 + (pid % 50), (pid / 50 + seq) % 250 + 1);
        let mut h = Hosts { bridge: format!("kvb{tag}"), veths: Vec::new(), names: Vec::new(), net, mtu, nic: false };
        // On error, drop deletes what was made so far.
        let m = mtu.to_string();
        ip(&["link", "add", &h.bridge, "type", "bridge"])?;
        ip(&["link", "set", &h.bridge, "mtu", &m, "up"])?;
        ip(&["addr", "add", &format!("{}/24", h.root_ip()), "dev", &h.bridge])?;
        for i in 1..=n {
            let ns = format!("kvh{tag}-{i}");
            ip(&["netns", "add", &ns])?;
            h.names.push(ns.clone());
            let veth = format!("kv{tag}v{i}");
            ip(&["link", "add", &veth, "mtu", &m, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            h.veths.push(veth.clone());
            ip(&["link", "set", &veth, "master", &h.bridge, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", h.ip(i)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "mtu", &m, "up"])?;
        }
        if !bare_from_env() {
            h.set_offloads(true)?;
        }
        tracing::debug!(bridge = %h.bridge, hosts = n, mtu, nic = h.nic, "hosts up");
        Ok(h)
    }

    /// These hosts with bare veths (`true`: as the kernel makes them) or a NIC's offloads.
    pub fn bare_veths(mut self, bare: bool) -> Result<Hosts, NetnsError> {
        self.set_offloads(!bare)?;
        Ok(self)
    }

    /// Give every veth end a NIC's offloads (`true`) or a bare veth's (`false`).
    pub fn set_offloads(&mut self, nic: bool) -> Result<(), NetnsError> {
        for (prefix, dev) in self.veth_ends() {
            offloads::set(&prefix, &dev, nic)?;
        }
        self.nic = nic;
        Ok(())
    }

    /// The offloads of the veths, as `ethtool -k` reads them back.
    pub fn offloads(&self) -> Result<Offloads, NetnsError> {
        let ends = self.veth_ends().iter().map(|(p, d)| offloads::read(p, d)).collect::<Result<Vec<_>, _>>()?;
        Ok(Offloads::fold(self.nic, &ends))
    }

    /// Every veth end: (the argv prefix of its namespace, its name).
    fn veth_ends(&self) -> Vec<(Vec<String>, String)> {
        let mut ends = Vec::new();
        for (i, veth) in self.veths.iter().enumerate() {
            ends.push((Vec::new(), veth.clone()));
            ends.push((vec!["ip".into(), "netns".into(), "exec".into(), self.names[i].clone()], "eth0".into()));
        }
        ends
    }

    /// Host `i`'s address.
    pub fn ip(&self, i: usize) -> String {
        format!("{}.{i}", self.net)
    }

    /// The root namespace's address on the bridge (where the caller runs).
    pub fn root_ip(&self) -> String {
        format!("{}.254", self.net)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    fn ns(&self, i: usize) -> Result<&str, NetnsError> {
        i.checked_sub(1).and_then(|j| self.names.get(j)).map(String::as_str).ok_or(NetnsError::NoHost(i))
    }

    /// `program` to be run on host `i` (`ip netns exec`, which execs it: the child's pid is the
    /// program's own).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Command, NetnsError> {
        Ok(command_at(&self.prefix(i)?, program))
    }

    /// The argv prefix that runs a command on host `i`.
    pub fn prefix(&self, i: usize) -> Result<Vec<String>, NetnsError> {
        Ok(vec!["ip".into(), "netns".into(), "exec".into(), self.ns(i)?.to_string()])
    }

    /// Change every link's MTU (the bridge, both ends of every veth). Connections opened after
    /// this see the new MTU; open ones keep what they discovered until it fails.
    pub fn set_mtu(&mut self, mtu: u32) -> Result<(), NetnsError> {
        let m = mtu.to_string();
        // A bridge takes the smallest MTU of its ports: raise the ports first.
        for (i, veth) in self.veths.iter().enumerate() {
            ip(&["link", "set", veth, "mtu", &m])?;
            ip(&["-n", &self.names[i], "link", "set", "eth0", "mtu", &m])?;
        }
        ip(&["link", "set", &self.bridge, "mtu", &m])?;
        self.mtu = mtu;
        Ok(())
    }

    /// Plug or unplug host `i`'s cable (its end of the veth pair).
    pub fn link(&self, i: usize, up: bool) -> Result<(), NetnsError> {
        ip(&["-n", self.ns(i)?, "link", "set", "eth0", if up { "up" } else { "down" }])
    }

    /// Limit what host `i` sends to `rate` bits per second (a `tbf` on its end of the link), or
    /// lift the limit with `None`.
    pub fn rate(&self, i: usize, rate: Option<u64>) -> Result<(), NetnsError> {
        let ns = self.ns(i)?;
        let _ = tc(&["-n", ns, "qdisc", "del", "dev", "eth0", "root"]);
        if let Some(bits) = rate {
            // A burst of at least one jumbo frame and 1 ms at the rate; 50 ms of queue.
            let burst = (bits / 8 / 1000).max(u64::from(self.mtu) + 100).max(16_384).to_string();
            let r = format!("{bits}bit");
            tc(&[
                "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &r, "burst", &burst, "latency", "50ms",
            ])?;
        }
        Ok(())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.names {
            // Deleting the namespace deletes its veth end and so the pair.
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram of `len` bytes, never fragmented, from host `from` to `to`: whether it arrived.
    /// (No `ping` on these machines; python3 is.)
    fn datagram(h: &Hosts, from: usize, to: usize, len: usize) -> bool {
        let recv = "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind((sys.argv[1],47001))\ns.settimeout(2)\nprint('ready',flush=True)\ntry:\n print(len(s.recv(65536)))\nexcept OSError:\n print(0)";
        let send = "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.setsockopt(socket.IPPROTO_IP,10,2)\ntry:\n s.sendto(b'x'*int(sys.argv[2]),(sys.argv[1],47001))\nexcept OSError as e:\n print(e)";
        let mut r = h.command(to, "python3").unwrap();
        let mut r = r.args(["-c", recv, &h.ip(to)]).stdout(std::process::Stdio::piped()).spawn().unwrap();
        let mut out = std::io::BufReader::new(r.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        let mut s = h.command(from, "python3").unwrap();
        s.args(["-c", send, &h.ip(to), &len.to_string()]).status().unwrap();
        line.clear();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        r.wait().unwrap();
        line.trim() == len.to_string()
    }

    /// Why hosts cannot be made here (no namespaces, or no ethtool for the offloads), which
    /// is an error where `KVPOOL_REQUIRE_PEERS=1`.
    fn skip() -> Option<String> {
        let why = unavailable().or_else(|| offloads::ethtool_missing().then(|| NetnsError::NoEthtool.to_string()))?;
        assert!(
            std::env::var("KVPOOL_REQUIRE_PEERS").as_deref() != Ok("1"),
            "required (KVPOOL_REQUIRE_PEERS=1): {why}"
        );
        eprintln!("skipped: {why}");
        Some(why)
    }

    /// Packets the receiving veth ends took through NAPI, where GRO runs (`ethtool -S`).
    fn napi_packets(h: &Hosts) -> u64 {
        h.veth_ends()
            .iter()
            .map(|(p, d)| offloads::ethtool(p, &["-S", d]).unwrap())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| {
                        let (k, v) = l.trim().split_once(':')?;
                        (k.starts_with("rx_queue_") && k.ends_with("_xdp_packets"))
                            .then(|| v.trim().parse::<u64>().ok())?
                    })
                    .collect::<Vec<_>>()
            })
            .sum()
    }

    /// Two hosts reach each other at the link's MTU and no further; an unplugged cable cuts a
    /// host off; everything is gone after drop. Skipped where namespaces cannot be made.
    #[test]
    fn hosts_reach_each_other_at_the_mtu_and_a_pulled_cable_cuts_one_off() {
        if skip().is_some() {
            return;
        }
        let mut h = Hosts::new(2, 1500).unwrap();
        assert!(datagram(&h, 1, 2, 1400), "hosts reach each other");
        assert!(!datagram(&h, 1, 2, 8000), "nothing past the MTU unfragmented");
        h.link(2, false).unwrap();
        assert!(!datagram(&h, 1, 2, 100), "a pulled cable");
        h.link(2, true).unwrap();
        h.set_mtu(9000).unwrap();
        h.rate(1, Some(1_000_000_000)).unwrap();
        assert!(datagram(&h, 1, 2, 8900), "a jumbo datagram at MTU 9000");
        let names = h.names.clone();
        drop(h);
        let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let list = String::from_utf8_lossy(&list.stdout);
        assert!(names.iter().all(|n| !list.contains(n.as_str())), "torn down: {list}");
    }

    /// The veths get a NIC's offloads, read back as on, and the receiving ends then take UDP
    /// through NAPI (where GRO runs); bare veths are the kernel's: GRO off, no NAPI.
    #[test]
    fn veths_get_a_nics_offloads_or_stay_bare_and_report_which() {
        if skip().is_some() {
            return;
        }
        let mut h = Hosts::new(2, 1500).unwrap().bare_veths(false).unwrap();
        let o = h.offloads().unwrap();
        assert!(o.nic, "{o}");
        for name in offloads::REPORTED {
            assert_eq!(o.get(name), Some(Feature::On), "{name}: {o}");
        }
        let before = napi_packets(&h);
        assert!(datagram(&h, 2, 1, 1000), "hosts reach each other with offloads");
        assert!(napi_packets(&h) > before, "with GRO and UDP GRO forwarding on, UDP goes through NAPI");

        h.set_offloads(false).unwrap();
        let o = h.offloads().unwrap();
        assert!(!o.nic, "{o}");
        assert_eq!(o.get("generic-receive-offload"), Some(Feature::Off), "{o}");
        assert_eq!(o.get("rx-udp-gro-forwarding"), Some(Feature::Off), "{o}");
        assert_eq!(o.get("tcp-segmentation-offload"), Some(Feature::On), "a veth's default: {o}");
        assert_eq!(o.get("tx-udp-segmentation"), Some(Feature::On), "a veth's default: {o}");
        assert!(o.to_string().starts_with("bare veths: gro off"), "{o}");
        let before = napi_packets(&h);
        assert!(datagram(&h, 2, 1, 1000), "hosts reach each other bare");
        assert_eq!(napi_packets(&h), before, "bare veths take no packet through NAPI");
    }
}
