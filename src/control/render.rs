//! Human-readable output of the control commands. Every function takes `now` (seconds since
//! the epoch) so that "12s ago" can be tested.

use std::fmt::Write;

use super::when::{millis, ms, seconds, secs, when};
use crate::quota::size::human;
use crate::report::{
    ImageInfo, JournalInfo, JournalState, Kind, LayerInfo, QuotaInfo, RoundReport, Status,
};

/// Ids in table columns that point elsewhere (parents, top layers) are cut to this many
/// characters, as `docker` does; the full id is in the `ID` column of the other table.
const SHORT_ID: usize = 12;

/// The `journal` line of `status`.
fn journal(j: &JournalInfo, now: f64) -> String {
    let since = when(secs(j.since), now);
    let mut text = match j.state {
        JournalState::Starting => "starting".to_owned(),
        JournalState::Following => format!(
            "following since {since} (bell read every {}; light scans between records)",
            millis(j.poll_ms as f64)
        ),
        JournalState::Absent => {
            "none in the remote (no publisher): full scans every round".to_owned()
        }
        JournalState::Stalled => format!("STALLED since {since}: full scans every round"),
        JournalState::Failing => format!("UNREADABLE since {since}: full scans every round"),
    };
    if let Some(detail) = &j.detail {
        let _ = write!(text, " ({detail})");
    }
    if let Some(publisher) = &j.last_publisher {
        let _ = write!(
            text,
            "; last ring by {publisher} {}",
            when(j.last_ring_ms as f64 / 1000.0, now)
        );
    }
    let _ = write!(
        text,
        "; {} named, {} torn, {} gap{}",
        j.named,
        j.torn,
        j.gaps,
        if j.gaps == 1 { "" } else { "s" }
    );
    text
}

/// `layerfs status`: what the mount is, how its remote is, what the last round found, and
/// why each object that is not shown is not ready.
pub fn status(s: &Status, now: f64) -> String {
    let mut out = String::new();
    let mut line = |label: &str, value: &str| {
        let _ = writeln!(out, "{label:<12}{value}");
    };
    line("mountpoint", &s.mountpoint);
    let health = &s.remote_health;
    let remote = if health.healthy {
        format!(
            "{}: healthy since {}",
            s.remote,
            when(secs(health.since), now)
        )
    } else {
        format!(
            "{}: NOT ANSWERING since {}{}",
            s.remote,
            when(secs(health.since), now),
            health
                .last_error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        )
    };
    line("remote", &remote);
    line("local", &s.local);
    line("driver", &s.driver);
    line("socket", &s.socket);
    if let Some(addr) = &s.metrics {
        line("metrics", &format!("http://{addr}/metrics"));
    }
    if let Some(transport) = &s.transport {
        line("requests", &format!("through {transport}"));
    }
    if let Some(log) = &s.log {
        line("log", log);
    }
    match &s.keeper {
        Some(k) => line(
            "daemon",
            &format!(
                "pid {}, kept by pid {} ({} restart{})",
                s.daemon_pid,
                k.pid,
                k.restarts,
                if k.restarts == 1 { "" } else { "s" }
            ),
        ),
        None => line("daemon", &format!("pid {}", s.daemon_pid)),
    }
    let interval = if s.refresh_interval_secs > 0.0 {
        format!("every {}", seconds(s.refresh_interval_secs))
    } else {
        "on demand only".to_owned()
    };
    line(
        "refresh",
        &format!(
            "{interval}; {} since mounted",
            count(s.rounds as usize, "round")
        ),
    );
    if let Some(j) = &s.journal {
        line("journal", &journal(j, now));
    }
    match &s.last_round {
        None => {
            line("last round", "none yet");
        }
        Some(r) => {
            line(
                "last round",
                &format!(
                    "{}, took {}: {}",
                    when(secs(r.started), now),
                    millis(ms(r.duration)),
                    changes(r)
                ),
            );
            if let Some(e) = &r.error {
                line(
                    "",
                    &format!("remote scan failed: {e} (the view is as last seen)"),
                );
            }
            line(
                "ready",
                &format!(
                    "{}, {}",
                    count(r.ready_layers, "layer"),
                    count(r.ready_images, "image")
                ),
            );
            let layers = r.not_ready.iter().filter(|n| n.kind == Kind::Layer).count();
            let images = r.not_ready.len() - layers;
            let mut summary = format!("{}, {}", count(layers, "layer"), count(images, "image"));
            if !r.not_ready.is_empty() {
                summary.push(':');
            }
            line("not ready", &summary);
            for n in &r.not_ready {
                let _ = writeln!(out, "  {} {}: {}", n.kind, n.name, n.reason);
            }
        }
    }
    quota_summary(&mut out, &s.quotas);
    out
}

/// The `quotas` lines of `status`: a summary, and the roots with no room left by name (all
/// of them are in `layerfs quota list`; a host may have hundreds).
fn quota_summary(out: &mut String, roots: &[QuotaInfo]) {
    if roots.is_empty() {
        out.push_str("quotas      none\n");
        return;
    }
    let sum = |f: fn(&QuotaInfo) -> u64| roots.iter().map(f).fold(0u64, u64::saturating_add);
    let full: Vec<&QuotaInfo> = roots.iter().filter(|q| q.available == 0).collect();
    let by_btrfs = roots.iter().filter(|q| backend(q) == "btrfs").count();
    let backends = match by_btrfs {
        0 => String::new(),
        n if n == roots.len() => " (btrfs)".to_owned(),
        n => format!(" ({n} btrfs, {} fuse)", roots.len() - n),
    };
    let _ = write!(
        out,
        "quotas      {}{backends}, {} of {} used",
        count(roots.len(), "root"),
        human(sum(|q| q.used)),
        human(sum(|q| q.limit))
    );
    if full.is_empty() {
        out.push('\n');
    } else {
        let _ = writeln!(out, "; {} full:", full.len());
    }
    for q in full {
        let _ = writeln!(
            out,
            "  {}: {} of {} used",
            q.path,
            human(q.used),
            human(q.limit)
        );
    }
}

/// `layerfs refresh`: what the round changed.
pub fn round(r: &RoundReport) -> String {
    let mut out = format!("round took {}: {}\n", millis(ms(r.duration)), changes(r));
    for (mark, list) in [("+", &r.added), ("-", &r.removed), ("~", &r.changed)] {
        for o in list {
            let _ = writeln!(out, "  {mark} {} {}", o.kind, o.id);
        }
    }
    if let Some(e) = &r.error {
        let _ = writeln!(out, "remote scan failed: {e} (the view is as last seen)");
    }
    let _ = write!(
        out,
        "ready: {}, {}",
        count(r.ready_layers, "layer"),
        count(r.ready_images, "image")
    );
    if r.not_ready.is_empty() {
        out.push('\n');
    } else {
        let _ = writeln!(
            out,
            "; not ready: {} (`layerfs status` says why)",
            r.not_ready.len()
        );
    }
    out
}

/// `layerfs layers`: one row per ready layer.
pub fn layers(layers: &[LayerInfo]) -> String {
    let rows: Vec<[String; 3]> = layers
        .iter()
        .map(|l| {
            [
                l.id.clone(),
                l.short.clone(),
                l.parent.as_deref().map_or("-".to_owned(), cut),
            ]
        })
        .collect();
    table(["ID", "SHORT", "PARENT"], &rows)
}

/// `layerfs images`: one row per ready image.
pub fn images(images: &[ImageInfo]) -> String {
    let rows: Vec<[String; 3]> = images
        .iter()
        .map(|i| {
            let names = if i.names.is_empty() {
                "-".to_owned()
            } else {
                i.names.join(",")
            };
            [i.id.clone(), cut(&i.top_layer), names]
        })
        .collect();
    table(["ID", "TOP LAYER", "NAMES"], &rows)
}

/// `layerfs quota list`: one row per quota root, sizes as `df -h` shows them.
pub fn quotas(roots: &[QuotaInfo]) -> String {
    let rows: Vec<[String; 7]> = roots
        .iter()
        .map(|q| {
            [
                q.path.clone(),
                human(q.limit),
                human(q.used),
                human(q.available),
                percent(q.used, q.limit),
                inodes(q),
                backend(q).to_owned(),
            ]
        })
        .collect();
    table(
        [
            "PATH", "LIMIT", "USED", "AVAIL", "USE%", "INODES", "BACKEND",
        ],
        &rows,
    )
}

/// `layerfs quota get|set`: one root, exact bytes next to the short form.
pub fn quota(q: &QuotaInfo) -> String {
    let mut out = String::new();
    let mut line = |label: &str, value: &str| {
        let _ = writeln!(out, "{label:<11}{value}");
    };
    line("path", &q.path);
    line("limit", &bytes(q.limit));
    let mut used = bytes(q.used);
    if q.limit > 0 {
        let _ = write!(used, ", {} of the limit", percent(q.used, q.limit));
    }
    line("used", &used);
    line("available", &bytes(q.available));
    let inodes = match q.inode_limit {
        _ if backend(q) == "btrfs" => "not counted (btrfs quotas count bytes)".to_owned(),
        Some(limit) => format!("{} used of {limit}", q.inodes_used),
        None => format!("{} used, no limit", q.inodes_used),
    };
    line("inodes", &inodes);
    line("backend", backend(q));
    out
}

/// Who enforces a root: a mount from before kernel quotas does not say, and meant `fuse`.
fn backend(q: &QuotaInfo) -> &str {
    match q.backend.as_str() {
        "" => "fuse",
        other => other,
    }
}

/// `layerfs quota clear`: the root as it was.
pub fn quota_cleared(q: &QuotaInfo) -> String {
    format!(
        "quota of {} cleared (limit was {}, {} used)\n",
        q.path,
        human(q.limit),
        human(q.used)
    )
}

/// `10G (10737418240 bytes)`.
fn bytes(n: u64) -> String {
    if n < 1024 {
        count(n as usize, "byte")
    } else {
        format!("{} ({n} bytes)", human(n))
    }
}

/// Rounded up, as `df` does, so a root that is at all over 99 % does not read as 99 %. A
/// zero limit has no percentage.
fn percent(used: u64, limit: u64) -> String {
    if limit == 0 {
        return "-".to_owned();
    }
    let p = (u128::from(used) * 100).div_ceil(u128::from(limit));
    format!("{p}%")
}

/// `used/limit`, or just what is used when inodes are not limited.
fn inodes(q: &QuotaInfo) -> String {
    match q.inode_limit {
        Some(limit) => format!("{}/{limit}", q.inodes_used),
        None => q.inodes_used.to_string(),
    }
}

fn table<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut push = |cells: Vec<&str>| {
        let mut line = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    };
    push(header.to_vec());
    for row in rows {
        push(row.iter().map(String::as_str).collect());
    }
    out
}

fn cut(id: &str) -> String {
    id.chars().take(SHORT_ID).collect()
}

fn changes(r: &RoundReport) -> String {
    format!(
        "{} added, {} removed, {} changed",
        r.added.len(),
        r.removed.len(),
        r.changed.len()
    )
}

/// `1 layer`, `2 layers`.
fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Pretty JSON with a final newline, for `--json`.
pub fn json(value: &serde_json::Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_default();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{NotReadyRef, ObjectRef, RemoteHealth};
    use std::time::{Duration, SystemTime};

    const T0: f64 = 1_714_564_803.0; // 2024-05-01 12:00:03 UTC

    fn at(secs: f64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs_f64(secs)
    }

    fn round_view() -> RoundReport {
        RoundReport {
            started: at(T0),
            duration: Duration::from_micros(3250),
            added: vec![ObjectRef {
                kind: Kind::Image,
                id: "39c4".into(),
            }],
            removed: vec![],
            changed: vec![ObjectRef {
                kind: Kind::Layer,
                id: "7f54".into(),
            }],
            ready_layers: 4,
            ready_images: 1,
            not_ready: vec![
                NotReadyRef {
                    kind: Kind::Layer,
                    name: "cf2e".into(),
                    reason: "layer.json has \"incompelte\": true".into(),
                },
                NotReadyRef {
                    kind: Kind::Image,
                    name: "3cc6".into(),
                    reason: "top layer a4ef does not exist".into(),
                },
            ],
            error: None,
        }
    }

    fn status_view() -> Status {
        Status {
            mountpoint: "/var/lib/isulad/storage".into(),
            remote: "/mnt/nfs".into(),
            local: "/var/lib/layerfs".into(),
            driver: "overlay".into(),
            socket: "/run/layerfs/mounts/var-lib-isulad-storage.sock".into(),
            refresh_interval_secs: 5.0,
            rounds: 7,
            remote_health: RemoteHealth {
                healthy: true,
                since: at(T0 - 3600.0),
                last_error: None,
            },
            last_round: Some(round_view()),
            quotas: Vec::new(),
            metrics: None,
            transport: Some("/dev/fuse".into()),
            log: None,
            daemon_pid: 4242,
            keeper: None,
            journal: None,
        }
    }

    #[test]
    fn status_shows_where_the_log_goes() {
        let s = Status {
            log: Some("/var/log/layerfs/mnt-layers.log".into()),
            ..status_view()
        };
        let text = status(&s, T0 + 12.0);
        assert!(
            text.contains("\nlog         /var/log/layerfs/mnt-layers.log\n"),
            "{text}"
        );
    }

    #[test]
    fn status_shows_the_keeper_and_its_restarts() {
        let s = Status {
            keeper: Some(crate::report::KeeperInfo {
                pid: 7,
                restarts: 2,
                gap_ms: None,
            }),
            ..status_view()
        };
        let text = status(&s, T0 + 12.0);
        assert!(
            text.contains("\ndaemon      pid 4242, kept by pid 7 (2 restarts)\n"),
            "{text}"
        );
    }

    #[test]
    fn status_shows_the_request_transport() {
        let s = Status {
            transport: Some("io_uring".into()),
            ..status_view()
        };
        assert!(
            status(&s, T0 + 12.0).contains("\nrequests    through io_uring\n"),
            "{}",
            status(&s, T0 + 12.0)
        );
    }

    #[test]
    fn status_shows_where_metrics_are_served() {
        let s = Status {
            metrics: Some("127.0.0.1:9100".into()),
            ..status_view()
        };
        let text = status(&s, T0 + 12.0);
        assert!(
            text.contains("\nmetrics     http://127.0.0.1:9100/metrics\n"),
            "{text}"
        );
    }

    #[test]
    fn status_explains_every_object_that_is_not_ready() {
        let text = status(&status_view(), T0 + 12.0);
        let want = "\
mountpoint  /var/lib/isulad/storage
remote      /mnt/nfs: healthy since 2024-05-01 11:00:03 UTC (60m ago)
local       /var/lib/layerfs
driver      overlay
socket      /run/layerfs/mounts/var-lib-isulad-storage.sock
requests    through /dev/fuse
daemon      pid 4242
refresh     every 5s; 7 rounds since mounted
last round  2024-05-01 12:00:03 UTC (12s ago), took 3.2 ms: 1 added, 0 removed, 1 changed
ready       4 layers, 1 image
not ready   1 layer, 1 image:
  layer cf2e: layer.json has \"incompelte\": true
  image 3cc6: top layer a4ef does not exist
quotas      none
";
        assert_eq!(text, want);
    }

    #[test]
    fn status_shows_an_unhealthy_remote_and_a_failed_round() {
        let mut s = status_view();
        s.remote_health = RemoteHealth {
            healthy: false,
            since: at(T0),
            last_error: Some("Stale file handle".into()),
        };
        s.refresh_interval_secs = 0.0;
        let mut r = round_view();
        r.error = Some("scan timed out".into());
        r.not_ready.clear();
        s.last_round = Some(r);
        let text = status(&s, T0 + 300.0);
        assert!(text.contains(
            "remote      /mnt/nfs: NOT ANSWERING since 2024-05-01 12:00:03 UTC (5m ago): Stale file handle\n"
        ), "{text}");
        assert!(text.contains("refresh     on demand only;"), "{text}");
        assert!(
            text.contains("remote scan failed: scan timed out"),
            "{text}"
        );
        assert!(
            text.ends_with("not ready   0 layers, 0 images\nquotas      none\n"),
            "{text}"
        );
        s.last_round = None;
        assert!(status(&s, T0).contains("last round  none yet\n"));
    }

    #[test]
    fn refresh_lists_what_changed() {
        let text = round(&round_view());
        assert_eq!(
            text,
            "round took 3.2 ms: 1 added, 0 removed, 1 changed\n  + image 39c4\n  ~ layer 7f54\n\
             ready: 4 layers, 1 image; not ready: 2 (`layerfs status` says why)\n"
        );
    }

    #[test]
    fn tables_align() {
        let text = layers(&[
            LayerInfo {
                id: "aaaa".into(),
                short: "S1".into(),
                parent: None,
            },
            LayerInfo {
                id: "bb".into(),
                short: "S2".into(),
                parent: Some("aaaaaaaaaaaaaaaaaaaa".into()),
            },
        ]);
        assert_eq!(
            text,
            "ID    SHORT  PARENT\naaaa  S1     -\nbb    S2     aaaaaaaaaaaa\n"
        );
        let text = images(&[ImageInfo {
            id: "i".into(),
            top_layer: "t".into(),
            names: vec!["a:1".into(), "b:2".into()],
        }]);
        assert_eq!(text, "ID  TOP LAYER  NAMES\ni   t          a:1,b:2\n");
        assert_eq!(images(&[]), "ID  TOP LAYER  NAMES\n");
    }

    fn quota_info() -> QuotaInfo {
        QuotaInfo {
            path: "overlay/c1".into(),
            limit: 10 << 30,
            used: 4096,
            available: (10 << 30) - 4096,
            inode_limit: None,
            inodes_used: 3,
            backend: "btrfs".into(),
        }
    }

    #[test]
    fn quota_list_is_a_table() {
        let full = QuotaInfo {
            path: "overlay/c2".into(),
            limit: 8 << 20,
            used: 8 << 20,
            available: 0,
            inode_limit: Some(1000),
            inodes_used: 12,
            backend: "fuse".into(),
        };
        let zero = QuotaInfo {
            path: "volumes/v".into(),
            ..QuotaInfo::default()
        };
        assert_eq!(
            quotas(&[quota_info(), full, zero]),
            "\
PATH        LIMIT  USED  AVAIL  USE%  INODES   BACKEND
overlay/c1  10G    4.0K  10G    1%    3        btrfs
overlay/c2  8.0M   8.0M  0      100%  12/1000  fuse
volumes/v   0      0     0      -     0        fuse
"
        );
        assert_eq!(
            quotas(&[]),
            "PATH  LIMIT  USED  AVAIL  USE%  INODES  BACKEND\n"
        );
    }

    #[test]
    fn status_sums_quotas_and_names_full_roots() {
        let mut s = status_view();
        s.last_round = None;
        s.quotas = vec![
            quota_info(),
            QuotaInfo {
                path: "overlay/c2".into(),
                limit: 8 << 20,
                used: 8 << 20,
                ..QuotaInfo::default()
            },
        ];
        let text = status(&s, T0);
        assert!(
            text.ends_with(
                "last round  none yet\nquotas      2 roots (1 btrfs, 1 fuse), 8.1M of 11G used; \
                 1 full:\n  overlay/c2: 8.0M of 8.0M used\n"
            ),
            "{text}"
        );
        s.quotas.truncate(1);
        assert!(
            status(&s, T0).ends_with("quotas      1 root (btrfs), 4.0K of 10G used\n"),
            "{text}"
        );
    }

    #[test]
    fn one_quota_shows_exact_bytes() {
        assert_eq!(
            quota(&quota_info()),
            "\
path       overlay/c1
limit      10G (10737418240 bytes)
used       4.0K (4096 bytes), 1% of the limit
available  10G (10737414144 bytes)
inodes     not counted (btrfs quotas count bytes)
backend    btrfs
"
        );
        let q = QuotaInfo {
            limit: 0,
            used: 0,
            available: 0,
            inode_limit: Some(5),
            inodes_used: 1,
            backend: "fuse".into(),
            ..quota_info()
        };
        let text = quota(&q);
        assert!(text.contains("limit      0 bytes\n"), "{text}");
        assert!(text.contains("used       0 bytes\n"), "{text}");
        assert!(
            text.contains("inodes     1 used of 5\nbackend    fuse\n"),
            "{text}"
        );
        assert_eq!(
            quota_cleared(&quota_info()),
            "quota of overlay/c1 cleared (limit was 10G, 4.0K used)\n"
        );
    }

    #[test]
    fn percentages_round_up_and_can_pass_100() {
        assert_eq!(percent(0, 10), "0%");
        assert_eq!(percent(1, 1000), "1%");
        assert_eq!(percent(999, 1000), "100%");
        assert_eq!(percent(15, 10), "150%");
        assert_eq!(percent(u64::MAX, u64::MAX), "100%");
        assert_eq!(percent(5, 0), "-");
    }
}
