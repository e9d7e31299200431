//! Prometheus metrics of a mount (DESIGN §9), served with `-o metrics=ADDR:PORT`.
//!
//! A mount has one [`Metrics`]. Its figures are of two kinds:
//!
//! - **events**, pushed by whoever sees them happen: FUSE requests ([`Metrics::request`]),
//!   refresh rounds ([`Metrics::refresh_round`]) and the remote request pool
//!   ([`Metrics::remote_pool`]). These run on hot paths: a known opcode costs a hash lookup
//!   and a few relaxed atomic adds, with no lock taken and nothing allocated (its label set
//!   is made once, on its first request);
//! - **state**, read when Prometheus scrapes, from the mount ([`Sources`]: health, refresh
//!   rounds, not-ready objects, quotas, the inode table) and from the FUSE glue
//!   ([`FsTables`]: open handles and passthrough backing files). Nothing is kept up to date
//!   between scrapes, so state costs nothing while nobody looks.
//!
//! [`http::serve`] answers `GET /metrics` in the Prometheus text format (0.0.4). The list
//! of metrics, with their labels, is in `docs/metrics.md`.
//!
//! Until the refresh engine pushes its rounds, a scrape derives the round figures from the
//! status's last round; rounds that end between two scrapes are then counted only in
//! `refresh_rounds_total`, not in the round histogram or the change counters.

pub mod http;
mod latency;
pub mod names;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use parking_lot::{Mutex, RwLock};
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::report::{Kind, RoundReport, Status};
pub use http::{serve, serve_with, Server};
pub use latency::Latency;

/// Why metrics cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the metrics server: {0}")]
    Start(#[source] std::io::Error),
}

/// What a scrape reads from the mount. Called on the metrics server's thread, once per
/// scrape; like the control socket's `status`, it must never wait on the remote.
pub trait Sources: Send + Sync {
    /// The mount's status: remote health, rounds, the last round, quota roots.
    fn status(&self) -> Status;
    /// The inode table's size.
    fn inodes(&self) -> InodeCounts;
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InodeCounts {
    /// Nodes the kernel may name.
    pub nodes: usize,
    /// Identities (device, inode and the like) mapped to nodes.
    pub identities: usize,
}

/// The FUSE glue's own tables, read at scrape time. Their metrics are absent until the
/// glue registers them with [`Metrics::set_fs_tables`].
pub trait FsTables: Send + Sync {
    /// Open file and directory handles.
    fn open_handles(&self) -> usize;
    /// Inodes with a passthrough backing file registered with the kernel.
    fn backing_files(&self) -> usize;
}

/// FUSE opcodes as the glue names them (fuser's method names). Each gets a slot whose
/// metrics are reached without a lock; any other name still counts, through the families.
const OPS: &[&str] = &[
    "init",
    "destroy",
    "lookup",
    "forget",
    "batch_forget",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "readdirplus",
    "releasedir",
    "fsyncdir",
    "statfs",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "access",
    "create",
    "getlk",
    "setlk",
    "bmap",
    "ioctl",
    "poll",
    "fallocate",
    "lseek",
    "copy_file_range",
    "tmpfile",
];

type OpLabels = [(&'static str, &'static str); 1];
type ErrorLabels = [(&'static str, &'static str); 2];
type KindLabels = [(&'static str, &'static str); 1];
type ReasonLabels = [(&'static str, &'static str); 2];
type RootLabels = [(&'static str, String); 1];
/// A metric that is exposed only once something sets it.
type Unlabelled = [(&'static str, &'static str); 0];
type GaugeF64 = Gauge<f64, AtomicU64>;

/// One opcode's metrics, shared with the families that expose them.
struct OpSlot {
    requests: Counter,
    latency: Latency,
}

/// Rounds the metrics have counted, so that a round is counted once whether it was
/// pushed or found at a scrape.
#[derive(Default)]
struct RoundBook {
    /// The refresh engine pushes its rounds: scrapes no longer derive them.
    pushed: bool,
    /// `status.rounds` as of the last scrape.
    seen: u64,
    /// When the latest round without an error ended.
    last_good: Option<SystemTime>,
}

/// A mount's metrics. Shared as `Arc<Metrics>`; every method takes `&self`.
pub struct Metrics {
    registry: Registry,
    ops: HashMap<&'static str, usize>,
    slots: Box<[OnceLock<OpSlot>]>,
    requests: Family<OpLabels, Counter>,
    latency: Family<OpLabels, Latency, fn() -> Latency>,
    errors: Family<ErrorLabels, Counter>,
    pool_queued: Family<Unlabelled, Gauge>,
    pool_running: Family<Unlabelled, Gauge>,
    pool: OnceLock<(Gauge, Gauge)>,
    round_duration: Latency,
    /// Added, removed, changed.
    changes: [Counter; 3],
    rounds_total: Counter,
    remote_healthy: Gauge,
    last_good_age: GaugeF64,
    ready: Family<KindLabels, Gauge>,
    not_ready: Family<ReasonLabels, Gauge>,
    quota_limit: Family<RootLabels, Gauge>,
    quota_used: Family<RootLabels, Gauge>,
    quota_inode_limit: Family<RootLabels, Gauge>,
    quota_inodes_used: Family<RootLabels, Gauge>,
    inodes: Family<Unlabelled, Gauge>,
    identities: Family<Unlabelled, Gauge>,
    open_handles: Family<Unlabelled, Gauge>,
    backing_files: Family<Unlabelled, Gauge>,
    /// Exposed once the mount follows a journal (absent with `nojournal`).
    journal_following: Family<Unlabelled, Gauge>,
    /// Objects named, lines torn, gaps: counters fed from the status's totals.
    journal_totals: [Family<Unlabelled, Counter>; 3],
    /// The totals as of the last scrape.
    journal_seen: Mutex<[u64; 3]>,
    sources: RwLock<Option<Arc<dyn Sources>>>,
    fs_tables: RwLock<Option<Arc<dyn FsTables>>>,
    /// Held for a whole scrape: each rewrites the state metrics.
    scrape: Mutex<()>,
    /// Never held while calling out, so that the refresh engine may push a round with
    /// its own locks held while a scrape asks it for the status.
    rounds: Mutex<RoundBook>,
    created: SystemTime,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("layerfs"),
            ops: OPS.iter().enumerate().map(|(i, op)| (*op, i)).collect(),
            slots: OPS.iter().map(|_| OnceLock::new()).collect(),
            requests: Family::default(),
            latency: Family::new_with_constructor(Latency::requests as fn() -> Latency),
            errors: Family::default(),
            pool_queued: Family::default(),
            pool_running: Family::default(),
            pool: OnceLock::new(),
            round_duration: Latency::new(latency::ROUND_BOUNDS),
            changes: Default::default(),
            rounds_total: Counter::default(),
            remote_healthy: Gauge::default(),
            last_good_age: GaugeF64::default(),
            ready: Family::default(),
            not_ready: Family::default(),
            quota_limit: Family::default(),
            quota_used: Family::default(),
            quota_inode_limit: Family::default(),
            quota_inodes_used: Family::default(),
            inodes: Family::default(),
            identities: Family::default(),
            open_handles: Family::default(),
            backing_files: Family::default(),
            journal_following: Family::default(),
            journal_totals: Default::default(),
            journal_seen: Mutex::new([0; 3]),
            sources: RwLock::new(None),
            fs_tables: RwLock::new(None),
            scrape: Mutex::new(()),
            rounds: Mutex::new(RoundBook::default()),
            created: SystemTime::now(),
        };
        m.register();
        m
    }

    fn register(&mut self) {
        let r = &mut self.registry;
        r.register(
            "requests",
            "FUSE requests answered, by opcode",
            self.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from receiving a FUSE request to replying, by opcode",
            self.latency.clone(),
        );
        r.register(
            "request_errors",
            "FUSE requests answered with an error, by opcode and errno name",
            self.errors.clone(),
        );
        r.register(
            "remote_pool_queued",
            "Remote requests waiting for a thread of the remote request pool",
            self.pool_queued.clone(),
        );
        r.register(
            "remote_pool_running",
            "Remote requests running on the remote request pool",
            self.pool_running.clone(),
        );
        r.register(
            "journal_following",
            "Whether the mount follows the remote's publication journal (1) or scans the whole \
             remote every round (0: no journal, a silent or unreadable one)",
            self.journal_following.clone(),
        );
        let [named, torn, gaps] = self.journal_totals.clone();
        r.register(
            "journal_named_objects",
            "Objects the publication journal named, each looked at again",
            named,
        );
        r.register(
            "journal_torn_lines",
            "Journal lines skipped because they were not whole records",
            torn,
        );
        r.register(
            "journal_gaps",
            "Times the mount lost track of the journal and scanned the whole remote",
            gaps,
        );
        r.register(
            "remote_healthy",
            "Whether the remote answered the last refresh round (1) or not (0)",
            self.remote_healthy.clone(),
        );
        r.register(
            "refresh_last_success_age_seconds",
            "Seconds since the last refresh round that scanned the remote without error \
             (since the mount started when there was none yet)",
            self.last_good_age.clone(),
        );
        r.register(
            "refresh_rounds",
            "Refresh rounds run since the mount started",
            self.rounds_total.clone(),
        );
        r.register(
            "refresh_round_duration_seconds",
            "Duration of refresh rounds",
            self.round_duration.clone(),
        );
        let changes: Family<KindLabels, Counter> = Family::default();
        for (counter, kind) in self.changes.iter_mut().zip(["added", "removed", "changed"]) {
            *counter = changes.get_or_create_owned(&[("kind", kind)]);
        }
        r.register(
            "refresh_changes",
            "Remote layers and images added, removed and changed by refresh rounds",
            changes,
        );
        r.register(
            "ready_objects",
            "Remote layers and images shown in the view",
            self.ready.clone(),
        );
        r.register(
            "not_ready_objects",
            "Remote layers and images not shown, by kind and class of reason",
            self.not_ready.clone(),
        );
        r.register(
            "quota_limit_bytes",
            "Allocated bytes allowed in a quota root (path relative to the local tree)",
            self.quota_limit.clone(),
        );
        r.register(
            "quota_used_bytes",
            "Allocated bytes in use in a quota root",
            self.quota_used.clone(),
        );
        r.register(
            "quota_inode_limit",
            "Inodes allowed in a quota root, for roots with an inode limit",
            self.quota_inode_limit.clone(),
        );
        r.register(
            "quota_inodes_used",
            "Inodes in use in a quota root",
            self.quota_inodes_used.clone(),
        );
        r.register("inodes", "Nodes in the inode table", self.inodes.clone());
        r.register(
            "inode_identities",
            "Identities mapped in the inode table",
            self.identities.clone(),
        );
        r.register(
            "open_handles",
            "Open file and directory handles",
            self.open_handles.clone(),
        );
        r.register(
            "passthrough_backing_files",
            "Inodes with a passthrough backing file registered with the kernel",
            self.backing_files.clone(),
        );
    }

    /// Counts one FUSE request: `op` is its opcode (`"lookup"`, `"write"`, fuser's method
    /// names), `elapsed` the time from receiving it to replying, `errno` the error it was
    /// answered with (`None` for success). Lock-free and allocation-free for the opcodes
    /// of [`OPS`].
    pub fn request(&self, op: &'static str, elapsed: Duration, errno: Option<i32>) {
        match self.ops.get(op).and_then(|i| self.slots.get(*i)) {
            Some(slot) => {
                let slot = slot.get_or_init(|| OpSlot {
                    requests: self.requests.get_or_create_owned(&[("op", op)]),
                    latency: self.latency.get_or_create_owned(&[("op", op)]),
                });
                slot.requests.inc();
                slot.latency.observe(elapsed);
            }
            None => {
                self.requests.get_or_create(&[("op", op)]).inc();
                self.latency.get_or_create(&[("op", op)]).observe(elapsed);
            }
        }
        if let Some(errno) = errno {
            let labels = [("op", op), ("errno", names::errno_name(errno))];
            self.errors.get_or_create(&labels).inc();
        }
    }

    /// The remote request pool's load now: requests waiting for a thread, and requests
    /// running. Call it whenever either changes; the gauges appear with the first call.
    pub fn remote_pool(&self, queued: i64, running: i64) {
        let (q, r) = self.pool.get_or_init(|| {
            (
                self.pool_queued.get_or_create_owned(&[]),
                self.pool_running.get_or_create_owned(&[]),
            )
        });
        q.set(queued);
        r.set(running);
    }

    /// Counts one refresh round, for the refresh engine to call at the end of every round
    /// (the mount-time one included). From the first call on, scrapes stop deriving
    /// rounds from the status. Takes only a lock of its own, briefly: it may be called
    /// with the engine's locks held.
    pub fn refresh_round(&self, report: &RoundReport) {
        let mut book = self.rounds.lock();
        book.pushed = true;
        self.count_round(&mut book, report);
    }

    fn count_round(&self, book: &mut RoundBook, report: &RoundReport) {
        self.round_duration.observe(report.duration);
        for (counter, objects) in
            self.changes
                .iter()
                .zip([&report.added, &report.removed, &report.changed])
        {
            counter.inc_by(objects.len() as u64);
        }
        if report.error.is_none() {
            let ended = report.started + report.duration;
            book.last_good = Some(book.last_good.map_or(ended, |t| t.max(ended)));
        }
    }

    /// Where scrapes read the mount's state from; until this is called, state metrics are
    /// absent or zero.
    pub fn set_sources(&self, sources: Arc<dyn Sources>) {
        *self.sources.write() = Some(sources);
    }

    /// Where scrapes read the FUSE glue's table sizes from.
    pub fn set_fs_tables(&self, tables: Arc<dyn FsTables>) {
        *self.fs_tables.write() = Some(tables);
    }

    /// The exposition, in the Prometheus text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, String> {
        let _one_at_a_time = self.scrape.lock();
        // A bug behind a source must cost this scrape, not the server.
        catch_unwind(AssertUnwindSafe(|| self.read_state()))
            .map_err(|_| "reading the mount's state failed (see the mount's log)".to_owned())?;
        let mut out = String::with_capacity(16 * 1024);
        prometheus_text::encode(&mut out, &self.registry)
            .map_err(|_| "encoding the metrics failed".to_owned())?;
        Ok(out)
    }

    fn read_state(&self) {
        let sources = self.sources.read().clone();
        if let Some(sources) = sources {
            let status = sources.status();
            self.read_status(&status);
            let inodes = sources.inodes();
            self.inodes.get_or_create(&[]).set(gauge(inodes.nodes));
            self.identities
                .get_or_create(&[])
                .set(gauge(inodes.identities));
        }
        let tables = self.fs_tables.read().clone();
        if let Some(tables) = tables {
            self.open_handles
                .get_or_create(&[])
                .set(gauge(tables.open_handles()));
            self.backing_files
                .get_or_create(&[])
                .set(gauge(tables.backing_files()));
        }
    }

    fn read_status(&self, status: &Status) {
        self.remote_healthy
            .set(i64::from(status.remote_health.healthy));
        if let Some(journal) = &status.journal {
            let following = journal.state == crate::report::JournalState::Following;
            self.journal_following
                .get_or_create(&[])
                .set(i64::from(following));
            let totals = [journal.named, journal.torn, journal.gaps];
            let mut seen = self.journal_seen.lock();
            for ((family, now), was) in self.journal_totals.iter().zip(totals).zip(seen.iter_mut())
            {
                family.get_or_create(&[]).inc_by(now.saturating_sub(*was));
                *was = now;
            }
        }
        let mut book = self.rounds.lock();
        if status.rounds > book.seen {
            self.rounds_total.inc_by(status.rounds - book.seen);
            if !book.pushed {
                if let Some(last) = &status.last_round {
                    self.count_round(&mut book, last);
                }
            }
            book.seen = status.rounds;
        }
        if let Some(last) = status.last_round.as_ref().filter(|r| r.error.is_none()) {
            let ended = last.started + last.duration;
            book.last_good = Some(book.last_good.map_or(ended, |t| t.max(ended)));
        }
        let since = book.last_good.unwrap_or(self.created);
        drop(book);
        let age = SystemTime::now()
            .duration_since(since)
            .unwrap_or_default()
            .as_secs_f64();
        self.last_good_age.set(age);

        let (layers, images, not_ready) = match &status.last_round {
            Some(r) => (r.ready_layers, r.ready_images, &r.not_ready[..]),
            None => (0, 0, &[][..]),
        };
        self.ready
            .get_or_create(&[("kind", "layer")])
            .set(gauge(layers));
        self.ready
            .get_or_create(&[("kind", "image")])
            .set(gauge(images));
        let mut counts: HashMap<(&'static str, &'static str), i64> = HashMap::new();
        for object in not_ready {
            let kind = kind_label(object.kind);
            *counts
                .entry((kind, names::reason_class(&object.reason)))
                .or_default() += 1;
        }
        // Every class of both kinds is exposed, zeros too, so that a series does not vanish
        // when its last object becomes ready.
        for kind in ["layer", "image"] {
            for class in names::REASON_CLASSES {
                let n = counts.get(&(kind, *class)).copied().unwrap_or(0);
                self.not_ready
                    .get_or_create(&[("kind", kind), ("reason", class)])
                    .set(n);
            }
        }

        // Roots come and go: the families are rebuilt, under the scrape's lock.
        for family in [
            &self.quota_limit,
            &self.quota_used,
            &self.quota_inode_limit,
            &self.quota_inodes_used,
        ] {
            family.clear();
        }
        for q in &status.quotas {
            let labels = [("root", q.path.clone())];
            self.quota_limit.get_or_create(&labels).set(gauge(q.limit));
            self.quota_used.get_or_create(&labels).set(gauge(q.used));
            self.quota_inodes_used
                .get_or_create(&labels)
                .set(gauge(q.inodes_used));
            if let Some(limit) = q.inode_limit {
                self.quota_inode_limit
                    .get_or_create(&labels)
                    .set(gauge(limit));
            }
        }
    }
}

/// The `Content-Type` of [`Metrics::encode`]'s answer.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

fn kind_label(kind: Kind) -> &'static str {
    match kind {
        Kind::Layer => "layer",
        Kind::Image => "image",
    }
}

/// A count or size as a gauge value; sizes beyond `i64` (8 EiB) are shown as its maximum.
fn gauge<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
