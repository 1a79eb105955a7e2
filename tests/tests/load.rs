//! Many concurrent clients doing mixed operations.

use kvpool_client::PutOptions;
use kvpool_proto::PinSpec;
use kvpool_tests::{value_for, Opts, TestServer, ADMIN_KEY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_clients_mixed_operations() {
    let srv = TestServer::start(Opts { dram: "64MiB", ssd: "256MiB", ..Opts::default() });
    let cfg = srv.client_config(ADMIN_KEY);
    let mut tasks = Vec::new();
    for n in 0..200 {
        let cfg = cfg.clone();
        tasks.push(tokio::spawn(async move {
            let c = kvpool_client::Client::connect(cfg).await?;
            for i in 0..10 {
                let k = format!("c{n}-k{i}");
                let parent = (i > 0).then(|| format!("c{n}-k{}", i - 1).into_bytes());
                let v = value_for(&k, 1024 * (1 + (n * 7 + i) % 64));
                c.put_with(
                    &k,
                    &v,
                    PutOptions { parent, tokens: 16, seq_tokens: 16 * (i as u64 + 1), pin: PinSpec::None },
                )
                .await?;
                if let Some(got) = c.get(&k).await? {
                    anyhow::ensure!(got == v, "bytes differ for {k}");
                }
                let chain: Vec<String> = (0..=i).map(|j| format!("c{n}-k{j}")).collect();
                c.lookup(&chain).await?;
                c.exists(std::slice::from_ref(&k)).await?;
                if i % 3 == 0 {
                    c.remove(&k, true).await?;
                }
            }
            c.stats().await?;
            c.ping().await?;
            anyhow::Ok(())
        }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            failures.push(e.to_string());
        }
    }
    assert!(failures.is_empty(), "{} clients failed: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    let c = srv.client(ADMIN_KEY).await;
    let s = c.stats().await.unwrap();
    // Over shared memory a put is a `put_from`.
    let puts: u64 = s.ops.iter().filter(|o| o.op == "put" || o.op == "put_from").map(|o| o.count).sum();
    assert!(puts >= 2000, "{puts} puts");
    assert_eq!(s.ops.iter().map(|o| o.errors).sum::<u64>(), 0, "{:?}", s.ops);
}
