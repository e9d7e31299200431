//! Prometheus metrics on real mounts (`-o metrics=ADDR:PORT`, DESIGN §9): the address in
//! `status`, the exposition over HTTP, and the figures against what the mount reports
//! elsewhere.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

fn metrics_mount() -> Mount {
    Mount::with(
        Options {
            opts: "metrics=127.0.0.1:0".into(),
            ..Options::default()
        },
        |_| {},
    )
}

fn layerfs(args: &[&str], m: &Mount) -> String {
    let out = Command::new(BIN)
        .args(args)
        .arg(&m.mnt)
        .output()
        .expect("run layerfs");
    assert!(
        out.status.success(),
        "layerfs {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn status(m: &Mount) -> Value {
    serde_json::from_str(&layerfs(&["status", "--json"], m)).expect("status --json")
}

/// The metrics address, as `status` shows it.
fn address(m: &Mount) -> SocketAddr {
    let v = status(m);
    v["metrics"]
        .as_str()
        .unwrap_or_else(|| panic!("no metrics address in status: {v}"))
        .parse()
        .expect("an IP:PORT")
}

/// `GET path` over a fresh connection: status line and headers, and body.
fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics port");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    (head.to_owned(), body.to_owned())
}

fn scrape(addr: SocketAddr) -> String {
    let (head, body) = get(addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body
}

/// The value of one series (`name{labels}` exactly as exposed).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn must(text: &str, series: &str) -> f64 {
    value(text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

/// The sum of every series of `name` whose labels include `label`.
fn sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn status_names_the_address_and_the_exposition_matches_the_mount() {
    let m = metrics_mount();
    let addr = address(&m);
    assert!(addr.ip().is_loopback());
    assert_ne!(addr.port(), 0, "port 0 is replaced by the port bound");
    assert!(
        layerfs(&["status"], &m).contains(&format!("http://{addr}/metrics")),
        "status does not show the metrics address"
    );

    let (head, text) = get(addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let (head, _) = get(addr, "/nothing");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");

    // The remote and the refresh engine, as the fixture and `status` have them.
    let expected = expected();
    let n = |key: &str| expected[key].as_array().unwrap().len() as f64;
    assert_eq!(must(&text, "layerfs_remote_healthy"), 1.0);
    assert_eq!(
        must(&text, r#"layerfs_ready_objects{kind="layer"}"#),
        n("ready_layers")
    );
    assert_eq!(
        must(&text, r#"layerfs_ready_objects{kind="image"}"#),
        n("ready_images")
    );
    assert_eq!(
        sum(&text, "layerfs_not_ready_objects", r#"kind="layer""#),
        n("not_ready_layers")
    );
    assert_eq!(
        sum(&text, "layerfs_not_ready_objects", r#"kind="image""#),
        n("not_ready_images")
    );
    let rounds = status(&m)["rounds"].as_u64().unwrap() as f64;
    assert!(must(&text, "layerfs_refresh_rounds_total") >= 1.0);
    assert!(must(&text, "layerfs_refresh_rounds_total") <= rounds);
    let age = must(&text, "layerfs_refresh_last_success_age_seconds");
    assert!((0.0..60.0).contains(&age), "last success {age} s ago");
    assert!(must(&text, "layerfs_refresh_round_duration_seconds_count") >= 1.0);

    // The inode table follows what the kernel holds: every new name looked up is a node.
    let before = must(&text, "layerfs_inodes");
    assert!(before >= 1.0);
    assert!(must(&text, "layerfs_inode_identities") >= 1.0);
    let dir = m.path("metrics-files");
    fs::create_dir(&dir).unwrap();
    let files = 25;
    for i in 0..files {
        fs::write(dir.join(format!("f{i}")), b"x").unwrap();
    }
    let kept: Vec<fs::File> = (0..files)
        .map(|i| fs::File::open(dir.join(format!("f{i}"))).unwrap())
        .collect();
    let text = scrape(addr);
    let after = must(&text, "layerfs_inodes");
    assert!(
        after >= before + files as f64,
        "{files} new files, inodes {before} -> {after}"
    );
    assert!(must(&text, "layerfs_inode_identities") >= files as f64);
    drop(kept);
}

#[test]
fn quota_roots_show_their_limit_and_usage() {
    let m = metrics_mount();
    let addr = address(&m);
    let text = scrape(addr);
    assert!(
        !text.contains("layerfs_quota_limit_bytes{"),
        "a quota before any was set:\n{text}"
    );

    let rel = "overlay/metrics-c1";
    fs::create_dir_all(m.path(rel)).unwrap();
    let out = quota_cmd(&m, "set", &[rel, "8M"]);
    assert!(
        out.status.success(),
        "quota set: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut f = fs::File::create(m.path(&format!("{rel}/data"))).unwrap();
    f.write_all(&pattern(1 << 20, 7)).unwrap();
    f.sync_all().unwrap();
    drop(f);

    let out = quota_cmd(&m, "get", &[rel, "--json"]);
    assert!(out.status.success());
    let q: Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = scrape(addr);
    let root = format!(r#"{{root="{rel}"}}"#);
    assert_eq!(
        must(&text, &format!("layerfs_quota_limit_bytes{root}")),
        (8 << 20) as f64
    );
    let used = must(&text, &format!("layerfs_quota_used_bytes{root}"));
    assert_eq!(used, q["used"].as_u64().unwrap() as f64);
    assert!(used >= (1 << 20) as f64, "1 MiB written, {used} used");
    assert_eq!(
        must(&text, &format!("layerfs_quota_inodes_used{root}")),
        q["inodes_used"].as_u64().unwrap() as f64
    );
    // No inode limit was set: no series for one.
    assert_eq!(
        value(&text, &format!("layerfs_quota_inode_limit{root}")),
        None
    );

    let out = quota_cmd(&m, "clear", &[rel]);
    assert!(out.status.success());
    assert!(
        !scrape(addr).contains(&root),
        "a cleared root is still shown"
    );
}

#[test]
fn an_address_in_use_fails_the_mount_and_names_the_option() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (remote, local, mnt) = (
        dir.path().join("remote"),
        dir.path().join("local"),
        dir.path().join("mnt"),
    );
    for d in [&remote, &local, &mnt] {
        fs::create_dir(d).unwrap();
    }
    let out = Command::new(BIN)
        .arg("mount")
        .arg("--remote")
        .arg(&remote)
        .arg("--local")
        .arg(&local)
        .arg("-o")
        .arg(format!(
            "metrics={addr},log_file={}",
            dir.path().join("daemon.log").display()
        ))
        .arg(&mnt)
        .stdin(Stdio::null())
        .output()
        .expect("run layerfs");
    let mounted = is_mounted(&mnt);
    if mounted {
        let _ = Command::new("umount").arg(&mnt).status();
    }
    assert!(!mounted, "mounted although the metrics address is taken");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("metrics={addr}")), "{err}");
}

/// Needs the FUSE glue to report its requests (`Metrics::request`) and its tables
/// (`Metrics::set_fs_tables`).
#[test]
fn requests_are_counted_by_opcode() {
    let m = metrics_mount();
    let addr = address(&m);
    let dir = m.path("metrics-requests");
    fs::create_dir(&dir).unwrap();
    let full = dir.join("full");
    fs::create_dir(&full).unwrap();
    fs::write(full.join("keep"), b"x").unwrap();
    let before = scrape(addr);
    let count = |text: &str, series: &str| value(text, series).unwrap_or(0.0);

    let n = 20;
    for i in 0..n {
        // A name never seen is looked up by the daemon (a negative answer is a success).
        assert!(fs::symlink_metadata(dir.join(format!("absent{i}"))).is_err());
        fs::write(dir.join(format!("new{i}")), b"data").unwrap();
        // Only the daemon knows the directory is not empty: the kernel asks, and the
        // answer is an error.
        assert!(fs::remove_dir(&full).is_err());
    }
    let held = fs::File::open(dir.join("new0")).unwrap();
    // A request is counted once replied to: the last ones may be counted a moment after
    // the caller has moved on.
    let mut after = scrape(addr);
    let creates = r#"layerfs_requests_total{op="create"}"#;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while count(&after, creates) - count(&before, creates) < n as f64
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
        after = scrape(addr);
    }

    for (series, at_least) in [
        (r#"layerfs_requests_total{op="lookup"}"#, n),
        (r#"layerfs_requests_total{op="create"}"#, n),
        (r#"layerfs_requests_total{op="rmdir"}"#, n),
        (
            r#"layerfs_request_errors_total{op="rmdir",errno="ENOTEMPTY"}"#,
            n,
        ),
        (r#"layerfs_request_duration_seconds_count{op="lookup"}"#, n),
        (r#"layerfs_request_duration_seconds_count{op="create"}"#, n),
    ] {
        let grew = count(&after, series) - count(&before, series);
        assert!(grew >= at_least as f64, "{series} grew by {grew}");
    }
    assert_eq!(
        value(
            &after,
            r#"layerfs_request_errors_total{op="create",errno="ENOENT"}"#
        ),
        None,
        "successful creates counted as errors"
    );
    assert!(must(&after, "layerfs_open_handles") >= 1.0);
    assert!(value(&after, "layerfs_passthrough_backing_files").is_some());
    drop(held);
}

/// A created file's name stays in the kernel's cache for the entry timeout, whatever its
/// attributes do. A file created for writing with passthrough has its attributes kept a
/// moment only (its writes bypass the daemon), and the create reply gave its name the same
/// moment: removing the files soon after cost a LOOKUP each.
#[test]
fn a_created_name_is_cached_for_the_entry_timeout() {
    let m = metrics_mount();
    let addr = address(&m);
    let dir = m.path("created-names");
    fs::create_dir(&dir).unwrap();
    let n = 40;
    for i in 0..n {
        fs::write(dir.join(format!("f{i}")), b"data").unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    let lookup = r#"layerfs_requests_total{op="lookup"}"#;
    let before = value(&scrape(addr), lookup).unwrap_or(0.0);
    for i in 0..n {
        fs::remove_file(dir.join(format!("f{i}"))).unwrap();
    }
    let looked_up = value(&scrape(addr), lookup).unwrap_or(0.0) - before;
    assert!(
        looked_up < 4.0,
        "{looked_up} lookups to remove {n} new files"
    );
}
