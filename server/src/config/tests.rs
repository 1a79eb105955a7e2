//! Loading the kvpool TOML and the neighbours' files.

use super::*;
use std::io::Write;

fn file(text: &str, ext: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(ext).tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn cluster_settings_are_checked() {
    let invalid =
        |text: &str| match load(Some(file(text, ".toml").path()), None, None).and_then(|l| l.config.validate()) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("{text}: {other:?}"),
        };
    let ok = |text: &str| load(Some(file(text, ".toml").path()), None, None).unwrap().config.validate().unwrap();
    // A storage node must know its master, how to trust it, and a key for it.
    assert_eq!(invalid("[cluster]\nrole = \"storage\"\n"), "cluster.master");
    assert_eq!(invalid("[cluster]\nrole = \"storage\"\nmaster = \"m:1\"\n"), "cluster.master_fingerprint");
    assert_eq!(
        invalid("[cluster]\nrole = \"storage\"\nmaster = \"m:1\"\nmaster_ca = \"ca.pem\"\n"),
        "cluster.master_key_file"
    );
    ok("[cluster]\nrole = \"storage\"\nmaster = \"m:1\"\nmaster_ca = \"ca.pem\"\nmaster_key_file = \"k\"\n");
    // With etcd, the leader's address and fingerprint come from there.
    ok("[cluster]\nrole = \"storage\"\netcd = \"http://127.0.0.1:2379\"\nmaster_key_file = \"k\"\n");
    assert_eq!(invalid("[cluster]\nrole = \"master\"\netcd = \"https://x:1\"\n"), "cluster.etcd");
    // It reports through the event log, so the log must be on.
    assert_eq!(
        invalid("[events]\nbuffer = 0\n[cluster]\nrole = \"storage\"\netcd = \"h:1\"\nmaster_key_file = \"k\"\n"),
        "events.buffer"
    );
    assert_eq!(invalid("[cluster]\nleader_ttl_s = 0\n"), "cluster.leader_ttl_s");
    assert_eq!(
        invalid("[cluster]\nreport_ms = 500\nnode_timeout_ms = 900\n"),
        "cluster.report_ms / cluster.node_timeout_ms"
    );
    assert!(load(Some(file("[cluster]\nrole = \"sideways\"\n", ".toml").path()), None, None).is_err());
}

/// The record keeps key lengths in 2 bytes and sizes in 4: limits past them are refused.
#[test]
fn limits_fit_the_record() {
    let check = |text: &str| load(Some(file(text, ".toml").path()), None, None).and_then(|l| l.config.validate());
    assert!(check("[limits]\nmax_key_len = 65535\n").is_ok());
    assert!(matches!(
        check("[limits]\nmax_key_len = 65536\n"),
        Err(ConfigError::Invalid { field: "limits.max_key_len", .. })
    ));
    assert!(matches!(
        check("[limits]\nmax_value_size = \"4GiB\"\n"),
        Err(ConfigError::Invalid { field: "limits.max_value_size", .. })
    ));
}

#[test]
fn sizes_parse() {
    assert_eq!(Size::parse("4GiB").unwrap().0, 4 << 30);
    assert_eq!(Size::parse("4GB").unwrap().0, 4_000_000_000);
    assert_eq!(Size::parse("1024").unwrap().0, 1024);
    assert!(Size::parse("lots").is_err());
}

#[test]
fn kvpool_toml_with_unknown_fields_warns() {
    let f = file("[dram]\nsize = \"64MiB\"\nbogus = 1\n[nonsense]\nx = 2\n", ".toml");
    let l = load(Some(f.path()), None, None).unwrap();
    assert_eq!(l.config.dram.size.0, 64 << 20);
    assert!(l.warnings.iter().any(|w| w.contains("dram.bogus")), "{:?}", l.warnings);
    assert!(l.warnings.iter().any(|w| w.contains("nonsense")), "{:?}", l.warnings);
}

#[test]
fn mooncake_and_hixl_map() {
    let m = file(
        r#"{"local_hostname":"10.0.0.1","metadata_server":"etcd://127.0.0.1:2379","master_server_address":"127.0.0.1:50051",
            "global_segment_size":"2GiB","local_buffer_size":1073741824,"protocol":"tcp","device_name":"",
            "enable_batch_transfer":true,"batch_size":64,"transfer_engine":{"backend":"tcp","num_workers":4},"shiny":true}"#,
        ".json",
    );
    let h = file(
        "[hixl]\ndevice_type=\"npu\"\ndevice_id=3\nlink_type=\"hccs\"\ntimeout_ms=3000\nretry_times=2\nfoo=1\n[hixl.batch]\nenable=true\nmax_batch_size=32\nmerge_threshold=\"1MiB\"\n",
        ".toml",
    );
    let l = load(None, Some(m.path()), None).unwrap();
    assert_eq!(l.config.dram.size.0, 2 << 30);
    assert_eq!(l.config.server.listen, "127.0.0.1:50051");
    assert_eq!(l.config.transport.protocol, Protocol::Shm);
    assert!(l.warnings.iter().any(|w| w.contains("shiny")));
    let l = load(None, None, Some(h.path())).unwrap();
    assert_eq!(l.config.transport.protocol, Protocol::Ascend);
    assert_eq!(l.config.transport.device_id, Some(3));
    assert_eq!(l.config.transport.hixl.as_ref().unwrap().protocol_desc.as_deref(), Some("hccs:device"));
    assert!(l.warnings.iter().any(|w| w.contains("foo")));
    // The same HIXL file through --config is recognised by content.
    let l = load(Some(h.path()), None, None).unwrap();
    assert_eq!(l.config.transport.max_batch_size, Some(32));
}

#[test]
fn quic_drivers_parse() {
    let load_text = |text: &str| load(Some(file(text, ".toml").path()), None, None);
    let cfg = load_text("[quic]\ndrivers = \"io-thread\"\n").unwrap().config;
    assert_eq!(cfg.quic.tuning().drivers, kvpool_net::Drivers::IoThread);
    assert_eq!(load_text("").unwrap().config.quic.tuning().drivers, kvpool_net::Drivers::Caller);
    assert!(load_text("[quic]\ndrivers = \"everywhere\"\n").is_err());
}
