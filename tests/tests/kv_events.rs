//! KV events against a real server: a subscription sees its tenant's block copies stored,
//! demoted, evicted and removed, in order, with keys, chain parents, node and tier; another
//! tenant sees none of them and only an admin sees every tenant; a subscriber that does not
//! read is told what it lost and never slows the pool; subscriptions resume from a cursor, are
//! bounded in number, end with their connection, and are refused on the control socket; the CLI
//! prints them as JSON lines.

use kvpool_client::proto::{EventBatch, EventScope, KvEvent, KvEventKind};
use kvpool_client::{Client, ClientError, ErrorCode, PutOptions, SubscribeOptions, Subscription};
use kvpool_tests::{bin, metric, value_for, Opts, TestServer, ADMIN_KEY, ALICE_KEY, BOB_KEY};
use std::time::Duration;

fn status_of(e: ClientError) -> ErrorCode {
    match e {
        ClientError::Status { code, .. } => code,
        other => panic!("expected a typed status, got {other:?}"),
    }
}

fn opts(from: Option<u64>, scope: EventScope) -> SubscribeOptions {
    SubscribeOptions { from, scope, ..SubscribeOptions::default() }
}

/// Events until `want` have come or the pool has been quiet for 3 s.
async fn collect(sub: &mut Subscription, want: usize) -> (Vec<KvEvent>, u64) {
    let (mut events, mut lagged) = (Vec::new(), 0);
    while events.len() < want {
        match sub.next_within(Duration::from_secs(3)).await.unwrap() {
            Some(EventBatch { events: e, lagged: l, .. }) => {
                events.extend(e);
                lagged += l;
            }
            None => break,
        }
    }
    (events, lagged)
}

fn key(e: &KvEvent) -> String {
    String::from_utf8_lossy(&e.key).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_follows_its_tenants_copies_in_order_and_only_an_admin_sees_all() {
    let srv = TestServer::start(Opts { dram: "4MiB", ssd: "64MiB", ..Opts::default() });
    let alice = srv.client(ALICE_KEY).await;
    let bob = srv.client(BOB_KEY).await;
    let admin = srv.client(ADMIN_KEY).await;
    let mut mine = alice.subscribe(opts(None, EventScope::Tenant)).await.unwrap();
    let mut bobs = bob.subscribe(opts(None, EventScope::Tenant)).await.unwrap();
    let mut all = admin.subscribe(opts(None, EventScope::All)).await.unwrap();
    let first = mine.next().await.unwrap();
    assert!(first.events.is_empty() && first.lagged == 0, "the first batch confirms the subscription");
    assert_eq!(status_of(alice.subscribe(opts(None, EventScope::All)).await.unwrap_err()), ErrorCode::Forbidden);

    // A chain of 4 blocks, then enough more to push the first ones out of the 4 MiB DRAM tier.
    let value = value_for("v", 64 << 10);
    for i in 0..4 {
        let o = PutOptions { parent: (i > 0).then(|| format!("c{}", i - 1).into_bytes()), ..PutOptions::default() };
        alice.put_with(format!("c{i}"), &value, o).await.unwrap();
    }
    let (ev, lagged) = collect(&mut mine, 4).await;
    assert_eq!(lagged, 0);
    assert_eq!(ev.iter().map(key).collect::<Vec<_>>(), ["c0", "c1", "c2", "c3"]);
    for (i, e) in ev.iter().enumerate() {
        assert_eq!((e.kind, e.tier, e.size, e.tenant.as_str()), (KvEventKind::Stored, 1, 64 << 10, "alice"));
        assert_eq!(e.parent.clone(), (i > 0).then(|| format!("c{}", i - 1).into_bytes()));
        assert!(!e.node.is_empty() && e.time_ms > 0);
    }
    assert!(ev.windows(2).all(|w| w[0].seq < w[1].seq));
    // A router reads as it goes (one that falls behind loses events: the lag test).
    let mut ev = Vec::new();
    for i in 0..120 {
        alice.put(format!("fill{i}"), &value).await.unwrap();
        while let Some(b) = mine.next_within(Duration::ZERO).await.unwrap() {
            assert_eq!(b.lagged, 0);
            ev.extend(b.events);
        }
    }
    let (rest, lagged) = collect(&mut mine, usize::MAX).await;
    assert_eq!(lagged, 0);
    ev.extend(rest);
    assert!(ev.windows(2).all(|w| w[0].seq < w[1].seq));
    // Demotions: the SSD copy is announced before the DRAM copy goes, for the same key.
    let demoted: Vec<&KvEvent> = ev.iter().filter(|e| e.kind == KvEventKind::Stored && e.tier == 2).collect();
    assert!(!demoted.is_empty(), "a full DRAM tier demotes to SSD: {ev:?}");
    for d in &demoted {
        let gone = ev.iter().position(|e| e.key == d.key && e.kind == KvEventKind::Evicted && e.tier == 1);
        let came = ev.iter().position(|e| e.seq == d.seq).unwrap();
        assert!(gone.is_some_and(|g| g > came), "{} stored on SSD, then evicted from DRAM", key(d));
    }
    // A remove is announced for every copy the block had.
    let on_ssd = key(demoted[0]);
    alice.remove(&on_ssd, true).await.unwrap();
    let (ev2, _) = collect(&mut mine, 1).await;
    let removed: Vec<&KvEvent> = ev2.iter().filter(|e| key(e) == on_ssd).collect();
    assert!(!removed.is_empty() && removed.iter().all(|e| e.kind == KvEventKind::Removed), "{ev2:?}");

    // Bob's subscription saw nothing of Alice's; the admin saw Alice's, named by tenant.
    let b = bobs.next().await.unwrap();
    assert!(b.events.is_empty());
    assert!(bobs.next_within(Duration::from_millis(300)).await.unwrap().is_none(), "another tenant's events");
    let (seen, _) = collect(&mut all, 4).await;
    assert!(seen.len() >= 4 && seen.iter().all(|e| e.tenant == "alice"));
    assert_eq!(seen.iter().take(4).map(key).collect::<Vec<_>>(), ["c0", "c1", "c2", "c3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_subscriber_is_told_what_it_lost_and_resumes_from_a_cursor() {
    let srv = TestServer::start(Opts { extra: "[events]\nbuffer = 64\n".into(), ..Opts::default() });
    let alice = srv.client(ALICE_KEY).await;
    let writer = srv.client(ALICE_KEY).await;
    // Ask for everything from the first event: nothing is lost yet.
    writer.put("early", b"x").await.unwrap();
    // One event per frame: 500 frames for a client that queues 16 while its caller is away.
    let one_each = SubscribeOptions { max_batch: 1, ..opts(Some(1), EventScope::Tenant) };
    let mut sub = alice.subscribe(one_each).await.unwrap();
    let b = sub.next().await.unwrap();
    assert_eq!((b.lagged, b.events.len(), b.next), (0, 1, 2));
    let log_id = sub.log_id();
    // The subscriber does not read while 500 puts go through: none waits for it (its client
    // reads ahead 16 batches and reports the ones it had to drop as `lagged`).
    for i in 0..500 {
        writer.put(format!("k{i}"), b"v").await.unwrap();
    }
    // Every sequence number from the cursor on is either delivered or counted as lost.
    let (ev, lagged) = collect(&mut sub, 10_000).await;
    assert_eq!(ev.len() as u64 + lagged, 500, "delivered {} + lagged {lagged}", ev.len());
    assert!(lagged > 0, "the client's queue of 16 frames cannot hold 500");
    // The drop is reported as soon as the queue is read, though no event came after it.
    assert_eq!(sub.resume_from(), 502);
    assert!(ev.windows(2).all(|w| w[0].seq < w[1].seq));
    // A subscriber behind the 64-event buffer learns how many it lost, then reads on from the
    // oldest event still held.
    let mut late = alice.subscribe(opts(Some(1), EventScope::Tenant)).await.unwrap();
    let (ev, lagged) = collect(&mut late, 64).await;
    assert_eq!(lagged, 501 - 64);
    assert_eq!(ev.len(), 64);
    assert_eq!(ev[0].seq, 502 - 64);
    assert!(metric(&srv.scrape(), "kvpool_events_lagged_total") >= lagged as f64);
    drop(late);

    // Resume exactly where the last batch ended: no loss, no repeat.
    let cursor = sub.resume_from();
    drop(sub);
    for i in 0..10 {
        writer.put(format!("r{i}"), b"v").await.unwrap();
    }
    let same_log = SubscribeOptions { log_id: Some(log_id), ..opts(Some(cursor), EventScope::Tenant) };
    let mut again = alice.subscribe(same_log).await.unwrap();
    assert_eq!(again.log_id(), log_id);
    let (ev, lagged) = collect(&mut again, 10).await;
    assert_eq!(lagged, 0);
    assert_eq!(ev.iter().map(key).collect::<Vec<_>>(), (0..10).map(|i| format!("r{i}")).collect::<Vec<_>>());
    assert_eq!(ev[0].seq, cursor);
    // A cursor of another log (a restarted server's) is refused, by its id or by its range.
    let other_log = SubscribeOptions { log_id: Some(log_id ^ 1), ..opts(Some(cursor), EventScope::Tenant) };
    assert_eq!(status_of(alice.subscribe(other_log).await.unwrap_err()), ErrorCode::Expired);
    let e = alice.subscribe(opts(Some(cursor + 1000), EventScope::Tenant)).await.unwrap_err();
    assert_eq!(status_of(e), ErrorCode::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_are_bounded_end_with_their_connection_and_stay_off_the_control_socket() {
    let srv = TestServer::start(Opts { extra: "[events]\nmax_subscribers = 2\n".into(), ..Opts::default() });
    let alice = srv.client(ALICE_KEY).await;
    let one = alice.subscribe(SubscribeOptions::default()).await.unwrap();
    let other = srv.client(BOB_KEY).await;
    let two = other.subscribe(SubscribeOptions::default()).await.unwrap();
    let e = alice.subscribe(SubscribeOptions::default()).await.unwrap_err();
    assert_eq!(status_of(e), ErrorCode::Rejected);
    assert_eq!(metric(&srv.scrape(), "kvpool_event_subscribers"), 2.0);
    // Dropping a subscription frees its place; closing a connection frees its subscriptions'.
    drop(one);
    other.close().await;
    drop(two);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric(&srv.scrape(), "kvpool_event_subscribers") > 0.0 {
        assert!(std::time::Instant::now() < deadline, "subscriptions outlived their streams");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = alice.subscribe(SubscribeOptions::default()).await.unwrap();
    alice.put("after", b"v").await.unwrap();
    let (ev, _) = collect(&mut again, 1).await;
    assert_eq!(ev.iter().map(key).collect::<Vec<_>>(), ["after"]);
    // The pool served on: ordinary requests still work (over the control socket on this host).
    assert_eq!(alice.lookup(&["after"]).await.unwrap(), 1);

    // Events off: a typed refusal.
    let off = TestServer::start(Opts { extra: "[events]\nbuffer = 0\n".into(), ..Opts::default() });
    let c: Client = off.client(ALICE_KEY).await;
    assert_eq!(status_of(c.subscribe(SubscribeOptions::default()).await.unwrap_err()), ErrorCode::Unsupported);
    c.put("still", b"works").await.unwrap();
}

#[test]
fn the_cli_prints_events_as_json_lines() {
    let srv = TestServer::start(Opts::default());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = srv.client(ALICE_KEY).await;
        c.put("a", b"1").await.unwrap();
        c.put_with("b", b"22", PutOptions { parent: Some(b"a".to_vec()), ..PutOptions::default() }).await.unwrap();
        c.remove("a", false).await.unwrap();
    });
    let out = std::process::Command::new(bin("kvpool"))
        .env_clear()
        .env("KVPOOL_SERVER", srv.addr())
        .env("KVPOOL_API_KEY", ALICE_KEY)
        .env("KVPOOL_CA", srv.endpoint["cert_path"].as_str().unwrap())
        .args(["events", "--from", "1", "--count", "3", "--idle-ms", "5000"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    // The last line is where to resume.
    assert_eq!(lines[3]["next"], 4);
    assert_eq!(lines[3]["log_id"].as_str().unwrap().len(), 16);
    let brief: Vec<(&str, &str, &str)> = lines[..3]
        .iter()
        .map(|v| (v["kind"].as_str().unwrap(), v["key"].as_str().unwrap(), v["tier"].as_str().unwrap()))
        .collect();
    assert_eq!(brief, [("stored", "a", "dram"), ("stored", "b", "dram"), ("removed", "a", "dram")]);
    assert_eq!(lines[1]["parent"], "a");
    assert_eq!(lines[1]["size"], 2);
    assert_eq!(lines[0]["tenant"], "alice");
    assert_eq!(lines[0]["seq"], 1);
}
