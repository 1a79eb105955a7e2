//! QUIC for moving KV blocks: the UDP socket, endpoint, transport and TLS settings that the
//! server and the client share, in one place.
//!
//! # The pitfall this module exists for
//! quinn 0.11 hands the kernel up to 10 packets per `sendmsg` (UDP segmentation offload), and
//! Linux refuses a single send of more than about 64 KB of UDP payload. When path-MTU discovery
//! is allowed to grow past ~6,500 bytes, every multi-packet send fails with `EMSGSIZE`, which
//! quinn-udp treats as sent (quinn issues #1635, #2199): the data is lost, a retransmission
//! timeout recovers it (an ~85 ms stall per small transfer), then black-hole detection drops the
//! MTU to 1,200. Every endpoint here therefore sends through [`SplitSends`], which cuts such a
//! send into sends of whole packets that fit; only then may the MTU bound with offload on reach
//! [`OFFLOAD_MTU_CAP`]. Large datagrams are only used with offload off
//! ([`Segmentation::LargeDatagrams`]).
//!
//! # What is chosen, and why (measured; see `bench/RESULTS.md`)
//! - Same host (loopback or one of this host's addresses): offload off, datagrams up to 65,527
//!   bytes, starting at that size (the loopback MTU is 64 KiB, so there is nothing to discover).
//! - Across a network: offload on, MTU discovery up to [`OFFLOAD_MTU_CAP`], the UDP payload of
//!   a 9,000-byte jumbo link (10 such packets are two sends, cut by [`SplitSends`]).
//! - `send_window` no larger than half the receive buffer the kernel actually granted: more than
//!   the receiver's socket can queue only turns into loss on a fast path. On the same host it is
//!   also capped at [`SAME_HOST_SEND_WINDOW`], the best of the windows measured there. Buffers
//!   past `net.core.rmem_max` are asked for with `SO_RCVBUFFORCE` when the process may.
//! - TLS: AES-128-GCM offered first (a few percent cheaper than AES-256-GCM, ring's first choice).

pub mod bulk;
mod counters;
mod drivers;
mod refusals;
mod split;

pub use counters::{udp_stats, UdpStats};
pub use drivers::{io_threads, Drivers, IoThread};
pub use refusals::Refusals;
pub use split::SplitSends;

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

/// MTU bound with segmentation offload: the UDP payload of a 9,000-byte jumbo link (IPv4).
/// Sends of 10 such packets pass 64 KB and are cut in two by [`SplitSends`].
pub const OFFLOAD_MTU_CAP: u16 = 8_972;
/// Largest UDP payload over IPv4 (65,535 minus the IP and UDP headers, less quinn's margin).
pub const MAX_UDP_PAYLOAD: u16 = 65_527;
/// Socket buffer requested by default.
pub const DEFAULT_UDP_BUFFER: usize = 16 << 20;

/// How packets are handed to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Segmentation {
    /// Large datagrams on the same host, offload with a capped MTU across a network.
    #[default]
    Auto,
    /// Segmentation offload on, MTU discovery capped at `OFFLOAD_MTU_CAP`.
    Offload,
    /// Offload off, one datagram per send, up to `MAX_UDP_PAYLOAD` bytes.
    LargeDatagrams,
}

impl std::fmt::Display for Segmentation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Segmentation::Auto => "auto",
            Segmentation::Offload => "offload",
            Segmentation::LargeDatagrams => "large-datagrams",
        })
    }
}

impl std::str::FromStr for Segmentation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Segmentation::Auto),
            "offload" => Ok(Segmentation::Offload),
            "large-datagrams" => Ok(Segmentation::LargeDatagrams),
            other => Err(format!("{other:?}: expected auto, offload or large-datagrams")),
        }
    }
}

/// Settings an operator may change; the defaults are the measured choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QuicTuning {
    pub segmentation: Segmentation,
    /// Socket buffer size to ask the kernel for (it caps this at `net.core.rmem_max`/`wmem_max`
    /// unless the process has CAP_NET_ADMIN).
    pub udp_buffer: usize,
    /// Where the endpoint's quinn tasks run ([`Drivers`]).
    pub drivers: Drivers,
}

impl Default for QuicTuning {
    fn default() -> Self {
        QuicTuning { segmentation: Segmentation::Auto, udp_buffer: DEFAULT_UDP_BUFFER, drivers: Drivers::Caller }
    }
}

/// Where a peer is, as far as packet sizes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// Loopback or one of this host's own addresses: the path is the loopback device.
    SameHost,
    Network,
}

/// Whether `ip` is this host: loopback, or an address a socket can bind to here.
pub fn path_kind(ip: IpAddr) -> PathKind {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    if ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok() {
        PathKind::SameHost
    } else {
        PathKind::Network
    }
}

/// Socket buffer sizes: asked for, and granted by the kernel (as `getsockopt` reports them;
/// Linux reports twice the usable size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketBuffers {
    pub requested: usize,
    pub recv: usize,
    pub send: usize,
}

impl SocketBuffers {
    /// Bytes the receive buffer can really queue.
    pub fn usable_recv(&self) -> usize {
        if cfg!(target_os = "linux") {
            self.recv / 2
        } else {
            self.recv
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("cannot set up a UDP socket on {addr}: {source}")]
    Socket { addr: SocketAddr, source: std::io::Error },
    #[error("no async runtime for QUIC")]
    NoRuntime,
    #[error("QUIC endpoint: {0}")]
    Endpoint(std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
}

/// A UDP socket with large buffers, bound to `addr`; the sizes the kernel granted are read back
/// and a capped grant is logged with the sysctl that caps it.
pub fn bind_udp(addr: SocketAddr, want: usize) -> Result<(UdpSocket, SocketBuffers), NetError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let err = |source| NetError::Socket { addr, source };
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(err)?;
    if let Err(e) = sock.set_recv_buffer_size(want) {
        tracing::warn!(error = %e, "cannot set SO_RCVBUF");
    }
    if let Err(e) = sock.set_send_buffer_size(want) {
        tracing::warn!(error = %e, "cannot set SO_SNDBUF");
    }
    // net.core.rmem_max / wmem_max cap SO_RCVBUF / SO_SNDBUF silently (4 MiB on many hosts,
    // which halves what a QUIC path may keep in flight). A process with CAP_NET_ADMIN may go
    // past them, as quic-go does; without it the capped grant stands and is reported below.
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if sock.recv_buffer_size().unwrap_or(0) / 2 < want {
            force_buffer(sock.as_raw_fd(), libc::SO_RCVBUFFORCE, want);
        }
        if sock.send_buffer_size().unwrap_or(0) / 2 < want {
            force_buffer(sock.as_raw_fd(), libc::SO_SNDBUFFORCE, want);
        }
    }
    let bufs = SocketBuffers {
        requested: want,
        recv: sock.recv_buffer_size().unwrap_or(0),
        send: sock.send_buffer_size().unwrap_or(0),
    };
    if bufs.usable_recv() < want {
        tracing::warn!(
            requested = want,
            granted = bufs.usable_recv(),
            "UDP receive buffer capped by net.core.rmem_max (and no CAP_NET_ADMIN to go past it); raise it (sysctl -w net.core.rmem_max={want} \
             net.core.wmem_max={want}) for bulk transfers without loss"
        );
    }
    sock.bind(&addr.into()).map_err(err)?;
    Ok((sock.into(), bufs))
}

/// Ask for a socket buffer past the sysctl cap (`SO_RCVBUFFORCE` / `SO_SNDBUFFORCE`); refused
/// without CAP_NET_ADMIN, which leaves the capped size in place.
#[cfg(target_os = "linux")]
fn force_buffer(fd: std::os::fd::RawFd, opt: libc::c_int, want: usize) {
    let val = libc::c_int::try_from(want).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid socket descriptor, and a c_int option value of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!(error = %e, opt, "socket buffer above the sysctl cap refused (no CAP_NET_ADMIN)");
    }
}

/// Endpoint settings: accept datagrams up to the largest UDP payload (a peer's MTU discovery
/// decides what is actually sent).
pub fn endpoint_config() -> quinn::EndpointConfig {
    let mut ec = quinn::EndpointConfig::default();
    ec.max_udp_payload_size(MAX_UDP_PAYLOAD).expect("65,527 is a valid UDP payload size");
    ec
}

/// A quinn endpoint on a tuned socket.
pub fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    tuning: &QuicTuning,
) -> Result<(quinn::Endpoint, SocketBuffers), NetError> {
    let (sock, bufs) = bind_udp(addr, tuning.udp_buffer)?;
    Ok((endpoint_with(sock, server, tuning.drivers)?, bufs))
}

/// A quinn endpoint on `sock` (from [`bind_udp`]), its sends cut to the kernel's limit
/// ([`SplitSends`]), driven on the caller's runtime.
pub fn endpoint_on(sock: UdpSocket, server: Option<quinn::ServerConfig>) -> Result<quinn::Endpoint, NetError> {
    endpoint_with(sock, server, Drivers::Caller)
}

/// [`endpoint_on`], its quinn tasks run where `drivers` says.
pub fn endpoint_with(
    sock: UdpSocket,
    server: Option<quinn::ServerConfig>,
    drivers: Drivers,
) -> Result<quinn::Endpoint, NetError> {
    Ok(make_endpoint(sock, server, drivers, false)?.0)
}

/// A client endpoint as [`endpoint`] makes one, its socket watched for ICMP errors: the
/// [`Refusals`] say when a server's port stopped answering (its process is gone).
pub fn endpoint_watched(
    addr: SocketAddr,
    tuning: &QuicTuning,
) -> Result<(quinn::Endpoint, SocketBuffers, Refusals), NetError> {
    let (sock, bufs) = bind_udp(addr, tuning.udp_buffer)?;
    let (endpoint, refusals) = make_endpoint(sock, None, tuning.drivers, true)?;
    Ok((endpoint, bufs, refusals))
}

fn make_endpoint(
    sock: UdpSocket,
    server: Option<quinn::ServerConfig>,
    drivers: Drivers,
    watch: bool,
) -> Result<(quinn::Endpoint, Refusals), NetError> {
    let runtime: Arc<dyn quinn::Runtime> = match drivers {
        Drivers::Caller => quinn::default_runtime().ok_or(NetError::NoRuntime)?,
        Drivers::IoThread => Arc::new(IoThread::next().map_err(NetError::Endpoint)?),
    };
    let (refusals, watching) = if watch { Refusals::watch(&sock, &*runtime) } else { (Refusals::default(), None) };
    let inner = runtime.wrap_udp_socket(sock).map_err(NetError::Endpoint)?;
    let sock = Arc::new(SplitSends::watched(inner, watching));
    let endpoint = quinn::Endpoint::new_with_abstract_socket(endpoint_config(), server, sock, runtime)
        .map_err(NetError::Endpoint)?;
    Ok((endpoint, refusals))
}

/// Transport settings for bulk transfer on a path of `kind`. Callers add their own stream
/// limits, idle timeout and keep-alive.
pub fn transport_config(kind: PathKind, bufs: &SocketBuffers, tuning: &QuicTuning) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let large = match tuning.segmentation {
        Segmentation::Auto => kind == PathKind::SameHost,
        Segmentation::Offload => false,
        Segmentation::LargeDatagrams => true,
    };
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    if large {
        t.enable_segmentation_offload(false);
        mtu.upper_bound(MAX_UDP_PAYLOAD);
        if kind == PathKind::SameHost {
            // The loopback MTU is 64 KiB: the search climbs there within the first round trips.
            // (quinn cannot start there: handshake packets carry a 14-bit length, so
            // `initial_mtu`/`min_mtu` above ~16 KB abort.) A burst of congestion losses can pass
            // for a black hole, which drops the MTU to 1,200 bytes until the next search: search
            // again soon after, instead of a minute later.
            mtu.black_hole_cooldown(Duration::from_millis(500));
            mtu.interval(Duration::from_secs(30));
        }
    } else {
        t.enable_segmentation_offload(true);
        mtu.upper_bound(OFFLOAD_MTU_CAP);
    }
    t.mtu_discovery_config(Some(mtu));
    // Flow control: a batch of 64 x 4 MiB must not stall on credit over a fast path.
    t.stream_receive_window(quinn::VarInt::from_u32(64 << 20));
    t.receive_window(quinn::VarInt::from_u32(256 << 20));
    // In flight: no more than the receiver's socket can queue (assumed like ours). The kernel
    // charges a datagram's buffer overhead to that queue too: large datagrams get half of it.
    let usable = if large { bufs.usable_recv() / 2 } else { bufs.usable_recv() };
    t.send_window(send_window(kind, usable) as u64);
    t
}

/// Bytes in flight on a path of `kind` whose receiver can queue `usable` bytes.
///
/// On the same host, more than [`SAME_HOST_SEND_WINDOW`] costs throughput even when the socket
/// could hold it (measured on loopback, best of batch 1/64 and concurrency 1/8, 16 MiB buffers:
/// an 8 MiB window made 1 MiB puts 2.1-2.2 GB/s against 2.3-3.4 at 4 MiB; a 2 MiB window let
/// 64 x 4 MiB batches at concurrency 8 fall to 1.1-2.5 GB/s against 2.5-2.8 at 4 MiB). Across
/// a network the window follows the buffer, for the longer round trip.
pub fn send_window(kind: PathKind, usable: usize) -> usize {
    let most = if kind == PathKind::SameHost { SAME_HOST_SEND_WINDOW } else { 64 << 20 };
    usable.clamp(1 << 20, most)
}

/// Largest send window on a same-host path; see [`send_window`].
pub const SAME_HOST_SEND_WINDOW: usize = 4 << 20;

/// rustls with ring, AES-128-GCM first.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::CipherSuite as C;
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| match s.suite() {
        C::TLS13_AES_128_GCM_SHA256 => 0,
        C::TLS13_AES_256_GCM_SHA384 => 1,
        C::TLS13_CHACHA20_POLY1305_SHA256 => 2,
        _ => 3,
    });
    Arc::new(p)
}

/// What a connection's path looked like: for `/metrics` and the benchmark report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathReport {
    pub mtu: u16,
    pub rtt_us: u64,
    pub sent_packets: u64,
    pub lost_packets: u64,
    pub lost_bytes: u64,
    pub congestion_events: u64,
    pub black_holes: u64,
}

impl PathReport {
    pub fn of(conn: &quinn::Connection) -> PathReport {
        let p = conn.stats().path;
        PathReport {
            mtu: p.current_mtu,
            rtt_us: p.rtt.as_micros() as u64,
            sent_packets: p.sent_packets,
            lost_packets: p.lost_packets,
            lost_bytes: p.lost_bytes,
            congestion_events: p.congestion_events,
            black_holes: p.black_holes_detected,
        }
    }

    /// Sum of counters (the MTU and RTT of `self` are kept).
    pub fn add_counters(&mut self, o: &PathReport) {
        self.sent_packets += o.sent_packets;
        self.lost_packets += o.lost_packets;
        self.lost_bytes += o.lost_bytes;
        self.congestion_events += o.congestion_events;
        self.black_holes += o.black_holes;
    }
}

impl std::fmt::Display for PathReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "path MTU {} B, rtt {:?}, sent {} packets, lost {} ({} bytes), {} congestion events, {} black holes",
            self.mtu,
            Duration::from_micros(self.rtt_us),
            self.sent_packets,
            self.lost_packets,
            self.lost_bytes,
            self.congestion_events,
            self.black_holes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_host_addresses_are_recognised() {
        assert_eq!(path_kind("127.0.0.1".parse().unwrap()), PathKind::SameHost);
        assert_eq!(path_kind("::1".parse().unwrap()), PathKind::SameHost);
        assert_eq!(path_kind("::ffff:127.0.0.1".parse().unwrap()), PathKind::SameHost);
        // TEST-NET-3 (RFC 5737) is never assigned to a host.
        assert_eq!(path_kind("203.0.113.7".parse().unwrap()), PathKind::Network);
    }

    #[test]
    fn buffers_go_past_the_sysctl_cap_with_cap_net_admin() {
        let max = |f: &str| std::fs::read_to_string(f).ok().and_then(|s| s.trim().parse::<usize>().ok());
        let cap = max("/proc/sys/net/core/rmem_max").unwrap_or(0).min(max("/proc/sys/net/core/wmem_max").unwrap_or(0));
        // Twice the cap: more than any plain SO_RCVBUF / SO_SNDBUF can be granted here.
        let want = (cap * 2).max(1 << 20);
        let (_sock, bufs) = bind_udp("127.0.0.1:0".parse().unwrap(), want).unwrap();
        assert_eq!(bufs.requested, want);
        // CAP_NET_ADMIN is bit 12 of the effective capability set.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim).unwrap_or("0");
        let net_admin = u64::from_str_radix(eff, 16).is_ok_and(|c| c & (1 << 12) != 0);
        if net_admin {
            assert!(bufs.usable_recv() >= want, "recv {bufs:?}, cap {cap}");
            assert!(bufs.send / 2 >= want, "send {bufs:?}, cap {cap}");
        } else {
            // Without the capability the grant stays at the cap, and is reported as it is.
            assert!(bufs.usable_recv() <= cap.max(want), "{bufs:?}");
        }
    }

    #[test]
    fn send_window_follows_the_buffer_up_to_a_cap_per_path() {
        assert_eq!(send_window(PathKind::SameHost, 64 << 10), 1 << 20, "never below 1 MiB");
        assert_eq!(send_window(PathKind::SameHost, 3 << 20), 3 << 20);
        assert_eq!(send_window(PathKind::SameHost, 32 << 20), SAME_HOST_SEND_WINDOW);
        assert_eq!(send_window(PathKind::Network, 32 << 20), 32 << 20);
        assert_eq!(send_window(PathKind::Network, 1 << 30), 64 << 20);
    }

    #[test]
    fn aes128_is_offered_first() {
        let p = crypto_provider();
        assert_eq!(p.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    }

    #[test]
    fn offload_never_meets_large_mtus() {
        // Offload never meets 64 KB datagrams: a single packet must fit one UDP send.
        assert!(usize::from(OFFLOAD_MTU_CAP) <= split::MAX_SEND);
        let bufs = SocketBuffers { requested: 1 << 20, recv: 2 << 20, send: 2 << 20 };
        for kind in [PathKind::SameHost, PathKind::Network] {
            for segmentation in [Segmentation::Auto, Segmentation::Offload, Segmentation::LargeDatagrams] {
                let t = transport_config(kind, &bufs, &QuicTuning { segmentation, ..QuicTuning::default() });
                let dbg = format!("{t:?}");
                let offload = dbg.contains("enable_segmentation_offload: true");
                let large = dbg.contains(&format!("upper_bound: {MAX_UDP_PAYLOAD}"));
                assert!(!(offload && large), "{kind:?} {segmentation:?}: offload with large MTU");
                let want_large = segmentation == Segmentation::LargeDatagrams
                    || (segmentation == Segmentation::Auto && kind == PathKind::SameHost);
                assert_eq!((offload, large), (!want_large, want_large), "{kind:?} {segmentation:?}: {dbg}");
            }
        }
    }

    #[test]
    fn buffers_are_read_back() {
        let (_s, b) = bind_udp("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        assert!(b.recv > 0 && b.send > 0);
    }
}

#[cfg(test)]
mod loopback {
    use super::*;
    use std::time::Duration;

    /// A server's and a client's TLS settings for "localhost" (a fresh self-signed certificate).
    pub(crate) fn tls_pair() -> (rustls::ServerConfig, rustls::ClientConfig) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = rustls::pki_types::CertificateDer::from(cert.cert.der().to_vec());
        let key = rustls::pki_types::PrivateKeyDer::try_from(cert.key_pair.serialize_der()).unwrap();
        let mut sc = rustls::ServerConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        sc.alpn_protocols = vec![b"t".to_vec()];
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let mut cc = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        cc.alpn_protocols = vec![b"t".to_vec()];
        (sc, cc)
    }

    /// A server and a client endpoint on 127.0.0.1 with this module's settings; moves `n` bytes
    /// each way on one stream and returns the client's path report.
    async fn exchange(segmentation: Segmentation, n: usize) -> PathReport {
        exchange_with(QuicTuning { segmentation, ..QuicTuning::default() }, n).await
    }

    /// A server and a client endpoint as [`exchange`] makes them, the client's drivers where
    /// `tuning` says.
    async fn exchange_with(tuning: QuicTuning, n: usize) -> PathReport {
        let (sc, cc) = tls_pair();
        let (sock, bufs) = bind_udp("127.0.0.1:0".parse().unwrap(), tuning.udp_buffer).unwrap();
        let mut server =
            quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(sc).unwrap()));
        server.transport_config(Arc::new(transport_config(PathKind::SameHost, &bufs, &tuning)));
        let sep = endpoint_on(sock, Some(server)).unwrap();
        let addr = sep.local_addr().unwrap();
        let srv = tokio::spawn(async move {
            let conn = sep.accept().await.unwrap().await.unwrap();
            let (mut tx, mut rx) = conn.accept_bi().await.unwrap();
            let got = rx.read_to_end(usize::MAX).await.unwrap();
            tx.write_all(&got).await.unwrap();
            tx.finish().unwrap();
            conn.closed().await;
        });
        let (cep, cbufs) = endpoint("127.0.0.1:0".parse().unwrap(), None, &tuning).unwrap();
        let mut client =
            quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(cc).unwrap()));
        client.transport_config(Arc::new(transport_config(path_kind(addr.ip()), &cbufs, &tuning)));
        let conn = tokio::time::timeout(Duration::from_secs(5), cep.connect_with(client, addr, "localhost").unwrap())
            .await
            .expect("handshake within 5 s")
            .unwrap();
        let before = udp_stats();
        let (mut tx, mut rx) = conn.open_bi().await.unwrap();
        let data = vec![7u8; n];
        tx.write_all(&data).await.unwrap();
        tx.finish().unwrap();
        let back = tokio::time::timeout(Duration::from_secs(10), rx.read_to_end(usize::MAX)).await.unwrap().unwrap();
        assert_eq!(back.len(), n);
        // Both ends are in this process: every byte went out and came in through the counted
        // socket, twice (other tests in this process only add to the counters).
        let udp = udp_stats().since(&before);
        eprintln!("{udp}");
        assert!(udp.recv_bytes >= 2 * n as u64 && udp.send_bytes >= 2 * n as u64, "{udp:?}");
        assert!(udp.recv_datagrams >= udp.recv_messages && udp.recv_messages >= udp.recv_calls, "{udp:?}");
        let report = PathReport::of(&conn);
        conn.close(0u32.into(), b"done");
        srv.await.unwrap();
        report
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn io_thread_drivers_move_the_bytes() {
        let r = exchange_with(QuicTuning { drivers: Drivers::IoThread, ..QuicTuning::default() }, 4 << 20).await;
        assert!(r.mtu > 60_000, "{r}");
    }

    /// With [`Drivers::IoThread`] a connection makes progress while the thread that made it is
    /// blocked: quinn's tasks are not on the caller's runtime (with `Caller` drivers on this
    /// single-threaded runtime, nothing moves until the test's thread yields).
    #[tokio::test(flavor = "current_thread")]
    async fn io_thread_drivers_run_while_the_caller_is_blocked() {
        let tuning = QuicTuning { drivers: Drivers::IoThread, ..QuicTuning::default() };
        let (sc, cc) = tls_pair();
        let (sock, _) = bind_udp("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        let server =
            quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(sc).unwrap()));
        let sep = endpoint_with(sock, Some(server), Drivers::IoThread).unwrap();
        let addr = sep.local_addr().unwrap();
        let (cep, _) = endpoint("127.0.0.1:0".parse().unwrap(), None, &tuning).unwrap();
        let client = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(cc).unwrap()));
        let connecting = cep.connect_with(client, addr, "localhost").unwrap();
        let accepting = sep.accept();
        // Both handshake sides run on the pool's threads while this thread sleeps.
        std::thread::sleep(Duration::from_millis(500));
        let incoming = futures_now(accepting).expect("the server saw the client's Initial while the caller slept");
        let incoming = incoming.expect("an incoming connection");
        let (conn, server_conn) =
            tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(connecting, incoming) }).await.unwrap();
        let (conn, server_conn) = (conn.unwrap(), server_conn.unwrap());
        assert_eq!(conn.remote_address(), addr);
        drop(server_conn);
        conn.close(0u32.into(), b"done");
    }

    /// The output of a future that is ready now, polled once.
    fn futures_now<F: std::future::Future>(f: F) -> Option<F::Output> {
        let mut f = std::pin::pin!(f);
        let waker = std::task::Waker::noop();
        match f.as_mut().poll(&mut std::task::Context::from_waker(waker)) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn same_host_connections_keep_64k_datagrams() {
        let r = exchange(Segmentation::Auto, 8 << 20).await;
        eprintln!("{r}");
        assert!(r.mtu > 60_000, "{r}");
        assert_eq!(r.black_holes, 0, "{r}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn offload_climbs_past_64k_sends_to_its_cap_without_a_black_hole() {
        let r = exchange(Segmentation::Offload, 8 << 20).await;
        eprintln!("{r}");
        assert!(r.mtu <= OFFLOAD_MTU_CAP, "{r}");
        // 10 packets of this MTU are more than one send may carry: without the cut they fail,
        // and black-hole detection drops the MTU to 1,200 (or discovery stops near 6,500).
        assert!(usize::from(r.mtu) * 10 > split::MAX_SEND, "{r}");
        assert_eq!(r.black_holes, 0, "{r}");
    }
}
