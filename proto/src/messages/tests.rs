//! The byte layout of messages, and the examples of docs/PROTOCOL.md checked against the code.

use super::*;
use crate::{codec, REQUEST_TAGS};

#[test]
fn byte_layout_is_stable() {
    // The annotated example in docs/PROTOCOL.md.
    let req = Request::Lookup(LookupRequest { chain: vec![b"a".to_vec(), b"bc".to_vec()] });
    let body = codec::encode(&req).unwrap();
    let expected: Vec<u8> = [
        vec![3, 0, 0, 0],             // tag 3 = Lookup
        vec![2, 0, 0, 0, 0, 0, 0, 0], // 2 keys
        vec![1, 0, 0, 0, 0, 0, 0, 0, b'a'],
        vec![2, 0, 0, 0, 0, 0, 0, 0, b'b', b'c'],
    ]
    .concat();
    assert_eq!(body, expected);
    assert_eq!(codec::decode::<Request>(&body).unwrap(), req);
    assert_eq!(crate::message_tag(&body), Some(3));
}

#[test]
fn huge_claimed_lengths_do_not_allocate() {
    // tag 4 (Exists) then a key count of 2^60: must fail cleanly, not abort.
    let mut body = vec![4, 0, 0, 0];
    body.extend_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(codec::decode::<Request>(&body).is_err());
    let mut trailing = codec::encode(&Request::Stats).unwrap();
    trailing.push(0);
    assert!(codec::decode::<Request>(&trailing).is_err());
}
fn dump(text: &str) -> Vec<u8> {
    crate::parse_hex_dump(text).unwrap()
}

#[test]
fn documented_hello_and_put_example() {
    // Copied verbatim into docs/PROTOCOL.md ("Annotated example"); keep the two identical.
    let hello = crate::frame::encode_frame(&Request::Hello(Hello {
        version: 1,
        api_key: "secret".into(),
        client_name: "demo".into(),
    }))
    .unwrap();
    assert_eq!(
        hello,
        dump(
            "
            20 00 00 00                 # frame length: 32-byte body
            00 00 00 00                 # Request tag 0 = Hello
            01 00                       # version: u16 1
            06 00 00 00 00 00 00 00     # api_key: length 6
            73 65 63 72 65 74           #   \"secret\"
            04 00 00 00 00 00 00 00     # client_name: length 4
            64 65 6d 6f                 #   \"demo\"
            "
        )
    );

    let hello_ok = crate::frame::encode_frame(&Response::Hello(HelloOk {
        version: 1,
        server: "kvpool".into(),
        tenant: "default".into(),
        admin: true,
        limits: Limits { max_frame: 4 << 20, max_key_len: 1024, max_value_size: 64 << 20, max_batch: 1024 },
    }))
    .unwrap();
    assert_eq!(
        hello_ok,
        dump(
            "
            38 00 00 00                 # frame length: 56-byte body
            00 00 00 00                 # Response tag 0 = Hello (HelloOk)
            01 00                       # version: u16 1
            06 00 00 00 00 00 00 00     # server: length 6
            6b 76 70 6f 6f 6c           #   \"kvpool\"
            07 00 00 00 00 00 00 00     # tenant: length 7
            64 65 66 61 75 6c 74        #   \"default\"
            01                          # admin: true
            00 00 40 00                 # limits.max_frame: u32 4194304
            00 04 00 00                 # limits.max_key_len: u32 1024
            00 00 00 04 00 00 00 00     # limits.max_value_size: u64 67108864
            00 04 00 00                 # limits.max_batch: u32 1024
            "
        )
    );

    let put = crate::frame::encode_frame(&Request::Put(PutRequest {
        mode: PutMode::Insert,
        items: vec![PutItem {
            key: b"blk-0".to_vec(),
            size: 5,
            parent: None,
            tokens: 16,
            seq_tokens: 16,
            pin: PinSpec::None,
        }],
    }))
    .unwrap();
    let mut stream = put.clone();
    stream.extend_from_slice(b"hello");
    assert_eq!(
        stream,
        dump(
            "
            36 00 00 00                 # frame length: 54-byte body
            01 00 00 00                 # Request tag 1 = Put
            00 00 00 00                 # mode: PutMode tag 0 = Insert
            01 00 00 00 00 00 00 00     # items: 1 item
            05 00 00 00 00 00 00 00     #   key: length 5
            62 6c 6b 2d 30              #     \"blk-0\"
            05 00 00 00 00 00 00 00     #   size: u64 5
            00                          #   parent: None
            10 00 00 00                 #   tokens: u32 16
            10 00 00 00 00 00 00 00     #   seq_tokens: u64 16
            00 00 00 00                 #   pin: PinSpec tag 0 = None
            68 65 6c 6c 6f              # raw value bytes (not framed): \"hello\"
            "
        )
    );

    let put_ok = crate::frame::encode_frame(&Response::Put(StatusList { results: vec![ErrorCode::Ok] })).unwrap();
    assert_eq!(
        put_ok,
        dump(
            "
            10 00 00 00                 # frame length: 16-byte body
            01 00 00 00                 # Response tag 1 = Put (StatusList)
            01 00 00 00 00 00 00 00     # results: 1 status
            00 00 00 00                 #   ErrorCode 0 = Ok
            "
        )
    );
}

/// The hex dumps of a section of docs/PROTOCOL.md, in order: every ``` block under the heading.
fn doc_dumps(heading: &str) -> Vec<Vec<u8>> {
    doc_blocks(heading).into_iter().map(dump).collect()
}

/// The fenced blocks of a section of PROTOCOL.md.
#[test]
fn documented_cluster_messages() {
    let blocks = doc_blocks("### 11.8 Cluster");
    assert_eq!(blocks.len(), 3, "notation, request, answer");
    let route = Request::Route(KeysRequest { keys: vec![b"k1".to_vec()] });
    assert_eq!(dump(blocks[1]), crate::frame::encode_frame(&route).unwrap());
    let routes = Response::Routes(Routes {
        nodes: vec![NodeAddr {
            node: 2,
            addr: "10.0.0.2:7100".into(),
            server_name: "s".into(),
            fingerprint: vec![0xab; 32],
        }],
        items: vec![vec![2]],
    });
    assert_eq!(dump(blocks[2]), crate::frame::encode_frame(&routes).unwrap());
    assert_eq!(codec::encode(&ErrorCode::NotLeader).unwrap(), vec![24, 0, 0, 0]);
    assert_eq!(
        crate::message_tag(&codec::encode(&Request::Place(PlaceRequest { items: vec![], replicas: 1 })).unwrap()),
        Some(27)
    );
}

#[test]
fn documented_connector_messages() {
    let blocks = doc_blocks("### 11.9 Connector requests");
    assert_eq!(blocks.len(), 3, "notation, request, answer");
    let ask = Request::LookupLease(LookupLeaseRequest { chain: vec![b"k1".to_vec()], ttl_ms: 5000 });
    assert_eq!(dump(blocks[1]), crate::frame::encode_frame(&ask).unwrap());
    let answer = Response::LookupLeased(LookupLeased { resident: 1, lease: 7, lease_ms: 5000 });
    assert_eq!(dump(blocks[2]), crate::frame::encode_frame(&answer).unwrap());
    let rm = Request::RemoveMatching(RemoveMatchingRequest { prefix: vec![], pattern: None, force: false });
    assert_eq!(crate::message_tag(&codec::encode(&rm).unwrap()), Some(30));
    assert_eq!(REQUEST_TAGS, 32);
}

fn doc_blocks(heading: &str) -> Vec<&'static str> {
    let doc = include_str!("../../../docs/PROTOCOL.md");
    let start = doc.find(heading).expect("section in PROTOCOL.md");
    let section = &doc[start..];
    let rest = &section[heading.len()..];
    // A subsection ends at the next heading of its level or above.
    let next = if heading.starts_with("### ") {
        [rest.find("\n## "), rest.find("\n### ")].into_iter().flatten().min()
    } else {
        rest.find("\n## ")
    };
    let end = next.map_or(section.len(), |e| e + heading.len());
    section[..end].split("```").skip(1).step_by(2).collect()
}

#[test]
fn documented_v2_examples() {
    let dumps = doc_dumps("### 11.5 Annotated example (version 2)");
    assert_eq!(dumps.len(), 3);
    assert_eq!(dumps[0], crate::frame::encode_frame(&Request::ShmAttach).unwrap());
    let offer = Response::ShmOffer(ShmOffer { socket_path: "/s".into(), token: vec![1, 2] });
    assert_eq!(dumps[1], crate::frame::encode_frame(&offer).unwrap());
    let put = Request::PutFrom(PutFromRequest {
        mode: PutMode::Insert,
        items: vec![PutItem {
            key: b"k1".to_vec(),
            size: 3,
            parent: None,
            tokens: 0,
            seq_tokens: 0,
            pin: PinSpec::None,
        }],
        sources: vec![BufSlice { region: 1, offset: 4096, len: 3 }],
    });
    assert_eq!(dumps[2], crate::frame::encode_frame(&put).unwrap());
    // The tags the tables give.
    assert_eq!(
        crate::message_tag(
            &codec::encode(&Request::Read(ReadRequest { lease: 0, index: 0, offset: 0, size: 0 })).unwrap()
        ),
        Some(20)
    );
    assert_eq!(REQUEST_TAGS, 32);
    assert_eq!(codec::encode(&Response::Done).unwrap(), vec![15, 0, 0, 0]);
    assert_eq!(codec::encode(&ErrorCode::Expired).unwrap(), vec![23, 0, 0, 0]);
}

#[test]
fn documented_kv_events() {
    let blocks = doc_blocks("### 11.7 KV events");
    // The first block of the section is the message notation, not bytes.
    assert_eq!(blocks.len(), 3);
    let (request, frame) = (dump(blocks[1]), dump(blocks[2]));
    let sub = Request::Subscribe(SubscribeRequest { from: Some(1), scope: EventScope::Tenant, max_batch: 0 });
    assert_eq!(request, crate::frame::encode_frame(&sub).unwrap());
    let batch = Response::Events(EventBatch {
        log_id: 0x0102_0304_0506_0708,
        lagged: 0,
        next: 3,
        events: vec![KvEvent {
            seq: 2,
            kind: KvEventKind::Stored,
            tier: 1,
            node: "n1".into(),
            tenant: "t".into(),
            key: b"b".to_vec(),
            parent: Some(b"a".to_vec()),
            size: 2,
            time_ms: 1000,
        }],
    });
    assert_eq!(frame, crate::frame::encode_frame(&batch).unwrap());
}

#[test]
fn documented_encoding_rules() {
    // Option: u8 0/1 then the value; bool: u8; unit variant: tag only; f64: IEEE LE.
    let parent = PutItem {
        key: vec![1],
        size: 0,
        parent: Some(vec![2]),
        tokens: 0,
        seq_tokens: 0,
        pin: PinSpec::Soft { ttl_ms: 7 },
    };
    let b = codec::encode(&parent).unwrap();
    assert_eq!(&b[17..27], &[1, 1, 0, 0, 0, 0, 0, 0, 0, 2]);
    assert_eq!(&b[b.len() - 12..], &[1, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(codec::encode(&Request::Stats).unwrap(), vec![7, 0, 0, 0]);
    assert_eq!(codec::encode(&RemoveAllRequest { force: true }).unwrap(), vec![1]);
    assert_eq!(codec::encode(&1.5f64).unwrap(), 1.5f64.to_le_bytes().to_vec());
    assert_eq!(codec::encode(&ErrorCode::InvalidArgument).unwrap(), vec![20, 0, 0, 0]);
    assert_eq!(
        codec::encode(&Response::Error(ErrorBody { code: ErrorCode::NotFound, message: String::new() })).unwrap(),
        vec![9, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
}

#[test]
fn documented_bulk_messages() {
    let blocks = doc_blocks("### 11.10 TCP bulk channel");
    assert_eq!(blocks.len(), 4, "notation, request, answer, envelope");
    let ask = Request::BulkAttach(BulkAttachRequest { plaintext: true });
    assert_eq!(dump(blocks[1]), crate::frame::encode_frame(&ask).unwrap());
    assert_eq!(crate::message_tag(&codec::encode(&ask).unwrap()), Some(31));
    let offer = Response::BulkOffer(BulkOffer { port: 7100, token: vec![0xab; 32], tls: false, expires_ms: 10_000 });
    assert_eq!(dump(blocks[2]), crate::frame::encode_frame(&offer).unwrap());
    let get = crate::frame::encode_frame(&Request::Get(KeysRequest { keys: vec![b"k".to_vec()] })).unwrap();
    let mut envelope = (get.len() as u64).to_le_bytes().to_vec();
    envelope.extend_from_slice(&get);
    assert_eq!(dump(blocks[3]), envelope);
    assert_eq!(REQUEST_TAGS, 32);
}
