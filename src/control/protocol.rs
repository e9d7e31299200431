//! What goes over the control socket: one JSON object per line each way.
//!
//! A request names its op: `{"op":"status"}`. Unknown fields are ignored, so that an older
//! daemon still answers a newer client's plain questions. The answer is `{"ok":true, <key>:
//! <payload>}`, the key depending on the op ([`Op::key`]), or `{"ok":false,"error":"…"}`.
//!
//! The payloads are the core's [`report`](crate::report) types, read back by the client as the
//! same types; they accept missing fields, as the CLI and the daemon it talks to are not
//! always the same build.

use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::reconfigure::Reconfigure;
use crate::report::{ImageInfo, LayerInfo, QuotaAnswer, QuotaRequest, RoundReport, Status};

/// The longest request line the server reads; a longer one is refused and its connection
/// closed (there is no telling where the next request would start).
pub const MAX_REQUEST: usize = 64 * 1024;

pub use crate::error::ROOT_ONLY;

/// What the control socket asks of a running mount. The mount answers it from its refresh
/// engine and its view; the control server only carries questions and answers.
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
    fn quota(&self, _request: QuotaRequest) -> Result<QuotaAnswer, String> {
        Err("this mount does not serve quotas".into())
    }
    /// Hands the mount over to the binary now on disk (`layerfs upgrade`): the daemon stops
    /// once it has answered, and its keeper starts the new one. The answer is this daemon's
    /// pid.
    fn hand_over(&self) -> Result<u32, String> {
        Err("this mount has no keeper to hand over to (mount it with -o keeper)".into())
    }
}

/// What a client can ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Status,
    Refresh,
    Layers,
    Images,
    #[serde(rename = "quota_set")]
    QuotaSet,
    #[serde(rename = "quota_get")]
    QuotaGet,
    #[serde(rename = "quota_list")]
    QuotaList,
    #[serde(rename = "quota_clear")]
    QuotaClear,
    /// Change options of the running mount (`mount -o remount,…`).
    Reconfigure,
    /// Hand the mount over to the binary now on disk.
    Upgrade,
}

impl Op {
    /// The key of the answer's payload.
    pub fn key(self) -> &'static str {
        match self {
            Op::Status => "status",
            Op::Refresh => "round",
            Op::Layers => "layers",
            Op::Images => "images",
            Op::QuotaSet | Op::QuotaGet | Op::QuotaClear => "quota",
            Op::QuotaList => "quotas",
            Op::Reconfigure => "reconfigured",
            Op::Upgrade => "handed_over_by",
        }
    }
}

/// A request. The quota ops name a directory by `path`, relative to the mountpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub op: Op,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `quota_set`: the limit, as a size string (`10G`, `512Mi`, `1048576`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// `quota_set`: an optional limit on the number of inodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes: Option<u64>,
    /// `refresh`: the remote was emptied on purpose; take an empty scan as the truth.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accept_empty: bool,
    /// `reconfigure`: mount options, as `-o` takes them one by one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Request {
    pub fn new(op: Op) -> Request {
        Request {
            op,
            path: None,
            size: None,
            inodes: None,
            accept_empty: false,
            options: Vec::new(),
        }
    }
}

/// The request line for `op`, newline included.
pub fn request_line(op: Op) -> Vec<u8> {
    request_line_for(&Request::new(op))
}

/// The line for a full request, newline included.
pub fn request_line_for(request: &Request) -> Vec<u8> {
    let mut line = serde_json::to_vec(request).unwrap_or_default();
    line.push(b'\n');
    line
}

/// The quota question a request asks.
fn quota_request(r: &Request) -> Result<QuotaRequest, String> {
    let path = || {
        r.path
            .clone()
            .ok_or_else(|| format!("bad request: '{}' needs a path", op_name(r.op)))
    };
    Ok(match r.op {
        Op::QuotaSet => QuotaRequest::Set {
            path: path()?,
            size: r
                .size
                .clone()
                .ok_or_else(|| "bad request: 'quota_set' needs a size".to_owned())?,
            inodes: r.inodes,
        },
        Op::QuotaGet => QuotaRequest::Get { path: path()? },
        Op::QuotaClear => QuotaRequest::Clear { path: path()? },
        _ => QuotaRequest::List,
    })
}

fn op_name(op: Op) -> String {
    serde_json::to_value(op)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Answers one request line (without its newline) with one answer line (with it).
/// Answers one request line; `admin`: the client has `CAP_SYS_ADMIN`, which changing a
/// quota takes.
pub fn answer(handle: &dyn MountControl, line: &[u8], admin: bool) -> Vec<u8> {
    answer_with(handle, None, line, admin)
}

/// [`answer`], for a mount that can also change options live.
pub fn answer_with(
    handle: &dyn MountControl,
    live: Option<&dyn Reconfigure>,
    line: &[u8],
    admin: bool,
) -> Vec<u8> {
    let reply = match serde_json::from_slice::<Request>(line) {
        Ok(request) if !admin && matches!(request.op, Op::QuotaSet | Op::QuotaClear) => {
            error("permission denied: changing a quota needs CAP_SYS_ADMIN")
        }
        // As remount(2) does.
        Ok(request) if !admin && request.op == Op::Reconfigure => {
            error("permission denied: changing mount options needs CAP_SYS_ADMIN")
        }
        Ok(request) if !admin && request.op == Op::Upgrade => {
            error("permission denied: upgrading a mount's daemon needs CAP_SYS_ADMIN")
        }
        Ok(request) => {
            let op = request.op;
            // A bug in the engine must cost this answer, not the connection thread.
            match catch_unwind(AssertUnwindSafe(|| payload(handle, live, &request))) {
                Ok(Ok(value)) => json!({ "ok": true, op.key(): value }),
                Ok(Err(message)) => error(&message),
                Err(_) => error("internal error answering the request (see the mount's log)"),
            }
        }
        Err(e) => error(&format!("bad request: {e}")),
    };
    encode(&reply)
}

fn payload(
    handle: &dyn MountControl,
    live: Option<&dyn Reconfigure>,
    request: &Request,
) -> Result<Value, String> {
    let encoded = match request.op {
        Op::Status => serde_json::to_value(Status {
            metrics: handle.metrics(),
            ..handle.status()
        }),
        Op::Refresh if request.accept_empty => {
            serde_json::to_value(handle.refresh_accepting_empty())
        }
        Op::Refresh => serde_json::to_value(handle.refresh()),
        Op::Layers => serde_json::to_value(handle.layers()),
        Op::Images => serde_json::to_value(handle.images()),
        Op::QuotaSet | Op::QuotaGet | Op::QuotaList | Op::QuotaClear => {
            let question = quota_request(request)?;
            serde_json::to_value(handle.quota(question)?)
        }
        Op::Reconfigure => match live {
            Some(live) => serde_json::to_value(live.reconfigure(&request.options)?),
            None => return Err("this mount cannot change options while mounted".into()),
        },
        Op::Upgrade => serde_json::to_value(handle.hand_over()?),
    };
    encoded.map_err(|e| format!("encoding the answer: {e}"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Kind, NotReadyRef, ObjectRef, RemoteHealth};
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
                quotas: Vec::new(),
                metrics: None,
                transport: None,
                log: None,
                daemon_pid: 4242,
                keeper: None,
                journal: None,
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
        let out = answer(&Fake, line.as_bytes(), true);
        assert_eq!(out.last(), Some(&b'\n'));
        assert_eq!(out.iter().filter(|b| **b == b'\n').count(), 1);
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn answers_each_op_under_its_key() {
        let v = ask(r#"{"op":"status"}"#);
        assert_eq!(v["ok"], true);
        let status: Status = serde_json::from_value(v["status"].clone()).unwrap();
        assert_eq!(status.rounds, 3);
        let last = status.last_round.unwrap();
        assert_eq!(last.duration, Duration::from_micros(2500));
        assert_eq!(last.not_ready[0].kind, Kind::Layer);
        let v = ask(r#"{"op":"refresh","extra":1}"#);
        assert_eq!(v["round"]["added"][0]["id"], "i1");
        let v = ask(r#"{"op":"images"}"#);
        let images: Vec<ImageInfo> = serde_json::from_value(v["images"].clone()).unwrap();
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
    fn changing_a_quota_takes_an_admin() {
        for line in [
            r#"{"op":"quota_set","path":"a","size":"1M"}"#,
            r#"{"op":"quota_clear","path":"a"}"#,
        ] {
            let v: Value = serde_json::from_slice(&answer(&Fake, line.as_bytes(), false)).unwrap();
            assert_eq!(v["ok"], false, "{line}");
            assert!(
                v["error"].as_str().unwrap().contains("CAP_SYS_ADMIN"),
                "{v}"
            );
        }
        let v: Value =
            serde_json::from_slice(&answer(&Fake, br#"{"op":"status"}"#, false)).unwrap();
        assert_eq!(v["ok"], true, "{v}");
    }

    #[test]
    fn an_engine_panic_is_an_error_answer() {
        let v = ask(r#"{"op":"layers"}"#);
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains("internal error"));
    }

    #[test]
    fn request_lines_round_trip() {
        for op in [
            Op::Status,
            Op::Refresh,
            Op::Layers,
            Op::Images,
            Op::QuotaSet,
            Op::QuotaGet,
            Op::QuotaList,
            Op::QuotaClear,
        ] {
            let line = request_line(op);
            assert_eq!(line.last(), Some(&b'\n'));
            let r: Request = serde_json::from_slice(&line).unwrap();
            assert_eq!(r.op, op);
        }
    }

    #[test]
    fn quota_ops_reach_the_mount_and_need_their_fields() {
        let v = ask(r#"{"op":"quota_list"}"#);
        assert_eq!(v["ok"], false);
        assert_eq!(v["error"], "this mount does not serve quotas");
        let v = ask(r#"{"op":"quota_set","path":"overlay/c1"}"#);
        assert_eq!(v["error"], "bad request: 'quota_set' needs a size");
        let v = ask(r#"{"op":"quota_get"}"#);
        assert_eq!(v["error"], "bad request: 'quota_get' needs a path");
        let line = request_line_for(&Request {
            path: Some("overlay/c1".into()),
            size: Some("10G".into()),
            ..Request::new(Op::QuotaSet)
        });
        let r: Request = serde_json::from_slice(&line).unwrap();
        assert_eq!(
            quota_request(&r).unwrap(),
            QuotaRequest::Set {
                path: "overlay/c1".into(),
                size: "10G".into(),
                inodes: None
            }
        );
    }
}
