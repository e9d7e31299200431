use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use super::*;
use crate::report::QuotaInfo;
use crate::report::{NotReadyRef, ObjectRef, RemoteHealth};

/// The value of the series `series` (name and labels as exposed), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn round(n: usize, error: Option<&str>) -> RoundReport {
    let object = |id: &str| ObjectRef {
        kind: Kind::Layer,
        id: id.into(),
    };
    RoundReport {
        started: SystemTime::now() - Duration::from_secs(2),
        duration: Duration::from_millis(3),
        added: (0..n).map(|i| object(&format!("a{i}"))).collect(),
        removed: vec![object("gone")],
        changed: vec![],
        ready_layers: 5,
        ready_images: 2,
        not_ready: vec![
            NotReadyRef {
                kind: Kind::Layer,
                name: "x".into(),
                reason: "layer.json: incomplete flag set (pull or import unfinished)".into(),
            },
            NotReadyRef {
                kind: Kind::Layer,
                name: "y".into(),
                reason: "layer.json: incomplete flag set (pull or import unfinished)".into(),
            },
            NotReadyRef {
                kind: Kind::Image,
                name: "z".into(),
                reason: format!("top layer {}: not ready (missing)", "f".repeat(64)),
            },
        ],
        error: error.map(str::to_owned),
    }
}

struct Fake {
    status: Mutex<Status>,
}

impl Fake {
    fn new() -> Arc<Fake> {
        Arc::new(Fake {
            status: Mutex::new(Status {
                mountpoint: "/m".into(),
                remote: "/r".into(),
                local: "/l".into(),
                driver: "overlay".into(),
                socket: String::new(),
                refresh_interval_secs: 5.0,
                rounds: 1,
                remote_health: RemoteHealth {
                    healthy: true,
                    since: SystemTime::now(),
                    last_error: None,
                },
                last_round: Some(round(2, None)),
                quotas: vec![QuotaInfo {
                    path: "overlay/c1/diff".into(),
                    limit: 1 << 20,
                    used: 8192,
                    available: (1 << 20) - 8192,
                    inode_limit: Some(100),
                    inodes_used: 3,
                    backend: "fuse".into(),
                }],
                metrics: None,
                transport: None,
                log: None,
                daemon_pid: 4242,
                keeper: None,
                journal: None,
            }),
        })
    }
}

impl Sources for Fake {
    fn status(&self) -> Status {
        self.status.lock().clone()
    }
    fn inodes(&self) -> InodeCounts {
        InodeCounts {
            nodes: 42,
            identities: 40,
        }
    }
}

struct Tables;

impl FsTables for Tables {
    fn open_handles(&self) -> usize {
        7
    }
    fn backing_files(&self) -> usize {
        2
    }
}

#[test]
fn requests_count_by_opcode_with_latency_and_errnos() {
    let m = Metrics::new();
    m.request("lookup", Duration::from_micros(20), None);
    m.request("lookup", Duration::from_micros(40), Some(libc::ENOENT));
    m.request("lookup", Duration::from_millis(3), None);
    m.request("write", Duration::from_micros(5), Some(libc::ENOSPC));
    // Not in the list of known opcodes: counted all the same.
    m.request("someday", Duration::from_micros(5), Some(9999));
    let text = m.encode().unwrap();

    assert!(
        text.contains("# TYPE layerfs_requests_total counter"),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"layerfs_requests_total{op="lookup"}"#),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_requests_total{op="write"}"#),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_requests_total{op="someday"}"#),
        Some(1.0)
    );
    // Opcodes never seen have no series.
    assert_eq!(
        sample(&text, r#"layerfs_requests_total{op="rename"}"#),
        None
    );

    assert!(text.contains("# TYPE layerfs_request_duration_seconds histogram"));
    let h = |le: &str| {
        sample(
            &text,
            &format!(r#"layerfs_request_duration_seconds_bucket{{op="lookup",le="{le}"}}"#),
        )
    };
    assert_eq!(h("1e-05"), Some(0.0));
    assert_eq!(h("2.5e-05"), Some(1.0));
    assert_eq!(h("5e-05"), Some(2.0));
    assert_eq!(h("0.0025"), Some(2.0));
    assert_eq!(h("0.005"), Some(3.0));
    assert_eq!(h("+Inf"), Some(3.0));
    assert_eq!(
        sample(
            &text,
            r#"layerfs_request_duration_seconds_count{op="lookup"}"#
        ),
        Some(3.0)
    );
    let sum = sample(
        &text,
        r#"layerfs_request_duration_seconds_sum{op="lookup"}"#,
    )
    .unwrap();
    assert!((sum - 0.00306).abs() < 1e-9, "{sum}");

    assert!(text.contains("# TYPE layerfs_request_errors_total counter"));
    assert_eq!(
        sample(
            &text,
            r#"layerfs_request_errors_total{op="lookup",errno="ENOENT"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_request_errors_total{op="write",errno="ENOSPC"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_request_errors_total{op="someday",errno="other"}"#
        ),
        Some(1.0)
    );
}

#[test]
fn state_metrics_are_absent_until_there_is_a_source() {
    let m = Metrics::new();
    let text = m.encode().unwrap();
    for absent in [
        "layerfs_inodes",
        "layerfs_open_handles",
        "layerfs_remote_pool_queued",
        "layerfs_quota_limit_bytes",
    ] {
        assert!(!text.contains(absent), "{absent} in {text}");
    }
    m.remote_pool(3, 8);
    m.set_fs_tables(Arc::new(Tables));
    let text = m.encode().unwrap();
    assert_eq!(sample(&text, "layerfs_remote_pool_queued"), Some(3.0));
    assert_eq!(sample(&text, "layerfs_remote_pool_running"), Some(8.0));
    assert_eq!(sample(&text, "layerfs_open_handles"), Some(7.0));
    assert_eq!(
        sample(&text, "layerfs_passthrough_backing_files"),
        Some(2.0)
    );
}

#[test]
fn state_is_read_from_the_sources_at_scrape_time() {
    let m = Metrics::new();
    let fake = Fake::new();
    m.set_sources(fake.clone());
    let text = m.encode().unwrap();

    assert_eq!(sample(&text, "layerfs_remote_healthy"), Some(1.0));
    assert_eq!(sample(&text, "layerfs_inodes"), Some(42.0));
    assert_eq!(sample(&text, "layerfs_inode_identities"), Some(40.0));
    assert_eq!(
        sample(&text, r#"layerfs_ready_objects{kind="layer"}"#),
        Some(5.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_ready_objects{kind="image"}"#),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_not_ready_objects{kind="layer",reason="incomplete"}"#
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_not_ready_objects{kind="image",reason="top_layer"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_not_ready_objects{kind="layer",reason="lower"}"#
        ),
        Some(0.0)
    );
    let root = r#"{root="overlay/c1/diff"}"#;
    assert_eq!(
        sample(&text, &format!("layerfs_quota_limit_bytes{root}")),
        Some(1048576.0)
    );
    assert_eq!(
        sample(&text, &format!("layerfs_quota_used_bytes{root}")),
        Some(8192.0)
    );
    assert_eq!(
        sample(&text, &format!("layerfs_quota_inode_limit{root}")),
        Some(100.0)
    );
    assert_eq!(
        sample(&text, &format!("layerfs_quota_inodes_used{root}")),
        Some(3.0)
    );
    let age = sample(&text, "layerfs_refresh_last_success_age_seconds").unwrap();
    assert!((1.9..10.0).contains(&age), "{age}");

    // A root that goes away takes its series with it; health follows the status.
    {
        let mut status = fake.status.lock();
        status.quotas.clear();
        status.remote_health.healthy = false;
    }
    let text = m.encode().unwrap();
    assert!(!text.contains("overlay/c1/diff"), "{text}");
    assert_eq!(sample(&text, "layerfs_remote_healthy"), Some(0.0));
}

#[test]
fn the_journal_is_exposed_once_followed_and_its_totals_count_up() {
    let m = Metrics::new();
    let fake = Fake::new();
    m.set_sources(fake.clone());
    let text = m.encode().unwrap();
    assert!(!text.contains("layerfs_journal_following"), "{text}");

    let mut journal = crate::report::JournalInfo {
        state: crate::report::JournalState::Following,
        named: 7,
        torn: 1,
        gaps: 1,
        ..Default::default()
    };
    fake.status.lock().journal = Some(journal.clone());
    let text = m.encode().unwrap();
    assert_eq!(sample(&text, "layerfs_journal_following"), Some(1.0));
    assert_eq!(
        sample(&text, "layerfs_journal_named_objects_total"),
        Some(7.0)
    );
    assert_eq!(sample(&text, "layerfs_journal_torn_lines_total"), Some(1.0));

    journal.state = crate::report::JournalState::Stalled;
    journal.named = 9;
    fake.status.lock().journal = Some(journal);
    let text = m.encode().unwrap();
    assert_eq!(sample(&text, "layerfs_journal_following"), Some(0.0));
    assert_eq!(
        sample(&text, "layerfs_journal_named_objects_total"),
        Some(9.0)
    );
    assert_eq!(sample(&text, "layerfs_journal_gaps_total"), Some(1.0));
}

#[test]
fn rounds_are_derived_from_the_status_until_they_are_pushed() {
    let m = Metrics::new();
    let fake = Fake::new();
    m.set_sources(fake.clone());
    let text = m.encode().unwrap();
    assert_eq!(sample(&text, "layerfs_refresh_rounds_total"), Some(1.0));
    assert_eq!(
        sample(&text, r#"layerfs_refresh_changes_total{kind="added"}"#),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_refresh_changes_total{kind="removed"}"#),
        Some(1.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_refresh_changes_total{kind="changed"}"#),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "layerfs_refresh_round_duration_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_refresh_round_duration_seconds_bucket{le="0.005"}"#
        ),
        Some(1.0)
    );

    // The same round seen again is not counted again.
    let text = m.encode().unwrap();
    assert_eq!(
        sample(&text, "layerfs_refresh_round_duration_seconds_count"),
        Some(1.0)
    );

    // Once rounds are pushed, every pushed round counts and the status only moves the
    // round total.
    let pushed = round(1, Some("remote not answering"));
    m.refresh_round(&pushed);
    {
        let mut status = fake.status.lock();
        status.rounds = 2;
        status.last_round = Some(pushed);
    }
    let text = m.encode().unwrap();
    assert_eq!(sample(&text, "layerfs_refresh_rounds_total"), Some(2.0));
    assert_eq!(
        sample(&text, "layerfs_refresh_round_duration_seconds_count"),
        Some(2.0)
    );
    assert_eq!(
        sample(&text, r#"layerfs_refresh_changes_total{kind="added"}"#),
        Some(3.0)
    );
    // The failed round does not move the last success.
    let age = sample(&text, "layerfs_refresh_last_success_age_seconds").unwrap();
    assert!((1.9..10.0).contains(&age), "{age}");
}

#[test]
fn every_metric_has_help_and_type() {
    let m = Metrics::new();
    m.set_sources(Fake::new());
    m.set_fs_tables(Arc::new(Tables));
    m.remote_pool(0, 0);
    m.request("lookup", Duration::from_micros(1), Some(libc::ENOENT));
    let text = m.encode().unwrap();
    let typed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .collect();
    let mut names: Vec<&str> = typed.iter().filter_map(|t| t.split(' ').next()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "layerfs_inode_identities",
            "layerfs_inodes",
            "layerfs_not_ready_objects",
            "layerfs_open_handles",
            "layerfs_passthrough_backing_files",
            "layerfs_quota_inode_limit",
            "layerfs_quota_inodes_used",
            "layerfs_quota_limit_bytes",
            "layerfs_quota_used_bytes",
            "layerfs_ready_objects",
            "layerfs_refresh_changes_total",
            "layerfs_refresh_last_success_age_seconds",
            "layerfs_refresh_round_duration_seconds",
            "layerfs_refresh_rounds_total",
            "layerfs_remote_healthy",
            "layerfs_remote_pool_queued",
            "layerfs_remote_pool_running",
            "layerfs_request_duration_seconds",
            "layerfs_request_errors_total",
            "layerfs_requests_total",
        ]
    );
    for name in names {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "no help for {name}"
        );
    }
    // Every sample line is `name{labels} value` with a number for the value.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "{line}");
    }
}

fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

#[test]
fn the_server_answers_on_an_ephemeral_port() {
    let metrics = Arc::new(Metrics::new());
    metrics.request("getattr", Duration::from_micros(12), None);
    let server = serve("127.0.0.1:0".parse().unwrap(), metrics.clone()).unwrap();
    let addr = server.local_addr();
    assert_ne!(addr.port(), 0);

    let (head, body) = http_get(addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert_eq!(
        sample(&body, r#"layerfs_requests_total{op="getattr"}"#),
        Some(1.0)
    );
    let (head, _) = http_get(addr, "/");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");

    // A second server cannot have the same address, and says which.
    let err = serve(addr, metrics).unwrap_err().to_string();
    assert!(err.contains(&addr.to_string()), "{err}");

    drop(server);
    assert!(
        TcpStream::connect(addr).is_err(),
        "still listening after drop"
    );
}

#[test]
fn concurrent_requests_are_all_counted() {
    let m = Arc::new(Metrics::new());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let m = m.clone();
            std::thread::spawn(move || {
                for i in 0..10_000u64 {
                    m.request("read", Duration::from_nanos(i * 1000), None);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let text = m.encode().unwrap();
    assert_eq!(
        sample(&text, r#"layerfs_requests_total{op="read"}"#),
        Some(40_000.0)
    );
    assert_eq!(
        sample(
            &text,
            r#"layerfs_request_duration_seconds_bucket{op="read",le="+Inf"}"#
        ),
        Some(40_000.0)
    );
}
