//! `kvpool-server` command line: effective config from kvpool, Mooncake and HIXL files.

use kvpool_tests::bin;
use std::process::Command;

#[test]
fn print_config_maps_mooncake_and_hixl_fields_and_names_unknown_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mooncake = dir.path().join("mooncake_store_config.json");
    std::fs::write(
        &mooncake,
        r#"{"local_hostname":"10.1.2.3","metadata_server":"http://127.0.0.1:8080/metadata",
            "master_server_address":"127.0.0.1:50051","global_segment_size":"2GiB",
            "local_buffer_size":268435456,"protocol":"tcp","device_name":"","mystery_knob":7}"#,
    )
    .unwrap();
    let hixl = dir.path().join("hixl_transfer_config.toml");
    std::fs::write(&hixl, "[hixl]\ndevice_id = 2\nlink_type = \"roce\"\nwat = 1\n").unwrap();
    let out = Command::new(bin("kvpool-server"))
        .arg("--print-config")
        .env("MOONCAKE_CONFIG_PATH", &mooncake)
        .env("HIXL_CONFIG_PATH", &hixl)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("listen = \"127.0.0.1:50051\""), "{stdout}");
    assert!(stdout.contains("size = \"2.0 GiB\""), "{stdout}");
    assert!(stdout.contains("protocol_desc = \"roce:device\""), "{stdout}");
    assert!(stdout.contains("device_id = 2"), "{stdout}");
    assert!(stderr.contains("mystery_knob") && stderr.contains("wat"), "{stderr}");

    // a bad size is one clear error line and a non-zero exit
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[dram]\nsize = \"lots\"\n").unwrap();
    let out = Command::new(bin("kvpool-server")).arg("--config").arg(&bad).arg("--print-config").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("lots"));
}

#[test]
fn ascend_protocol_fails_at_start_naming_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let hixl = dir.path().join("hixl.toml");
    std::fs::write(&hixl, "[hixl]\ndevice_id = 0\n").unwrap();
    let out = Command::new(bin("kvpool-server"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--metrics-listen")
        .arg("off")
        .env("HIXL_CONFIG_PATH", &hixl)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("libcann_hixl.so"), "{stderr}");
}
