//! A same-host client that moves 64 x 1 MiB batches through shared memory until it is killed:
//! the end-to-end tests kill it in the middle of a transfer.
//!
//! Usage: kvpool-shm-stress ADDR CERT_PEM API_KEY KEY_PREFIX; prints "ready" after its first round.

use kvpool_client::{Client, ClientConfig, PutMode, PutOptions, TransportChoice, Trust};
use std::io::Write;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(args.len() == 5, "usage: kvpool-shm-stress ADDR CERT_PEM API_KEY KEY_PREFIX");
    let mut cfg = ClientConfig::new(&args[1], &args[3], Trust::CaFile(args[2].clone().into()));
    cfg.transport = TransportChoice::Shm;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let c = Client::connect(cfg).await?;
        const N: usize = 64;
        const SIZE: usize = 1 << 20;
        let mut src = c.alloc_buffer(N * SIZE)?;
        let dst = c.alloc_buffer(N * SIZE)?;
        for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        for round in 0u64.. {
            let keys: Vec<String> = (0..N).map(|i| format!("{}-{round}-{i}", args[4])).collect();
            let entries: Vec<_> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| (k, src.slice(i * SIZE, SIZE).unwrap(), PutOptions::default()))
                .collect();
            c.put_from_batch(&entries, PutMode::Upsert).await?;
            let dests: Vec<_> = (0..N).map(|i| dst.slice(i * SIZE, SIZE).unwrap()).collect();
            c.get_into_batch(&keys, &dests).await?;
            c.remove_batch(&keys, true).await?;
            if round == 0 {
                println!("ready");
                std::io::stdout().flush()?;
            }
        }
        anyhow::Ok(())
    })
}
