//! What a refresh round did, and how the remote is doing: the facts `layerfs status`,
//! `layerfs refresh`, `layers` and `images` report over the control socket.

use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::layout::ObjectKind;

/// One layer or image named in a report.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ObjectRef {
    pub kind: Kind,
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Layer,
    Image,
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotReadyRef {
    pub kind: Kind,
    pub name: String,
    pub reason: String,
}

/// One refresh round.
#[derive(Debug, Clone, Serialize)]
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
#[derive(Debug, Clone, Serialize)]
pub struct RemoteHealth {
    pub healthy: bool,
    #[serde(with = "unix_time")]
    pub since: SystemTime,
    pub last_error: Option<String>,
}

/// A running mount's state, as `layerfs status` shows it.
#[derive(Debug, Clone, Serialize)]
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
    pub quotas: Vec<crate::control::protocol::QuotaInfo>,
}

/// A layer as `layerfs layers` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct LayerInfo {
    pub id: String,
    pub short: String,
    pub parent: Option<String>,
}

/// An image as `layerfs images` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    pub id: String,
    pub top_layer: String,
    pub names: Vec<String>,
}

/// Times as seconds since the epoch (with a fraction), the form scripts handle best.
mod unix_time {
    use std::time::SystemTime;

    pub fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let secs = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        s.serialize_f64(secs)
    }
}

mod millis {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }
}

/// What the control socket asks of a running mount. The refresh engine answers it; the
/// control server only carries questions and answers.
pub trait MountControl: Send + Sync {
    /// The mount's state now. Never blocks on the remote.
    fn status(&self) -> Status;
    /// Runs a refresh round now and reports it (a round already running is waited for,
    /// within the scan timeout).
    fn refresh(&self) -> RoundReport;
    /// Like [`MountControl::refresh`], taking an empty remote as emptied on purpose rather
    /// than lost.
    fn refresh_accepting_empty(&self) -> RoundReport {
        self.refresh()
    }
    /// The ready layers, sorted by id.
    fn layers(&self) -> Vec<LayerInfo>;
    /// The ready images, sorted by id.
    fn images(&self) -> Vec<ImageInfo>;
    /// The address Prometheus metrics are served on (`-o metrics=`), if they are; `status`
    /// shows it as `metrics`.
    fn metrics(&self) -> Option<String> {
        None
    }
    /// Sets, reads, lists or clears quotas; an error is a message for the user.
    fn quota(
        &self,
        _request: crate::control::protocol::QuotaRequest,
    ) -> Result<crate::control::protocol::QuotaAnswer, String> {
        Err("this mount does not serve quotas".into())
    }
}
