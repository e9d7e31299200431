//! What goes over the control socket: one JSON object per line each way.
//!
//! A request names its op: `{"op":"status"}`. Unknown fields are ignored, so that an older
//! daemon still answers a newer client's plain questions. The answer is `{"ok":true, <key>:
//! <payload>}`, the key depending on the op ([`Op::key`]), or `{"ok":false,"error":"…"}`.
//!
//! The payloads are the engine's [`report`](crate::refresh::report) types. A client reads them
//! back as the `*View` types here, which accept missing fields: the CLI and the daemon it
//! talks to are not always the same build.

use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::refresh::report::MountControl;

/// The longest request line the server reads; a longer one is refused and its connection
/// closed (there is no telling where the next request would start).
pub const MAX_REQUEST: usize = 64 * 1024;

/// What a client can ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Status,
    Refresh,
    Layers,
    Images,
}

impl Op {
    /// The key of the answer's payload.
    pub fn key(self) -> &'static str {
        match self {
            Op::Status => "status",
            Op::Refresh => "round",
            Op::Layers => "layers",
            Op::Images => "images",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Request {
    pub op: Op,
}

/// The request line for `op`, newline included.
pub fn request_line(op: Op) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Request { op }).unwrap_or_default();
    line.push(b'\n');
    line
}

/// Answers one request line (without its newline) with one answer line (with it).
pub fn answer(handle: &dyn MountControl, line: &[u8]) -> Vec<u8> {
    let reply = match serde_json::from_slice::<Request>(line) {
        Ok(Request { op }) => {
            // A bug in the engine must cost this answer, not the connection thread.
            match catch_unwind(AssertUnwindSafe(|| payload(handle, op))) {
                Ok(Ok(value)) => json!({ "ok": true, op.key(): value }),
                Ok(Err(e)) => error(&format!("encoding the answer: {e}")),
                Err(_) => error("internal error answering the request (see the mount's log)"),
            }
        }
        Err(e) => error(&format!("bad request: {e}")),
    };
    encode(&reply)
}

fn payload(handle: &dyn MountControl, op: Op) -> serde_json::Result<Value> {
    match op {
        Op::Status => serde_json::to_value(handle.status()),
        Op::Refresh => serde_json::to_value(handle.refresh()),
        Op::Layers => serde_json::to_value(handle.layers()),
        Op::Images => serde_json::to_value(handle.images()),
    }
}

/// An error answer.
pub fn error(message: &str) -> Value {
    json!({ "ok": false, "error": message })
}

/// `value` as one line, newline included.
pub fn encode(value: &Value) -> Vec<u8> {
    let mut line = serde_json::to_vec(value).unwrap_or_default();
    line.push(b'\n');
    line
}

/// A [`Status`](crate::refresh::report::Status) as a client reads it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StatusView {
    pub mountpoint: String,
    pub remote: String,
    pub local: String,
    pub driver: String,
    pub socket: String,
    pub refresh_interval_secs: f64,
    pub rounds: u64,
    pub remote_health: HealthView,
    pub last_round: Option<RoundView>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HealthView {
    pub healthy: bool,
    /// Seconds since the epoch.
    pub since: f64,
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RoundView {
    /// Seconds since the epoch.
    pub started: f64,
    /// Milliseconds.
    pub duration: f64,
    pub added: Vec<RefView>,
    pub removed: Vec<RefView>,
    pub changed: Vec<RefView>,
    pub ready_layers: usize,
    pub ready_images: usize,
    pub not_ready: Vec<NotReadyView>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RefView {
    pub kind: String,
    pub id: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct NotReadyView {
    pub kind: String,
    pub name: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct LayerView {
    pub id: String,
    pub short: String,
    pub parent: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ImageView {
    pub id: String,
    pub top_layer: String,
    pub names: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::refresh::report::{
        ImageInfo, LayerInfo, NotReadyRef, RemoteHealth, RoundReport, Status,
    };
    use crate::refresh::report::{Kind, ObjectRef};
    use std::time::{Duration, SystemTime};

    struct Fake;

    fn round() -> RoundReport {
        RoundReport {
            started: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            duration: Duration::from_micros(2500),
            added: vec![ObjectRef {
                kind: Kind::Image,
                id: "i1".into(),
            }],
            removed: vec![],
            changed: vec![],
            ready_layers: 1,
            ready_images: 1,
            not_ready: vec![NotReadyRef {
                kind: Kind::Layer,
                name: "l2".into(),
                reason: "no layer.json".into(),
            }],
            error: None,
        }
    }

    impl MountControl for Fake {
        fn status(&self) -> Status {
            Status {
                mountpoint: "/m".into(),
                remote: "/r".into(),
                local: "/l".into(),
                driver: "overlay".into(),
                socket: "/s".into(),
                refresh_interval_secs: 5.0,
                rounds: 3,
                remote_health: RemoteHealth {
                    healthy: true,
                    since: SystemTime::UNIX_EPOCH,
                    last_error: None,
                },
                last_round: Some(round()),
            }
        }
        fn refresh(&self) -> RoundReport {
            round()
        }
        fn layers(&self) -> Vec<LayerInfo> {
            panic!("engine bug")
        }
        fn images(&self) -> Vec<ImageInfo> {
            vec![ImageInfo {
                id: "i1".into(),
                top_layer: "l1".into(),
                names: vec!["busybox:latest".into()],
            }]
        }
    }

    fn ask(line: &str) -> Value {
        let out = answer(&Fake, line.as_bytes());
        assert_eq!(out.last(), Some(&b'\n'));
        assert_eq!(out.iter().filter(|b| **b == b'\n').count(), 1);
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn answers_each_op_under_its_key() {
        let v = ask(r#"{"op":"status"}"#);
        assert_eq!(v["ok"], true);
        let status: StatusView = serde_json::from_value(v["status"].clone()).unwrap();
        assert_eq!(status.rounds, 3);
        let last = status.last_round.unwrap();
        assert_eq!(last.duration, 2.5);
        assert_eq!(last.not_ready[0].kind, "layer");
        let v = ask(r#"{"op":"refresh","extra":1}"#);
        assert_eq!(v["round"]["added"][0]["id"], "i1");
        let v = ask(r#"{"op":"images"}"#);
        let images: Vec<ImageView> = serde_json::from_value(v["images"].clone()).unwrap();
        assert_eq!(images[0].names, ["busybox:latest"]);
    }

    #[test]
    fn bad_requests_get_error_answers() {
        for line in [
            "",
            "{",
            "null",
            "[]",
            r#"{"op":"nope"}"#,
            r#"{"op":7}"#,
            "\u{0}",
        ] {
            let v = ask(line);
            assert_eq!(v["ok"], false, "{line:?}");
            assert!(
                v["error"].as_str().unwrap().starts_with("bad request"),
                "{v}"
            );
        }
    }

    #[test]
    fn an_engine_panic_is_an_error_answer() {
        let v = ask(r#"{"op":"layers"}"#);
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains("internal error"));
    }

    #[test]
    fn request_lines_round_trip() {
        for op in [Op::Status, Op::Refresh, Op::Layers, Op::Images] {
            let line = request_line(op);
            assert_eq!(line.last(), Some(&b'\n'));
            let r: Request = serde_json::from_slice(&line).unwrap();
            assert_eq!(r.op, op);
        }
    }

    #[test]
    fn views_accept_missing_fields() {
        let s: StatusView = serde_json::from_str("{}").unwrap();
        assert!(s.last_round.is_none());
        let l: LayerView = serde_json::from_str(r#"{"id":"x","future":true}"#).unwrap();
        assert_eq!(l.id, "x");
    }
}
