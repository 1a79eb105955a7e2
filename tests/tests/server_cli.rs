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

/// `kvpool-server` with `protocol = "ascend"` (from a HIXL file) and `KVPOOL_HIXL_SHIM` as given
/// (`None`: unset).
fn ascend_server(dir: &std::path::Path, shim: Option<&str>) -> Command {
    let hixl = dir.join("hixl.toml");
    std::fs::write(&hixl, "[hixl]\ndevice_id = 0\nlink_type = \"hccs\"\ntimeout_ms = 3000\nnum_workers = 2\n").unwrap();
    let mut cmd = Command::new(bin("kvpool-server"));
    cmd.arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--metrics-listen")
        .arg("off")
        .arg("--dram-size")
        .arg("16MiB")
        .env("HIXL_CONFIG_PATH", &hixl)
        .env("NO_COLOR", "1")
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("ASCEND_TOOLKIT_HOME");
    match shim {
        Some(s) => cmd.env("KVPOOL_HIXL_SHIM", s),
        None => cmd.env_remove("KVPOOL_HIXL_SHIM"),
    };
    cmd
}

#[test]
fn ascend_protocol_fails_at_start_naming_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    // No shim (this build has none: no CANN here): start-up stops and names the library.
    let out = ascend_server(dir.path(), None).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("libkvpool_hixl_shim.so") && stderr.contains("libcann_hixl.so"), "{stderr}");
    assert!(stderr.contains("transport \"ascend\" is not available"), "{stderr}");

    // A library of another ABI version is refused by name too.
    let abi999 =
        kvpool_hixl::standin_library().replace("libkvpool_hixl_standin.so", "libkvpool_hixl_standin_abi999.so");
    let out = ascend_server(dir.path(), Some(&abi999)).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ABI version 999") && stderr.contains(&abi999), "{stderr}");
}

#[test]
fn ascend_protocol_starts_the_hixl_engine_when_the_shim_loads() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    // The stand-in implements the shim's ABI over shared memory: the server loads it, maps the
    // HIXL settings, starts the engine, and serves.
    let mut child = ascend_server(dir.path(), Some(kvpool_hixl::standin_library()))
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !log.contains("connect with") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                log.push_str(&l);
                log.push('\n');
            }
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start:\n{log}");
            }
        }
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(log.contains("HIXL engine started") && log.contains("standin"), "{log}");
    assert!(log.contains("stand-in, not HIXL"), "{log}");
    // The server installs its SIGTERM handler just after that log line: an early signal kills it.
    use std::os::unix::process::ExitStatusExt;
    assert!(status.success() || status.signal() == Some(libc::SIGTERM), "{status:?}\n{log}");
}
