//! A local process that opens Unix socket connections and never presents a token, as a greedy
//! or broken client would: the end-to-end tests check that the control socket keeps places for
//! other processes.
//!
//! Usage: kvpool-socket-hog SOCKET_PATH COUNT; prints "held N" (the connections the server kept
//! open), then holds them until its standard input closes.

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::time::Duration;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(args.len() == 3, "usage: kvpool-socket-hog SOCKET_PATH COUNT");
    let count: usize = args[2].parse()?;
    let mut socks = Vec::with_capacity(count);
    for _ in 0..count {
        socks.push(UnixStream::connect(&args[1])?);
    }
    // The server closes at once what it does not keep; give it time to get to all of them.
    std::thread::sleep(Duration::from_millis(500));
    let mut held = 0;
    for s in &mut socks {
        s.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            // Nothing to read yet: the server keeps it, waiting for a token.
            Err(e) if e.kind() == ErrorKind::WouldBlock => held += 1,
            // Closed (or answered): not held.
            _ => {}
        }
    }
    println!("held {held}");
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    Ok(())
}
