//! The snapshotter's Prometheus metrics, served on its own endpoint (`metrics_address`).
//!
//! Calls are counted as [`crate::service::Service`] answers them; the sharing counters are
//! read from [`Snapshots::counters`] when Prometheus scrapes, so nothing is kept in step
//! between scrapes. The HTTP side is layerfs's own ([`layerfs::metrics::http`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use layerfs::metrics::Latency;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{prometheus_text, DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tonic::Code;

use crate::snapshots::Snapshots;

/// The exposition's content type (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The Snapshots API's methods, as the `method` label spells them.
pub const METHODS: [&str; 10] = [
    "Prepare", "View", "Mounts", "Commit", "Remove", "Stat", "Update", "List", "Usage", "Cleanup",
];

/// Bounds of call latencies: a Stat answers from memory in microseconds, a Commit that
/// drops a local copy or a Usage that walks a big upper dir can take seconds.
const CALL_BOUNDS: &[f64] = &[
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
];

type RequestLabels = [(&'static str, &'static str); 2];
type MethodLabels = [(&'static str, &'static str); 1];

fn call_latency() -> Latency {
    Latency::new(CALL_BOUNDS)
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<MethodLabels, Latency, fn() -> Latency>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(snapshots: Arc<Snapshots>) -> Metrics {
        let mut registry = Registry::with_prefix("layerfs_snapshotter");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency: Family<MethodLabels, Latency, fn() -> Latency> =
            Family::new_with_constructor(call_latency as fn() -> Latency);
        // Every method shows from the first scrape, so a rate over a quiet method is 0
        // rather than absent.
        for method in METHODS {
            let _ = requests.get_or_create(&[("method", method), ("code", code_name(Code::Ok))]);
            let _ = latency.get_or_create(&[("method", method)]);
        }
        registry.register(
            "requests",
            "Snapshots API calls answered, by method and gRPC code",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from receiving a Snapshots API call to answering it, by method",
            latency.clone(),
        );
        registry.register_collector(Box::new(Sharing(snapshots)));
        Metrics {
            registry,
            requests,
            latency,
        }
    }

    /// Counts one answered call of `method` (one of [`METHODS`]).
    pub fn observe(&self, method: &'static str, code: Code, elapsed: Duration) {
        self.requests
            .get_or_create(&[("method", method), ("code", code_name(code))])
            .inc();
        self.latency
            .get_or_create(&[("method", method)])
            .observe(elapsed);
    }

    /// The exposition, in the Prometheus text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, String> {
        let mut out = String::with_capacity(8 * 1024);
        prometheus_text::encode(&mut out, &self.registry)
            .map_err(|_| "encoding the metrics failed".to_owned())?;
        Ok(out)
    }
}

/// The sharing counters, read at scrape time.
struct Sharing(Arc<Snapshots>);

impl std::fmt::Debug for Sharing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharing").finish_non_exhaustive()
    }
}

impl Collector for Sharing {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = self.0.counters();
        for (name, help, value) in [
            (
                "adoptions",
                "Prepares answered with a layer of the shared tree (remote-snapshot protocol).",
                &c.adoptions,
            ),
            (
                "dedupes",
                "Commits that kept a shared layer's files instead of the local copy.",
                &c.dedupes,
            ),
            (
                "bytes_saved",
                "Bytes not kept locally thanks to adoptions and dedupes.",
                &c.bytes_saved,
            ),
        ] {
            let counter = ConstCounter::new(value.load(Ordering::Relaxed));
            // Registered metrics get their help's full stop from the registry; these are
            // written directly.
            let metric = encoder.encode_descriptor(name, help, None, counter.metric_type())?;
            counter.encode(metric)?;
        }
        Ok(())
    }
}

/// gRPC's own names of the codes, as Go's `codes.Code` prints them: the spelling other
/// gRPC servers' metrics use.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use tonic::Request;

    use super::*;
    use crate::api::snapshots::snapshots_server::Snapshots as _;
    use crate::api::snapshots::*;
    use crate::service::Service;
    use crate::Config;

    fn service() -> (tempfile::TempDir, Arc<Snapshots>, Service) {
        let dir = tempfile::tempdir().unwrap();
        let snapshots = Snapshots::open(&Config::new(&dir.path().join("root"))).unwrap();
        let snapshots = Arc::new(snapshots);
        (dir, snapshots.clone(), Service::new(snapshots))
    }

    /// The value of the sample `name` exactly (labels included) in `text`.
    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test]
    async fn calls_are_counted_by_method_and_code() {
        let (_dir, snapshots, service) = service();
        let prepare = |key: &str| {
            Request::new(PrepareSnapshotRequest {
                key: key.into(),
                ..Default::default()
            })
        };
        service.prepare(prepare("a")).await.unwrap();
        service.prepare(prepare("b")).await.unwrap();
        let err = service.prepare(prepare("a")).await.unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists);
        let stat = |key: &str| {
            Request::new(StatSnapshotRequest {
                key: key.into(),
                ..Default::default()
            })
        };
        service.stat(stat("a")).await.unwrap();
        assert_eq!(
            service.stat(stat("missing")).await.unwrap_err().code(),
            Code::NotFound
        );
        // Refused before reaching the snapshots: counted all the same.
        let rebase = CommitSnapshotRequest {
            name: "c".into(),
            key: "a".into(),
            parent: "p".into(),
            ..Default::default()
        };
        assert_eq!(
            service
                .commit(Request::new(rebase))
                .await
                .unwrap_err()
                .code(),
            Code::Unimplemented
        );
        // The sharing counters are the snapshots' own, read at scrape time.
        snapshots
            .counters()
            .adoptions
            .fetch_add(2, Ordering::Relaxed);
        snapshots
            .counters()
            .bytes_saved
            .fetch_add(4096, Ordering::Relaxed);

        let text = service.metrics().encode().unwrap();
        let requests = "layerfs_snapshotter_requests_total";
        let get = |labels: &str| sample(&text, &format!("{requests}{{{labels}}}"));
        assert_eq!(get(r#"method="Prepare",code="OK""#), Some(2.0), "{text}");
        assert_eq!(get(r#"method="Prepare",code="AlreadyExists""#), Some(1.0));
        assert_eq!(get(r#"method="Stat",code="OK""#), Some(1.0));
        assert_eq!(get(r#"method="Stat",code="NotFound""#), Some(1.0));
        assert_eq!(get(r#"method="Commit",code="Unimplemented""#), Some(1.0));
        // A method never called shows, at zero.
        assert_eq!(get(r#"method="Cleanup",code="OK""#), Some(0.0));
        let duration = "layerfs_snapshotter_request_duration_seconds";
        assert_eq!(
            sample(&text, &format!(r#"{duration}_count{{method="Prepare"}}"#)),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &text,
                &format!(r#"{duration}_bucket{{method="Stat",le="+Inf"}}"#)
            ),
            Some(2.0),
            "{text}"
        );
        assert!(text.contains(&format!("# TYPE {duration} histogram")));
        assert_eq!(
            sample(&text, "layerfs_snapshotter_adoptions_total"),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, "layerfs_snapshotter_dedupes_total"),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, "layerfs_snapshotter_bytes_saved_total"),
            Some(4096.0)
        );
        assert!(
            text.contains("# TYPE layerfs_snapshotter_adoptions_total counter"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn get_metrics_answers_over_http() {
        let (_dir, _, service) = service();
        service
            .cleanup(Request::new(CleanupRequest::default()))
            .await
            .unwrap();
        let metrics = service.metrics();
        let server = layerfs::metrics::serve_with(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(move || metrics.encode()),
        )
        .unwrap();
        let addr = server.local_addr();
        let response = tokio::task::spawn_blocking(move || {
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).unwrap();
            response
        })
        .await
        .unwrap();
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.contains(CONTENT_TYPE), "{response}");
        let body = response.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(
            sample(
                body,
                r#"layerfs_snapshotter_requests_total{method="Cleanup",code="OK"}"#
            ),
            Some(1.0),
            "{body}"
        );
        drop(server);
    }
}
