//! The gRPC face of [`Snapshots`]: containerd's `Snapshots` service. Every call runs on the
//! blocking pool, since each one may touch the disk or the view.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::api::snapshots::snapshots_server::Snapshots as SnapshotsApi;
use crate::api::snapshots::*;
use crate::error::Error;
use crate::meta;
use crate::metrics::Metrics;
use crate::snapshots::{self, Snapshots};

/// Infos per List message, well below gRPC's 4 MiB message limit even with many labels.
const LIST_BATCH: usize = 100;

#[derive(Clone)]
pub struct Service {
    snapshots: Arc<Snapshots>,
    in_flight: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

impl Service {
    pub fn new(snapshots: Arc<Snapshots>) -> Service {
        Service {
            metrics: Arc::new(Metrics::new(snapshots.clone())),
            snapshots,
            in_flight: Arc::default(),
        }
    }

    /// The calls answered so far, and the sharing counters, for the metrics endpoint.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Answers a call that is refused before it reaches the snapshots, counting it as any
    /// other.
    fn refuse(&self, op: &'static str, status: Status) -> Status {
        tracing::debug!(op, error = %status.message(), "refused");
        self.metrics.observe(op, status.code(), Duration::ZERO);
        status
    }

    /// How many calls are being served now, so that a stop can wait for them and no longer.
    pub fn in_flight(&self) -> Arc<AtomicUsize> {
        self.in_flight.clone()
    }

    async fn run<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Snapshots) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Status> {
        let started = Instant::now();
        let snapshots = self.snapshots.clone();
        let in_flight = self.in_flight.clone();
        in_flight.fetch_add(1, Ordering::SeqCst);
        // Counted down on the blocking thread, so a caller that gives up early does not
        // make a change still running look finished.
        let result = match tokio::task::spawn_blocking(move || {
            let result = f(&snapshots);
            in_flight.fetch_sub(1, Ordering::SeqCst);
            result
        })
        .await
        {
            Ok(result) => result.map_err(|e| {
                match e.code() {
                    tonic::Code::NotFound | tonic::Code::AlreadyExists => {
                        tracing::debug!(op, error = %e)
                    }
                    _ => tracing::warn!(op, error = %e),
                }
                Status::from(e)
            }),
            Err(e) => Err(Status::internal(format!("{op}: {e}"))),
        };
        let code = result
            .as_ref()
            .map_or_else(Status::code, |_| tonic::Code::Ok);
        self.metrics.observe(op, code, started.elapsed());
        result
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListSnapshotsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl SnapshotsApi for Service {
    async fn prepare(
        &self,
        request: Request<PrepareSnapshotRequest>,
    ) -> Result<Response<PrepareSnapshotResponse>, Status> {
        let r = request.into_inner();
        tracing::debug!(key = r.key, parent = r.parent, labels = ?r.labels, "prepare");
        let mounts = self
            .run("Prepare", move |s| {
                s.prepare(&r.key, &r.parent, sorted(r.labels))
            })
            .await?;
        Ok(Response::new(PrepareSnapshotResponse { mounts }))
    }

    async fn view(
        &self,
        request: Request<ViewSnapshotRequest>,
    ) -> Result<Response<ViewSnapshotResponse>, Status> {
        let r = request.into_inner();
        tracing::debug!(key = r.key, parent = r.parent, "view");
        let mounts = self
            .run("View", move |s| s.view(&r.key, &r.parent, sorted(r.labels)))
            .await?;
        Ok(Response::new(ViewSnapshotResponse { mounts }))
    }

    async fn mounts(
        &self,
        request: Request<MountsRequest>,
    ) -> Result<Response<MountsResponse>, Status> {
        let r = request.into_inner();
        let mounts = self.run("Mounts", move |s| s.mounts(&r.key)).await?;
        Ok(Response::new(MountsResponse { mounts }))
    }

    async fn commit(
        &self,
        request: Request<CommitSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.into_inner();
        tracing::debug!(name = r.name, key = r.key, "commit");
        if !r.parent.is_empty() {
            // Rebasing on commit needs the `rebase` capability, which is not advertised.
            return Err(self.refuse(
                "Commit",
                Status::unimplemented("commit with a new parent (rebase)"),
            ));
        }
        self.run("Commit", move |s| {
            s.commit(&r.name, &r.key, sorted(r.labels))
        })
        .await?;
        Ok(Response::new(()))
    }

    async fn remove(
        &self,
        request: Request<RemoveSnapshotRequest>,
    ) -> Result<Response<()>, Status> {
        let r = request.into_inner();
        tracing::debug!(key = r.key, "remove");
        self.run("Remove", move |s| s.remove(&r.key)).await?;
        Ok(Response::new(()))
    }

    async fn stat(
        &self,
        request: Request<StatSnapshotRequest>,
    ) -> Result<Response<StatSnapshotResponse>, Status> {
        let r = request.into_inner();
        let info = self.run("Stat", move |s| s.stat(&r.key)).await?;
        Ok(Response::new(StatSnapshotResponse {
            info: Some(wire_info(info)),
        }))
    }

    async fn update(
        &self,
        request: Request<UpdateSnapshotRequest>,
    ) -> Result<Response<UpdateSnapshotResponse>, Status> {
        let r = request.into_inner();
        let Some(info) = r.info else {
            return Err(self.refuse("Update", Status::invalid_argument("update without an info")));
        };
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let info = self
            .run("Update", move |s| {
                s.update(&info.name, sorted(info.labels), &paths)
            })
            .await?;
        Ok(Response::new(UpdateSnapshotResponse {
            info: Some(wire_info(info)),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let r = request.into_inner();
        let infos = self.run("List", move |s| s.list(&r.filters)).await?;
        let batches: Vec<ListSnapshotsResponse> = infos
            .chunks(LIST_BATCH)
            .map(|chunk| ListSnapshotsResponse {
                info: chunk.iter().cloned().map(wire_info).collect(),
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(
            batches.into_iter().map(Ok),
        ))))
    }

    async fn usage(
        &self,
        request: Request<UsageRequest>,
    ) -> Result<Response<UsageResponse>, Status> {
        let r = request.into_inner();
        let usage = self.run("Usage", move |s| s.usage(&r.key)).await?;
        Ok(Response::new(UsageResponse {
            size: clamp(usage.size),
            inodes: clamp(usage.inodes),
        }))
    }

    async fn cleanup(&self, _: Request<CleanupRequest>) -> Result<Response<()>, Status> {
        self.run("Cleanup", |s| s.cleanup()).await?;
        Ok(Response::new(()))
    }
}

fn sorted(labels: std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    labels.into_iter().collect()
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn wire_info(info: snapshots::Info) -> Info {
    let r = info.record;
    Info {
        name: info.name,
        parent: r.parent.unwrap_or_default(),
        kind: match r.kind {
            meta::Kind::View => Kind::View,
            meta::Kind::Active => Kind::Active,
            meta::Kind::Committed => Kind::Committed,
        } as i32,
        created_at: Some(timestamp(r.created)),
        updated_at: Some(timestamp(r.updated)),
        labels: r.labels.into_iter().collect(),
    }
}

fn timestamp(nanos: u128) -> prost_types::Timestamp {
    let t = UNIX_EPOCH + Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
    prost_types::Timestamp::from(t)
}
