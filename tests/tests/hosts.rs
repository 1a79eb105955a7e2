//! Across hosts: the server on one network namespace of a bridge, clients on others (root only;
//! skipped, saying why, where namespaces cannot be made). Bytes cross veth pairs at a real MTU
//! instead of loopback.

use kvpool_client::{Client, ClientError, TransportChoice};
use kvpool_netns::Hosts;
use kvpool_tests::{bin, value_for, Opts, TestServer, ADMIN_KEY};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_on_one_host_reads_on_another_and_a_pulled_cable_is_a_typed_error_until_plugged_in() {
    if let Some(why) = kvpool_netns::unavailable() {
        assert!(
            std::env::var("KVPOOL_REQUIRE_PEERS").as_deref() != Ok("1"),
            "required (KVPOOL_REQUIRE_PEERS=1): {why}"
        );
        eprintln!("skipped: {why}");
        return;
    }
    // Host 1 runs the server; the test (the root namespace) and host 2 are its clients.
    let hosts = Hosts::new(2, 1500).unwrap();
    let srv = TestServer::start(Opts { host: Some((hosts.prefix(1).unwrap(), hosts.ip(1))), ..Opts::default() });
    assert!(srv.addr().starts_with(&hosts.ip(1)), "{}", srv.addr());
    let mut cfg = srv.client_config_on(ADMIN_KEY, TransportChoice::Quic);
    cfg.request_timeout = Duration::from_secs(2);
    let c = Client::connect(cfg.clone()).await.unwrap();
    let value = value_for("across", 3 << 20);
    c.put("across", &value).await.unwrap();

    // Host 2 reads it with the CLI.
    let out = tempfile::NamedTempFile::new().unwrap();
    let got = hosts
        .command(2, bin("kvpool"))
        .unwrap()
        .env_clear()
        .env("KVPOOL_SERVER", srv.addr())
        .env("KVPOOL_API_KEY", ADMIN_KEY)
        .env("KVPOOL_CA", srv.endpoint["cert_path"].as_str().unwrap())
        .args(["get", "across", "-o"])
        .arg(out.path())
        .output()
        .unwrap();
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    assert!(std::fs::read(out.path()).unwrap() == value, "host 2 read the bytes host 0 put");

    // The server's cable pulled: a typed error within the request timeout, not a hang.
    hosts.link(1, false).unwrap();
    let t = Instant::now();
    let err = c.get("across").await.expect_err("no route to the server");
    assert!(t.elapsed() < cfg.request_timeout + Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(
        matches!(err, ClientError::Timeout(_) | ClientError::Closed(_) | ClientError::Connect { .. }),
        "a transport error, typed: {err:?}"
    );

    // Plugged in again: the same client serves again, and the bytes are intact.
    hosts.link(1, true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match c.get("across").await {
            Ok(v) => {
                assert!(v.as_deref() == Some(&value[..]), "the block is intact");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "still failing 15 s after the cable came back: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
