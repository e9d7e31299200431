//! What a mount reports: how its remote is doing, what a refresh round did, its layers,
//! images and quota roots. The core fills these in; the control socket carries them as they
//! are (JSON), and the commands read them back with the same types. Every field has a
//! default, so a command and a daemon of different builds still understand each other.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::layout::ObjectKind;

/// One layer or image named in a report.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectRef {
    pub kind: Kind,
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Layer,
    Image,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Layer => "layer",
            Kind::Image => "image",
        })
    }
}

impl From<ObjectKind> for Kind {
    fn from(k: ObjectKind) -> Kind {
        match k {
            ObjectKind::Layer => Kind::Layer,
            ObjectKind::Image => Kind::Image,
        }
    }
}

/// An object that exists remotely but is not shown, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotReadyRef {
    pub kind: Kind,
    pub name: String,
    pub reason: String,
}

/// One refresh round.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RoundReport {
    #[serde(with = "unix_time")]
    pub started: SystemTime,
    #[serde(with = "millis")]
    pub duration: Duration,
    pub added: Vec<ObjectRef>,
    pub removed: Vec<ObjectRef>,
    pub changed: Vec<ObjectRef>,
    pub ready_layers: usize,
    pub ready_images: usize,
    pub not_ready: Vec<NotReadyRef>,
    /// Set when the round could not scan the remote (the previous index stayed in place).
    pub error: Option<String>,
}

/// Whether the remote answers, and since when it has been in that state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteHealth {
    pub healthy: bool,
    #[serde(with = "unix_time")]
    pub since: SystemTime,
    pub last_error: Option<String>,
}

/// A running mount's state, as `layerfs status` shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Status {
    pub mountpoint: String,
    pub remote: String,
    pub local: String,
    pub driver: String,
    /// The control socket's path.
    pub socket: String,
    /// Seconds between rounds; 0 = only on demand.
    pub refresh_interval_secs: f64,
    pub rounds: u64,
    pub remote_health: RemoteHealth,
    pub last_round: Option<RoundReport>,
    /// The mount's quota roots (filled in by the mount, not the refresh engine).
    pub quotas: Vec<QuotaInfo>,
    /// Where Prometheus metrics are served (`-o metrics=`), if they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// How requests reach the daemon: `io_uring` or `/dev/fuse` (filled in by the mount).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// Where the daemon's log goes: `the journal`, `stderr`, or a file's path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    /// The process serving the mount.
    pub daemon_pid: u32,
    /// The keeper holding the mount's connection, when it has one (`-o keeper`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keeper: Option<KeeperInfo>,
    /// How the mount follows the publication journal (DESIGN §14); `None` when it does not
    /// (`-o nojournal`, or refresh on demand only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalInfo>,
}

/// Whether a reader follows the remote's publication journal, or scans the remote instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalState {
    /// Not polled yet.
    #[default]
    Starting,
    /// The bell rings (a publisher is alive): rounds between records are light scans.
    Following,
    /// No journal in the remote: nobody publishes; full scans every round.
    Absent,
    /// The bell has been silent for longer than publishers' heartbeat allows: full scans.
    Stalled,
    /// The journal cannot be read: full scans.
    Failing,
}

/// A reader's view of the journal, as `status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct JournalInfo {
    pub state: JournalState,
    /// When it entered that state.
    #[serde(with = "unix_time")]
    pub since: SystemTime,
    /// Why it is not following (the error, or how long the bell has been silent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The publisher that rang last, and when (its clock, milliseconds since the epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_publisher: Option<String>,
    pub last_ring_ms: u64,
    pub poll_ms: u64,
    pub polls: u64,
    /// Objects the journal named, each making the reader look at it again.
    pub named: u64,
    /// Lines skipped because they were not whole records (a publisher that died mid-write).
    pub torn: u64,
    /// Times the reader lost track of records and scanned the whole remote instead.
    pub gaps: u64,
}

impl Default for JournalInfo {
    fn default() -> Self {
        JournalInfo {
            state: JournalState::Starting,
            since: SystemTime::UNIX_EPOCH,
            detail: None,
            last_publisher: None,
            last_ring_ms: 0,
            poll_ms: 0,
            polls: 0,
            named: 0,
            torn: 0,
            gaps: 0,
        }
    }
}

/// The keeper of a mount, as `status` shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct KeeperInfo {
    pub pid: u32,
    /// How many daemons died or handed over, and were followed by another on the same
    /// connection.
    pub restarts: u32,
    /// How long callers waited between the last daemon stopping and this one serving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gap_ms: Option<f64>,
}

/// A layer as `layerfs layers` lists it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LayerInfo {
    pub id: String,
    pub short: String,
    pub parent: Option<String>,
}

/// An image as `layerfs images` lists it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageInfo {
    pub id: String,
    pub top_layer: String,
    pub names: Vec<String>,
}

/// One quota root: its limit and what is used under it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct QuotaInfo {
    /// The directory, relative to the mountpoint.
    pub path: String,
    /// Bytes of allocated space allowed.
    pub limit: u64,
    /// Bytes of allocated space in use.
    pub used: u64,
    /// `limit - used`, never negative.
    pub available: u64,
    /// Inodes allowed, when an inode limit is set.
    pub inode_limit: Option<u64>,
    pub inodes_used: u64,
    /// Who enforces the limit: `fuse` (the daemon) or `btrfs` (the kernel, through the
    /// qgroup of the subvolume the directory is).
    pub backend: String,
}

/// A quota question, as a mount answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaRequest {
    Set {
        path: String,
        size: String,
        inodes: Option<u64>,
    },
    Get {
        path: String,
    },
    List,
    Clear {
        path: String,
    },
}

/// The answer to a [`QuotaRequest`]: one root for set/get/clear, all of them for list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum QuotaAnswer {
    One(QuotaInfo),
    Many(Vec<QuotaInfo>),
}

impl Default for RoundReport {
    fn default() -> RoundReport {
        RoundReport {
            started: SystemTime::UNIX_EPOCH,
            duration: Duration::ZERO,
            added: Vec::new(),
            removed: Vec::new(),
            changed: Vec::new(),
            ready_layers: 0,
            ready_images: 0,
            not_ready: Vec::new(),
            error: None,
        }
    }
}

impl Default for RemoteHealth {
    fn default() -> RemoteHealth {
        RemoteHealth {
            healthy: false,
            since: SystemTime::UNIX_EPOCH,
            last_error: None,
        }
    }
}

/// Times as seconds since the epoch (with a fraction), the form scripts handle best.
mod unix_time {
    use std::time::{Duration, SystemTime};

    use serde::Deserialize;

    pub fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        s.serialize_f64(secs)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let secs = f64::deserialize(d)?;
        Ok(Duration::try_from_secs_f64(secs)
            .ok()
            .and_then(|since| SystemTime::UNIX_EPOCH.checked_add(since))
            .unwrap_or(SystemTime::UNIX_EPOCH))
    }
}

/// Durations as milliseconds (with a fraction).
mod millis {
    use std::time::Duration;

    use serde::Deserialize;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms = f64::deserialize(d)?;
        Ok(Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::ZERO))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_accept_missing_fields() {
        let round = RoundReport {
            started: SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_250),
            duration: Duration::from_micros(2500),
            added: vec![ObjectRef {
                kind: Kind::Image,
                id: "i1".into(),
            }],
            ..RoundReport::default()
        };
        let text = serde_json::to_string(&round).unwrap();
        assert!(text.contains(r#""duration":2.5"#), "{text}");
        let back: RoundReport = serde_json::from_str(&text).unwrap();
        assert_eq!(back.started, round.started);
        assert_eq!(back.duration, round.duration);
        assert_eq!(back.added, round.added);

        let s: Status = serde_json::from_str(r#"{"future":1}"#).unwrap();
        assert!(s.last_round.is_none() && s.metrics.is_none());
        let l: LayerInfo = serde_json::from_str(r#"{"id":"x","future":true}"#).unwrap();
        assert_eq!(l.id, "x");
        // Times that are no times (negative, too large) read as the epoch and zero.
        let r: RoundReport = serde_json::from_str(r#"{"started":-1,"duration":1e300}"#).unwrap();
        assert_eq!(r.started, SystemTime::UNIX_EPOCH);
        assert_eq!(r.duration, Duration::ZERO);
    }
}
