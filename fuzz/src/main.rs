//! `kvpool-fuzz`: runs generated and mutated request streams through the protocol decoder and
//! through the server's real request handler (store, tiers, policies, auth), in memory, with
//! time paused so that stalled clients cost nothing. Every input must end without a panic, with
//! at most one well-formed response whose bulk bytes match their checksums, and without leaking
//! DRAM; canary blocks of a tenant no input names must stay intact.
//!
//! A panic stops the run, writes the input to `--crash-dir`, and exits with status 1.

mod bulk;
mod bulk_tls;
mod gen;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gen::{Ending, Input};
use kvpool_proto::frame::encode_frame;
use kvpool_proto::{codec, ErrorCode, KeysRequest, PinSpec, PutItem, PutMode, PutRequest, Request, Response};
use kvpool_server::config::{ApiKeyEntry, Config, Size};
use kvpool_server::service::memory::{MemRecv, MemSend};
use kvpool_server::service::{handle_stream, Session, Shared};
use kvpool_transport::memfd::SharedBuffer;
use kvpool_transport::shm::ShmClient;
use kvpool_transport::RegionId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "kvpool-fuzz", about = "Fuzz the kvpool protocol decoder and request handler in memory")]
struct Args {
    /// Stop after this many seconds.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Stop after this many handler inputs (per thread), if sooner.
    #[arg(long)]
    inputs: Option<u64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Independent workers, each with its own node and seed.
    #[arg(long, default_value_t = 1)]
    threads: u64,
    /// Connections to the shm socket fuzzed per thread (each is a real socket and server thread).
    #[arg(long, default_value_t = 2000)]
    socket_inputs: u64,
    /// Where a crashing input is written.
    #[arg(long, default_value = "fuzz-crashes")]
    crash_dir: PathBuf,
}

const KEYS: [&str; 3] = ["fuzz-alice", "fuzz-bob", "fuzz-admin"];
const CANARY_KEY: &str = "fuzz-canary";
const CANARIES: usize = 16;

fn config(dir: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.server.data_dir = dir.to_path_buf();
    c.dram.size = Size(32 << 20);
    c.ssd.capacity = Size(16 << 20);
    c.limits.max_value_size = Size(2 << 20);
    c.limits.max_batch = 64;
    c.limits.max_frame = Size(64 << 10);
    c.limits.request_timeout_ms = 100;
    c.limits.min_transfer_rate = Size(1 << 20);
    c.cache.put_wait_ms = 50;
    c.cache.lease_ttl_ms = 20;
    c.policy.max_module_size = Size(1024);
    c.transport.shm_socket = Some(dir.join("s.sock"));
    let entry = |tenant: &str, key: &str, admin| ApiKeyEntry {
        tenant: tenant.into(),
        sha256: hex::encode(kvpool_server::auth::hash_key(key)),
        admin,
    };
    c.auth.keys = vec![
        entry("alice", KEYS[0], false),
        entry("bob", KEYS[1], false),
        entry("ops", KEYS[2], true),
        entry("canary", CANARY_KEY, false),
    ];
    c
}

#[derive(Default, Debug)]
struct Tally {
    handler_inputs: u64,
    decoder_inputs: u64,
    shm_socket_inputs: u64,
    control_socket_inputs: u64,
    bulk_inputs: u64,
    bulk_tls_inputs: u64,
    by_answer: BTreeMap<String, u64>,
}

struct Worker {
    shared: Arc<Shared>,
    principals: Vec<kvpool_server::auth::Principal>,
    canary: kvpool_server::auth::Principal,
    /// One connection per fuzzed key, kept across inputs so that reservations, leases and the
    /// shm attachment of earlier inputs meet later ones.
    sessions: Vec<Conn>,
}

/// A fuzzed connection: its session, and the shm link and buffers its client shares (regions 1
/// and 2).
struct Conn {
    session: Arc<Session>,
    _link: Option<ShmClient>,
    _buffers: Vec<SharedBuffer>,
}

impl Worker {
    /// Fresh connections (dropping the old ones releases everything they held).
    async fn reconnect(&mut self) -> Result<()> {
        self.sessions.clear();
        for p in self.principals.clone() {
            let session = Session::new(p, kvpool_proto::PROTOCOL_VERSION, None);
            let (link, buffers) = attach(self, &session).await?;
            self.sessions.push(Conn { session, _link: Some(link), _buffers: buffers });
        }
        Ok(())
    }
}

/// One request without raw bytes through the handler on `session`: its answer.
async fn ask(w: &Worker, session: &Arc<Session>, req: &Request) -> Result<Response> {
    let (_, send) = run_on(w, session.clone(), MemRecv::new(encode_frame(req)?), MemSend::default())
        .await
        .map_err(anyhow::Error::msg)?;
    let len = u32::from_le_bytes(send.written[..4].try_into()?) as usize;
    Ok(codec::decode::<Response>(&send.written[4..4 + len])?)
}

/// Attach a session's client over the real shm socket and share two buffers with the server.
async fn attach(w: &Worker, session: &Arc<Session>) -> Result<(ShmClient, Vec<SharedBuffer>)> {
    let Response::ShmOffer(offer) = ask(w, session, &Request::ShmAttach).await? else {
        bail!("no shm offer: is the fuzz node's shm socket up?")
    };
    let link = ShmClient::connect(std::path::Path::new(&offer.socket_path), &offer.token)?;
    let mut buffers = vec![SharedBuffer::new(1 << 20, "fuzz")?, SharedBuffer::new(2 << 20, "fuzz")?];
    for (i, b) in buffers.iter_mut().enumerate() {
        b.as_mut_slice().fill(i as u8 + 1);
    }
    link.add(&[(RegionId(1), &buffers[0]), (RegionId(2), &buffers[1])])?;
    Ok((link, buffers))
}

/// Run one stream through the handler in its own task; `Err` carries a panic message.
async fn run(
    w: &Worker,
    principal: &kvpool_server::auth::Principal,
    recv: MemRecv,
    send: MemSend,
) -> std::result::Result<(MemRecv, MemSend), String> {
    let session = w
        .sessions
        .iter()
        .find(|c| c.session.principal == *principal)
        .map(|c| c.session.clone())
        .unwrap_or_else(|| Session::new(principal.clone(), kvpool_proto::PROTOCOL_VERSION, None));
    run_on(w, session, recv, send).await
}

async fn run_on(
    w: &Worker,
    session: Arc<Session>,
    recv: MemRecv,
    send: MemSend,
) -> std::result::Result<(MemRecv, MemSend), String> {
    let shared = w.shared.clone();
    let task = tokio::spawn(async move {
        let (mut recv, mut send) = (recv, send);
        handle_stream(&mut recv, &mut send, &session, &shared).await;
        (recv, send)
    });
    task.await.map_err(|e| format!("{e}"))
}

/// What a response says, for the tally; `Err` when it breaks the protocol.
fn check_response(input: &Input, sent_any: bool, send: &MemSend) -> std::result::Result<String, String> {
    if send.reset.is_some() {
        return Ok("reset".into());
    }
    if send.written.is_empty() {
        if input.ending == Ending::Fin && sent_any {
            return Err("a finished, non-empty request got no answer".into());
        }
        return Ok("none".into());
    }
    if !send.finished {
        return Err("response not finished".into());
    }
    let w = &send.written;
    let len = u32::from_le_bytes(w.get(..4).ok_or("short frame")?.try_into().expect("4 bytes")) as usize;
    let body = w.get(4..4 + len).ok_or("response frame longer than what was written")?;
    let resp: Response = codec::decode(body).map_err(|e| format!("undecodable response: {e}"))?;
    let mut rest = &w[4 + len..];
    let label = match &resp {
        Response::Get(g) => {
            for it in g.items.iter().filter(|i| i.status == ErrorCode::Ok) {
                let n = it.size as usize;
                let value = rest.get(..n).ok_or("get response shorter than its items")?;
                if xxhash_rust::xxh3::xxh3_64(value) != it.checksum {
                    return Err("served bytes do not match their checksum".into());
                }
                rest = &rest[n..];
            }
            "get".to_string()
        }
        Response::Data(h) => {
            if rest.len() as u64 != h.size {
                return Err(format!("read answered {} bytes, announced {}", rest.len(), h.size));
            }
            rest = &[];
            "data".to_string()
        }
        Response::Filled(g) => {
            if g.items.iter().any(|i| i.status == ErrorCode::Ok && i.size > 3 << 20) {
                return Err("filled more than any destination holds".into());
            }
            "filled".to_string()
        }
        Response::Error(e) => format!("error:{}", e.code),
        other => format!("{other:?}").split(['(', ' ', '{']).next().unwrap_or("?").to_lowercase(),
    };
    if !rest.is_empty() {
        return Err(format!("{} bytes after the response", rest.len()));
    }
    Ok(label)
}

fn put_bytes(items: &[(String, Vec<u8>)]) -> Vec<u8> {
    let req = Request::Put(PutRequest {
        mode: PutMode::Insert,
        items: items
            .iter()
            .map(|(k, v)| PutItem {
                key: k.clone().into_bytes(),
                size: v.len() as u64,
                parent: None,
                tokens: 0,
                seq_tokens: 0,
                pin: PinSpec::Hard,
            })
            .collect(),
    });
    let mut b = encode_frame(&req).expect("encodes");
    for (_, v) in items {
        b.extend_from_slice(v);
    }
    b
}

fn canaries() -> Vec<(String, Vec<u8>)> {
    (0..CANARIES).map(|i| (format!("k{i}"), (0..(i * 97 + 5)).map(|b| (b * 31 + i) as u8).collect())).collect()
}

async fn check_canaries(w: &Worker) -> Result<()> {
    let expected = canaries();
    let keys = expected.iter().map(|(k, _)| k.clone().into_bytes()).collect();
    let frame = encode_frame(&Request::Get(KeysRequest { keys }))?;
    let (_, send) = run(w, &w.canary, MemRecv::new(frame), MemSend::default()).await.map_err(anyhow::Error::msg)?;
    let len = u32::from_le_bytes(send.written[..4].try_into()?) as usize;
    let Response::Get(g) = codec::decode::<Response>(&send.written[4..4 + len])? else { bail!("canary get failed") };
    let mut rest = &send.written[4 + len..];
    for (it, (k, v)) in g.items.iter().zip(&expected) {
        if it.status != ErrorCode::Ok || rest.get(..v.len()) != Some(&v[..]) {
            bail!("canary {k} damaged: {:?}", it.status);
        }
        rest = &rest[v.len()..];
    }
    Ok(())
}

/// With every fuzzed block removed and the fuzzed connections closed, DRAM holds exactly the
/// canaries again: no reservation, lease or in-flight copy leaked.
async fn check_no_leak(w: &mut Worker, canary_dram: u64) -> Result<()> {
    w.sessions.clear();
    // A lookup's hold goes with its lease, and every lease with its connection.
    let held = w.shared.store.held();
    if held != 0 {
        bail!("{held} blocks still held by lookups with every fuzzed connection closed");
    }
    for p in &w.principals {
        w.shared.store.remove_all(p.tenant_id, true);
    }
    // Background promotions and demotions of earlier inputs finish first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let used = w.shared.store.dram_used();
    if used != canary_dram {
        bail!("DRAM leaked: {used} bytes allocated with only the canaries ({canary_dram} bytes) stored");
    }
    Ok(())
}

/// Connections to the shm socket with broken or hostile handshakes: noise, bad framing, wrong
/// tokens, unsealed, short or oversized files, descriptors that do not match the message.
async fn fuzz_socket(w: &Worker, rng: &mut StdRng, n: u64) -> Result<u64> {
    use rustix::fd::AsFd;
    use std::io::{IoSlice, Read, Write};
    use std::os::unix::net::UnixStream;
    let path = w.shared.data_path.as_ref().and_then(|d| d.shm.as_ref()).context("shm socket")?.path().to_owned();
    let frame = |body: &[u8]| {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    };
    for i in 0..n {
        // Half the time a genuine token, so that the messages after the attach are reached.
        let token: Vec<u8> = if rng.gen_bool(0.5) {
            let throwaway = Session::new(w.principals[0].clone(), kvpool_proto::PROTOCOL_VERSION, None);
            match ask(w, &throwaway, &Request::ShmAttach).await? {
                Response::ShmOffer(o) => o.token,
                other => bail!("no offer: {other:?}"),
            }
        } else {
            (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect()
        };
        let conn = UnixStream::connect(&path)?;
        conn.set_read_timeout(Some(Duration::from_millis(200)))?;
        conn.set_write_timeout(Some(Duration::from_millis(200)))?;
        let attach = codec::encode(&kvpool_transport::shm::ShmMsg::Attach { token })?;
        let mut msgs: Vec<Vec<u8>> = vec![frame(&attach)];
        for _ in 0..rng.gen_range(0..4) {
            let regions: Vec<(u64, u64)> = (0..rng.gen_range(0..4))
                .map(|_| (rng.gen_range(0..6), [0, 1, 4096, 1 << 20, u64::MAX, 1 << 41][rng.gen_range(0..6)]))
                .collect();
            let msg = match rng.gen_range(0..4) {
                0 => kvpool_transport::shm::ShmMsg::Remove { ids: regions.iter().map(|r| r.0).collect() },
                1 => kvpool_transport::shm::ShmMsg::Attach { token: vec![1; 32] },
                _ => kvpool_transport::shm::ShmMsg::Add { regions },
            };
            msgs.push(frame(&codec::encode(&msg)?));
        }
        if rng.gen_bool(0.3) {
            let k = rng.gen_range(0..msgs.len());
            gen::mutate(rng, &mut msgs[k], &[]);
        }
        for m in &msgs {
            // Descriptors: none, sealed, unsealed, or too short, in a number that may not match.
            let mut fds: Vec<rustix::fd::OwnedFd> = Vec::new();
            for _ in 0..rng.gen_range(0..3) {
                let f = rustix::fs::memfd_create(
                    "fz",
                    rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
                )?;
                rustix::fs::ftruncate(&f, [0u64, 4096, 1 << 20][rng.gen_range(0..3)])?;
                if rng.gen_bool(0.6) {
                    rustix::fs::fcntl_add_seals(&f, rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW)?;
                }
                fds.push(f);
            }
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
            if !borrowed.is_empty() {
                anc.push(rustix::net::SendAncillaryMessage::ScmRights(&borrowed));
            }
            let cut = if rng.gen_bool(0.05) { rng.gen_range(0..=m.len()) } else { m.len() };
            if rustix::net::sendmsg(&conn, &[IoSlice::new(&m[..cut])], &mut anc, rustix::net::SendFlags::NOSIGNAL)
                .is_err()
            {
                break;
            }
            let mut reply = [0u8; 512];
            if (&conn).read(&mut reply).map_or(true, |n| n == 0) {
                break;
            }
        }
        if i % 2 == 0 {
            let _ = (&conn).write_all(&[0xff; 3]);
        }
    }
    Ok(n)
}

/// Connections to the same-host control socket: genuine, wrong, short or missing tokens, then
/// envelopes of generated requests, noise, lies about their length, and cut-off bodies. Every
/// answer must be a well-formed envelope; the sockets may be closed, never the server.
async fn fuzz_control(w: &Worker, rng: &mut StdRng, n: u64) -> Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let local = w.shared.data_path.as_ref().and_then(|d| d.local.as_ref()).context("control socket")?;
    let path = local.path().to_owned();
    let mut last = Vec::new();
    for _ in 0..n {
        // A session that asked for the channel lives while its socket is fuzzed.
        let session = Session::new(w.principals[rng.gen_range(0..w.principals.len())].clone(), 2, None);
        let offer = match ask(w, &session, &Request::LocalAttach).await? {
            Response::LocalOffer(o) => o,
            other => bail!("no control offer: {other:?}"),
        };
        let mut token = offer.token.clone();
        match rng.gen_range(0..10) {
            0 => token.truncate(rng.gen_range(0..32)),
            1 => token[rng.gen_range(0..32)] ^= 1 << rng.gen_range(0..8),
            _ => {}
        }
        let mut sock = tokio::net::UnixStream::connect(&path).await?;
        if sock.write_all(&token).await.is_err() {
            continue;
        }
        if token.len() < 32 {
            // The server waits for the rest of the token, then gives up (paused time runs on).
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
            continue;
        }
        let mut status = [0u8; 1];
        if sock.read_exact(&mut status).await.is_err() || status[0] != 0 {
            if token == offer.token {
                bail!("a genuine token was refused");
            }
            continue;
        }
        for _ in 0..rng.gen_range(1..5) {
            let body: Vec<u8> = match rng.gen_range(0..8) {
                0 => (0..rng.gen_range(0..64)).map(|_| rng.gen()).collect(),
                _ => gen::input(rng, w.principals.len(), &last).bytes,
            };
            let declared = match rng.gen_range(0..20) {
                0 => offer.max_request + 1,
                1 => rng.gen(),
                _ => body.len() as u32,
            };
            let mut env = declared.to_le_bytes().to_vec();
            env.extend_from_slice(&body);
            let cut = if rng.gen_bool(0.05) { rng.gen_range(0..=env.len()) } else { env.len() };
            let body_len = body.len();
            last = body;
            if sock.write_all(&env[..cut]).await.is_err() {
                break;
            }
            if cut < env.len() || declared as usize > body_len {
                // An incomplete envelope: the server's deadline ends the socket.
                let mut rest = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(600), sock.read_to_end(&mut rest)).await;
                break;
            }
            if (declared as usize) < body_len {
                // The rest of the body reads as the next envelope; only the socket is at stake.
                break;
            }
            let mut head = [0u8; 9];
            if sock.read_exact(&mut head).await.is_err() {
                if declared <= offer.max_request {
                    bail!("a well-formed envelope of {declared} bytes got no answer");
                }
                break;
            }
            let m = u32::from_le_bytes(head[5..9].try_into()?);
            if head[0] > 1 || m > offer.max_response {
                bail!("malformed answer envelope: end {} length {m}", head[0]);
            }
            let mut answer = vec![0u8; m as usize];
            sock.read_exact(&mut answer).await?;
        }
    }
    Ok(n)
}

fn worker(args: &Args, index: u64, deadline: Instant) -> Result<Tally> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?;
    rt.block_on(async {
        let dir = tempfile::tempdir()?;
        let node = kvpool_server::open_node(&config(dir.path())).await?;
        tokio::spawn(kvpool_server::service::local::serve(node.shared.clone()));
        let tls = kvpool_server::tls::load_or_generate(None, None, dir.path(), "localhost")?;
        let door = kvpool_server::service::bulk::BulkDoor::bind(
            "",
            "127.0.0.1:0".parse()?,
            kvpool_server::bulk_tls(&tls)?,
            vec!["10.9.0.0/24".parse()?],
        )?;
        let _ = node.shared.bulk.set(door);
        let bulk_client = bulk_tls::client_config(&tls.certs[0])?;
        let principal = |k: &str| node.shared.auth.check(k).context("fuzz key");
        let mut w = Worker {
            principals: KEYS.iter().map(|k| principal(k)).collect::<Result<_>>()?,
            canary: principal(CANARY_KEY)?,
            shared: node.shared.clone(),
            sessions: Vec::new(),
        };
        w.reconnect().await?;
        let (_, send) = run(&w, &w.canary, MemRecv::new(put_bytes(&canaries())), MemSend::default())
            .await
            .map_err(anyhow::Error::msg)?;
        if !matches!(check_response(&Input { bytes: vec![], ending: Ending::Fin, key: 0, read_limit: None }, true, &send), Ok(l) if l == "put")
        {
            bail!("canary put failed");
        }
        let canary_dram = w.shared.store.dram_used();
        let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ index);
        let mut tally = Tally::default();
        let mut last = bytes::Bytes::new();
        loop {
            if tally.handler_inputs % 256 == 0 {
                if Instant::now() >= deadline || args.inputs.is_some_and(|n| tally.handler_inputs >= n) {
                    break;
                }
                check_canaries(&w).await?;
                w.shared.store.maintain().await;
                if tally.handler_inputs % 8192 == 0 {
                    check_no_leak(&mut w, canary_dram).await?;
                    w.reconnect().await?;
                }
            }
            let held: Vec<u64> = w.sessions.iter().flat_map(|c| c.session.held()).collect();
            gen::HELD.with(|h| *h.borrow_mut() = held);
            let mut input = gen::input(&mut rng, w.principals.len(), &last);
            // The decoder on its own, on the same bytes and on the body alone.
            for body in [&input.bytes[..], input.bytes.get(4..).unwrap_or(&[])] {
                let _ = codec::decode::<Request>(body);
                let _ = codec::decode::<Response>(body);
                tally.decoder_inputs += 2;
            }
            let data = bytes::Bytes::from(std::mem::take(&mut input.bytes));
            let recv = match input.ending {
                Ending::Fin => MemRecv::new(data.clone()),
                Ending::Reset => MemRecv::reset_after(data.clone()),
                Ending::Stall => MemRecv::stall_after(data.clone()),
            };
            let send = MemSend { capacity: input.read_limit, ..MemSend::default() };
            let outcome = run(&w, &w.principals[input.key], recv, send).await;
            tally.handler_inputs += 1;
            let label = match outcome {
                Err(panic) => {
                    std::fs::create_dir_all(&args.crash_dir)?;
                    let path = args.crash_dir.join(format!("crash-{index}-{}.bin", tally.handler_inputs));
                    std::fs::write(&path, &data)?;
                    bail!("handler panicked on input {} ({:?}), saved to {}: {panic}", tally.handler_inputs, input.ending, path.display());
                }
                Ok((_, send)) => check_response(&input, !data.is_empty(), &send).map_err(|e| {
                    anyhow::anyhow!("protocol broken on input {}: {e}; input {input:?} {:?}", tally.handler_inputs, &data[..])
                })?,
            };
            *tally.by_answer.entry(label).or_default() += 1;
            last = data;
        }
        check_canaries(&w).await?;
        tally.shm_socket_inputs += fuzz_socket(&w, &mut rng, args.socket_inputs).await?;
        tally.control_socket_inputs += fuzz_control(&w, &mut rng, args.socket_inputs).await?;
        tally.bulk_inputs += bulk::fuzz_bulk(&w, &mut rng, args.socket_inputs).await?;
        tally.bulk_tls_inputs += bulk_tls::fuzz_bulk_tls(&w, &mut rng, args.socket_inputs, &bulk_client).await?;
        // The socket fuzz left the server serving: a real attach still works, the canaries hold.
        w.reconnect().await?;
        check_canaries(&w).await?;
        check_no_leak(&mut w, canary_dram).await?;
        Ok(tally)
    })
}

fn main() -> Result<()> {
    let args = &Args::parse();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.seconds);
    let results: Vec<Result<Tally>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.threads).map(|i| s.spawn(move || worker(args, i, deadline))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("worker thread panicked"))))
            .collect()
    });
    let mut total = Tally::default();
    for r in results {
        let t = r?;
        total.handler_inputs += t.handler_inputs;
        total.decoder_inputs += t.decoder_inputs;
        total.shm_socket_inputs += t.shm_socket_inputs;
        total.control_socket_inputs += t.control_socket_inputs;
        total.bulk_inputs += t.bulk_inputs;
        total.bulk_tls_inputs += t.bulk_tls_inputs;
        for (k, v) in t.by_answer {
            *total.by_answer.entry(k).or_default() += v;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "kvpool-fuzz: {} handler inputs (protocol versions 1 and 2), {} decoder inputs, {} shm socket \
         connections, {} control socket connections, {} bulk channel connections and {} TLS bulk channel \
         connections in {secs:.1} s ({:.0} handler inputs/s), 0 panics, 0 protocol violations, canaries intact, \
         no DRAM leaked",
        total.handler_inputs,
        total.decoder_inputs,
        total.shm_socket_inputs,
        total.control_socket_inputs,
        total.bulk_inputs,
        total.bulk_tls_inputs,
        total.handler_inputs as f64 / secs
    );
    println!("answers: {:?}", total.by_answer);
    Ok(())
}
