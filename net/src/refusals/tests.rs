use crate::loopback::tls_pair;
use crate::{bind_udp, endpoint_on, endpoint_watched, Drivers, QuicTuning};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An address of this host where nothing listens (a socket bound, then closed).
fn closed_port() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

fn client_config(cc: rustls::ClientConfig) -> quinn::ClientConfig {
    quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(cc).unwrap()))
}

/// A server on 127.0.0.1 that echoes one stream per connection, and the client settings that
/// trust it.
fn echo_server() -> (quinn::Endpoint, tokio::task::JoinHandle<()>, quinn::ClientConfig) {
    let (sc, cc) = tls_pair();
    let (sock, _) = bind_udp("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
    let server =
        quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(sc).unwrap()));
    let sep = endpoint_on(sock, Some(server)).unwrap();
    let ep = sep.clone();
    let task = tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let Ok(conn) = incoming.await else { continue };
            tokio::spawn(async move {
                if let Ok((mut tx, mut rx)) = conn.accept_bi().await {
                    let got = rx.read_to_end(1 << 20).await.unwrap_or_default();
                    let _ = tx.write_all(&got).await;
                    let _ = tx.finish();
                }
                conn.closed().await;
            });
        }
    });
    (sep, task, client_config(cc))
}

async fn echo(conn: &quinn::Connection, n: usize) -> usize {
    let (mut tx, mut rx) = conn.open_bi().await.unwrap();
    tx.write_all(&vec![5u8; n]).await.unwrap();
    tx.finish().unwrap();
    rx.read_to_end(1 << 20).await.unwrap().len()
}

/// A packet to a port where nothing listens is refused within a round trip and recorded by the
/// address it went to (and no other); the endpoint, whose socket the kernel also told of the
/// errors, goes on serving connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_port_is_a_refusal_and_the_endpoint_lives_on() {
    for drivers in [Drivers::Caller, Drivers::IoThread] {
        let tuning = QuicTuning { drivers, ..QuicTuning::default() };
        let (cep, _, refusals) = endpoint_watched("127.0.0.1:0".parse().unwrap(), &tuning).unwrap();
        assert!(refusals.watched());
        let (dead, other) = (closed_port(), closed_port());
        let t0 = Instant::now();
        for round in 0..3 {
            // Each attempt's Initial is refused; the handshake itself would wait for its timeout.
            let attempt = Instant::now();
            let connecting = cep.connect_with(client_config(tls_pair().1), dead, "localhost").unwrap();
            tokio::time::timeout(Duration::from_secs(5), refusals.refused(dead, attempt))
                .await
                .unwrap_or_else(|_| panic!("{drivers:?}: attempt {round} not refused within 5 s"));
            drop(connecting);
        }
        assert!(!refusals.refused_since(other, t0), "only the address that refused is recorded");
        assert!(!refusals.refused_since(dead, Instant::now() + Duration::from_secs(1)));

        let (sep, server, cc) = echo_server();
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            cep.connect_with(cc, sep.local_addr().unwrap(), "localhost").unwrap(),
        )
        .await
        .expect("a handshake after the refusals")
        .expect("the endpoint still connects");
        assert_eq!(echo(&conn, 100_000).await, 100_000);
        assert!(!refusals.refused_since(sep.local_addr().unwrap(), t0));
        conn.close(0u32.into(), b"done");
        sep.close(0u32.into(), b"done");
        server.abort();
    }
}

/// A server whose socket closes under a live connection: the client's next packet to it is
/// refused, and the refusal is newer than the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_gone_under_a_connection_is_refused() {
    let (cep, _, refusals) = endpoint_watched("127.0.0.1:0".parse().unwrap(), &QuicTuning::default()).unwrap();
    // The server on a runtime of its own, as if in a process of its own.
    let server_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (sep, _server, cc) = {
        let _in = server_rt.enter();
        echo_server()
    };
    let addr = sep.local_addr().unwrap();
    let conn = cep.connect_with(cc, addr, "localhost").unwrap().await.unwrap();
    assert_eq!(echo(&conn, 10_000).await, 10_000);
    let up = Instant::now();
    // The server's process "dies": its tasks and socket go, and no close reaches the client.
    drop(sep);
    server_rt.shutdown_background();
    let (mut tx, _rx) = conn.open_bi().await.unwrap();
    tx.write_all(b"anyone there?").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), refusals.refused(addr, up)).await.expect("a refusal within 5 s");
}

/// Refusals keep per-address times: a newer refusal of one address leaves another's alone.
#[test]
fn a_refusal_is_kept_per_address() {
    let r = super::Refusals::default();
    assert!(!r.watched());
    let (a, b): (SocketAddr, SocketAddr) = ("10.0.0.1:7000".parse().unwrap(), "10.0.0.2:7000".parse().unwrap());
    let t0 = Instant::now();
    r.shared.record(a);
    assert!(r.refused_since(a, t0));
    assert!(!r.refused_since(b, t0));
    // An IPv4-mapped IPv6 address is the same peer.
    assert!(r.refused_since("[::ffff:10.0.0.1]:7000".parse().unwrap(), t0));
}

/// The watching task ends with the socket: once the endpoint is gone, nothing holds the port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_ends_with_the_endpoint() {
    let (cep, _, refusals) = endpoint_watched("127.0.0.1:0".parse().unwrap(), &QuicTuning::default()).unwrap();
    let addr = cep.local_addr().unwrap();
    assert!(refusals.watched());
    cep.close(0u32.into(), b"done");
    cep.wait_idle().await;
    drop(cep);
    // The endpoint's driver drops the socket (and with it the watch) as it ends.
    let deadline = Instant::now() + Duration::from_secs(5);
    while UdpSocket::bind(addr).is_err() {
        assert!(Instant::now() < deadline, "the port stayed taken: a descriptor of the socket outlived the endpoint");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The refusals handle itself may outlive it (the client keeps one), recording nothing.
    assert!(!refusals.refused_since(addr, Instant::now()));
}
