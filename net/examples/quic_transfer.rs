//! A fixed QUIC transfer through kvpool-net's endpoints, both ends in this process on
//! loopback, packets capped at a link's MTU: for instruction counts per byte under callgrind
//! and for the UDP counters (datagrams per send and per received message).
//!
//! ```sh
//! cargo build --release -p kvpool-net --example quic_transfer
//! valgrind --tool=callgrind target/release/examples/quic_transfer --mtu 1500 --mib 64
//! ```
//!
//! `--mtu` is the link MTU to emulate (the path MTU is capped at its UDP payload; loopback
//! itself would carry 64 KB datagrams); `--read chunk` reads with `read_chunk` (quinn's
//! buffers handed out, then copied into the destination) instead of `read` into it.

use kvpool_net::{bind_udp, crypto_provider, endpoint_on, transport_config, udp_stats, PathKind, QuicTuning};
use std::sync::Arc;
use std::time::Instant;

struct Args {
    mtu: u16,
    mib: usize,
    chunked: bool,
}

fn args() -> Args {
    let mut a = Args { mtu: 1500, mib: 64, chunked: false };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_default();
        match k.as_str() {
            "--mtu" => a.mtu = v.parse().expect("--mtu N"),
            "--mib" => a.mib = v.parse().expect("--mib N"),
            "--read" => a.chunked = v == "chunk",
            other => panic!("unknown argument {other} (--mtu N, --mib N, --read chunk|read)"),
        }
    }
    a
}

/// Transport settings of a network path whose link MTU is `mtu` (IPv4: 28 bytes of headers).
fn transport(bufs: &kvpool_net::SocketBuffers, mtu: u16) -> quinn::TransportConfig {
    let tuning = QuicTuning { segmentation: kvpool_net::Segmentation::Offload, ..QuicTuning::default() };
    let mut t = transport_config(PathKind::Network, bufs, &tuning);
    let mut d = quinn::MtuDiscoveryConfig::default();
    d.upper_bound(mtu - 28);
    t.mtu_discovery_config(Some(d));
    t
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let n = a.mib << 20;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("certificate");
    let der = rustls::pki_types::CertificateDer::from(cert.cert.der().to_vec());
    let key = rustls::pki_types::PrivateKeyDer::try_from(cert.key_pair.serialize_der()).expect("key");
    let mut sc = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .expect("server certificate");
    sc.alpn_protocols = vec![b"t".to_vec()];
    let (sock, bufs) = bind_udp("127.0.0.1:0".parse().expect("literal"), kvpool_net::DEFAULT_UDP_BUFFER).expect("bind");
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(sc).expect("QUIC server config"),
    ));
    server.transport_config(Arc::new(transport(&bufs, a.mtu)));
    let sep = endpoint_on(sock, Some(server)).expect("server endpoint");
    let addr = sep.local_addr().expect("bound");
    let chunked = a.chunked;
    // The receiver: one stream into one destination buffer, as a put lands in its block.
    let srv = tokio::spawn(async move {
        let conn = sep.accept().await.expect("incoming").await.expect("handshake");
        let mut rx = conn.accept_uni().await.expect("stream");
        let mut dst = vec![0u8; n];
        let mut filled = 0;
        while filled < n {
            if chunked {
                match rx.read_chunk(n - filled, true).await.expect("read_chunk") {
                    Some(c) => {
                        dst[filled..filled + c.bytes.len()].copy_from_slice(&c.bytes);
                        filled += c.bytes.len();
                    }
                    None => break,
                }
            } else {
                let end = n.min(filled + (128 << 10));
                match rx.read(&mut dst[filled..end]).await.expect("read") {
                    Some(k) => filled += k,
                    None => break,
                }
            }
        }
        assert_eq!(filled, n, "every byte");
        std::hint::black_box(&dst);
        conn.close(0u32.into(), b"done");
        sep.wait_idle().await;
    });
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).expect("root");
    let mut cc = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cc.alpn_protocols = vec![b"t".to_vec()];
    let (csock, cbufs) =
        bind_udp("127.0.0.1:0".parse().expect("literal"), kvpool_net::DEFAULT_UDP_BUFFER).expect("bind");
    let cep = endpoint_on(csock, None).expect("client endpoint");
    let mut client =
        quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(cc).expect("QUIC client")));
    client.transport_config(Arc::new(transport(&cbufs, a.mtu)));
    let conn = cep.connect_with(client, addr, "localhost").expect("connect").await.expect("handshake");
    let data = vec![7u8; n];
    let before = udp_stats();
    let t = Instant::now();
    let mut tx = conn.open_uni().await.expect("stream");
    tx.write_all(&data).await.expect("write");
    tx.finish().expect("finish");
    srv.await.expect("receiver");
    let secs = t.elapsed().as_secs_f64();
    let p = kvpool_net::PathReport::of(&conn);
    println!(
        "{} MiB at MTU {} ({} read): {:.0} MB/s; {p}",
        a.mib,
        a.mtu,
        if chunked { "chunk" } else { "plain" },
        n as f64 / secs / 1e6
    );
    println!("udp, both ends: {}", udp_stats().since(&before));
}
