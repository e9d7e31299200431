//! Following the remote tree while the view is mounted (DESIGN §5).
//!
//! Writer hosts add, re-tag and remove images in the shared tree at any time. A *round*
//! brings the view up to date with it:
//!
//! 1. **scan** the shared areas, incrementally (`layout::Scanner`, whose module docs list
//!    what each scan looks at and how late each kind of change is seen): unchanged
//!    directories are not listed, unchanged objects are not parsed again. A scan that finds
//!    nothing new ends the round here, so an idle round costs the scan's `stat`s only;
//!    otherwise only the objects the scan changed, and those that depend on them, are
//!    judged again (see `layout::rejudge`);
//! 2. **diff** the new ready sets against the index the kernel was told about: added,
//!    removed and changed objects ([`diff`]), walking both indexes side by side in id
//!    order (an object both share is unchanged at a glance);
//! 3. **swap** the view's index ([`View::swap_index`]): a request sees the old index or
//!    the new one, never a mixture, since it takes one `Arc` of it for its whole lookup;
//! 4. **invalidate** exactly the kernel cache entries the diff touches ([`invalidate`]).
//!
//! Rounds run on the refresher thread, every `refresh` interval, on demand (the control
//! socket's `refresh`, `SIGUSR1`), and on inotify events when the remote is a local
//! filesystem ([`watch`]). Requests reach the thread through a `crossbeam-channel`; an
//! on-demand request carries the channel its [`RoundReport`] goes back on.
//!
//! # A remote that does not answer, is replaced, or vanishes
//!
//! The scan itself runs on a separate, disposable thread, and the refresher waits for it at
//! most `scan_timeout`. A scan that does not come back in time (an NFS server that stopped
//! answering), or that fails on the remote root or an area with an error saying the remote
//! is unwell (`ENOTCONN`, `ESTALE`, `EIO`, …), makes the round fail:
//!
//! - the remote is marked unhealthy, with the time it became so and the error, in `status`;
//! - the last good index stays in place (or, with `hide_unhealthy`, an empty one is swapped
//!   in and the remote objects disappear from the view until the remote is back);
//! - a scan thread that is stuck is abandoned, never joined; while it stays stuck, later
//!   rounds fail at once instead of stacking more stuck threads on the dead mount. When it
//!   returns, the next round scans again, and the first good scan makes the remote healthy.
//!
//! A scan that ran short of descriptors or memory on this host (`EMFILE`, `ENOMEM`, …,
//! anywhere: see [`layout::ran_short`]) fails its round too, but says nothing about the
//! remote: the view stays as it was (hidden or not), the remote's health does not change,
//! and the next round judges every object afresh. Taken at its word, such a scan would
//! drop every object it could not open from the view.
//!
//! Each scan also opens the remote root afresh and reads what it is ([`anchor`]): the device
//! and inode of the root and of the areas. A round whose remote is empty while the view
//! shows objects fails the same way ("vanished": an unmounted share leaves its empty mount
//! directory behind), unless the operator said the remote was emptied on purpose
//! ([`RefreshHandle::accept_empty`]). A round whose root or areas are other directories
//! than in the last accepted round hands the fresh root to the view, which detaches every
//! node of a shared object, and drops their names from the kernel's cache: the next lookup
//! opens the new tree ([`View::replace_remote`]).
//!
//! The refresher thread and the control socket never wait on the remote longer than
//! `scan_timeout`: not for a scan, nor for the kernel to take a round's invalidations, which
//! wait for any lookup stuck on the remote in the same directory (see `notice`). Requests
//! never wait on it unless they need remote data: those run on the remote pool (see
//! `fs::remote`), and everything else (the root, the layout directories, which are listed
//! from the index, container directories) never touches the remote.
//!
//! # Not-ready objects
//!
//! Not-ready objects are re-checked every round (a pull in progress becomes ready when the
//! writer finishes). Each is logged when it becomes not ready or its reason changes, and
//! once more when it becomes ready or goes away: not once per round.

pub mod anchor;
pub mod diff;
mod handle;
pub mod invalidate;
pub mod journal;
mod scanning;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{never, select, tick, unbounded, Receiver};
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use crate::journal::follow::Named;
use crate::layout::{watch, LayoutIndex, Scanner};
use crate::notice::{Notice, Notices};
use crate::report::{Kind, NotReadyRef, RemoteHealth, RoundReport};
use crate::view::View;
use anchor::{Anchor, Probed};
use diff::Diff;
pub use handle::RefreshHandle;
use handle::{Request, State};
use scanning::{Failure, Scanned, Slot};

/// How long inotify events are collected before they trigger one round: a pull writes many
/// files in a burst.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// How rounds are scheduled and what happens when the remote fails.
#[derive(Debug, Clone)]
pub struct Options {
    /// Time between rounds; zero = only on demand.
    pub interval: Duration,
    /// How long a scan may take before the remote counts as not answering.
    pub scan_timeout: Duration,
    /// Hide remote objects while the remote does not answer, instead of serving the last
    /// good index.
    pub hide_unhealthy: bool,
    /// Watch the remote with inotify when it is a local filesystem.
    pub inotify: bool,
    /// Follow the remote's publication journal when there is one (DESIGN §14).
    pub journal: bool,
    /// Time between two reads of the journal's bell.
    pub journal_poll: Duration,
}

/// What a light scan looks at per area besides what changed: objects taken in turn.
const LIGHT_BUDGET: usize = 1;

/// While the journal is followed, a timed round is full at least this often.
const FULL_WHILE_FOLLOWING: Duration = Duration::from_secs(30 * 60);

/// One light round in this many looks at what the remote root is ([`anchor`]): while a
/// journal is followed, a replaced remote also shows as a journal gone or gone back.
const ANCHOR_EVERY_LIGHT: u64 = 6;

/// What a round reads of the remote.
#[derive(Debug, Clone)]
enum Scope {
    /// Every area; `light` when the journal is followed (see [`Scanner::set_light`]).
    Whole { light: bool },
    /// Only the objects a journal named.
    Named(Named),
}

impl Default for Options {
    fn default() -> Self {
        Options {
            interval: Duration::from_secs(5),
            scan_timeout: Duration::from_secs(30),
            hide_unhealthy: false,
            inotify: true,
            journal: true,
            journal_poll: Duration::from_millis(200),
        }
    }
}

/// What a mount is, as `status` names it.
#[derive(Debug, Clone, Default)]
pub struct MountInfo {
    pub mountpoint: PathBuf,
    pub remote: PathBuf,
    pub local: PathBuf,
    pub driver: String,
}

/// Something that scans the remote: the incremental [`Scanner`], or a stand-in in tests.
pub trait Source: Send + 'static {
    /// The new index, or `None` when nothing changed since the last one returned (only
    /// allowed when `force` is false).
    fn scan(&mut self, force: bool) -> Result<Option<LayoutIndex>, String>;

    /// The remote root opened afresh, with its identity (see [`anchor`]); `None` for a
    /// source that is not a tree.
    fn anchor(&mut self) -> Option<Result<Probed, String>> {
        None
    }

    /// Brings only the named objects up to date (a journal named them); by default, a scan.
    fn scan_named(&mut self, named: &Named) -> Result<Option<LayoutIndex>, String> {
        let _ = named;
        self.scan(false)
    }

    /// Makes the following scans light or full (see [`Scanner::set_light`]).
    fn set_light(&mut self, budget: Option<usize>) {
        let _ = budget;
    }
}

impl Source for Scanner {
    fn scan_named(&mut self, named: &Named) -> Result<Option<LayoutIndex>, String> {
        let result = Scanner::scan_named(self, &named.layers, &named.images).map_err(|e| e.0);
        debug!(
            layers = named.layers.len(),
            images = named.images.len(),
            changed = matches!(result, Ok(Some(_))),
            "named objects scanned"
        );
        result
    }

    fn set_light(&mut self, budget: Option<usize>) {
        Scanner::set_light(self, budget);
    }

    fn scan(&mut self, force: bool) -> Result<Option<LayoutIndex>, String> {
        let result = Scanner::scan_if_changed(self, force).map_err(|e| e.0);
        let stats = self.stats();
        debug!(
            listed = stats.listed,
            probed = stats.probed,
            reused = stats.reused,
            "remote scanned"
        );
        result
    }

    fn anchor(&mut self) -> Option<Result<Probed, String>> {
        Some(Anchor::probe(self.root(), self.driver()))
    }
}

/// The refresh engine: owns the scan source and runs rounds. Built before the mount (its
/// first round gives the view its index), then moved onto its own thread by [`start`].
///
/// [`start`]: Refresher::start
pub struct Refresher {
    view: Arc<View>,
    slot: Option<Slot>,
    /// Where rounds tell the kernel what they change, once started.
    notices: Option<Arc<Notices>>,
    state: Arc<Mutex<State>>,
    rx: Receiver<Request>,
    handle: Arc<RefreshHandle>,
    options: Options,
    remote: PathBuf,
    /// Not-ready objects and their reasons as last logged.
    reasons: BTreeMap<(Kind, String), String>,
    /// While the empty index stands in for a failed remote (`hide_unhealthy`): the index it
    /// hides, which a remote coming back empty is judged against.
    hidden: Option<Arc<LayoutIndex>>,
    /// What the remote was in the last accepted round.
    anchor: Option<Anchor>,
    /// Told of every round.
    metrics: Option<Arc<crate::metrics::Metrics>>,
    accept_empty: Arc<AtomicBool>,
    /// The next scan must yield an index even if nothing changed (first round, after a
    /// failure).
    force: bool,
    watcher: Option<watch::Watcher>,
    /// The journal follower's state, when the journal is followed.
    journal: Option<Arc<journal::Journal>>,
    /// Light rounds so far, for [`ANCHOR_EVERY_LIGHT`].
    light_rounds: u64,
    /// When the last full round started.
    last_full: Instant,
}

impl Refresher {
    pub fn new(
        view: Arc<View>,
        source: Box<dyn Source>,
        info: MountInfo,
        options: Options,
    ) -> Refresher {
        let (tx, rx) = unbounded();
        let now = SystemTime::now();
        let state = Arc::new(Mutex::new(State {
            rounds: 0,
            health: RemoteHealth {
                healthy: true,
                since: now,
                last_error: None,
            },
            last_round: None,
            socket: String::new(),
            interval: options.interval,
        }));
        let remote = info.remote.clone();
        let accept_empty = Arc::new(AtomicBool::new(false));
        let journal = (options.journal && !options.interval.is_zero())
            .then(|| Arc::new(journal::Journal::new(options.journal_poll)));
        let handle = Arc::new(RefreshHandle {
            tx,
            accept_empty: accept_empty.clone(),
            state: state.clone(),
            view: view.clone(),
            info,
            options: options.clone(),
            journal: journal.clone(),
        });
        Refresher {
            view,
            slot: Some(Slot::Idle(source)),
            notices: None,
            state,
            rx,
            handle,
            options,
            remote,
            reasons: BTreeMap::new(),
            hidden: None,
            anchor: None,
            metrics: None,
            accept_empty,
            force: true,
            watcher: None,
            journal,
            light_rounds: 0,
            last_full: Instant::now(),
        }
    }

    /// Has every round, from the next one on, counted in `metrics`.
    pub fn set_metrics(&mut self, metrics: Arc<crate::metrics::Metrics>) {
        self.metrics = Some(metrics);
    }

    /// The handle the control socket answers through.
    pub fn handle(&self) -> Arc<RefreshHandle> {
        self.handle.clone()
    }

    /// Starts the refresher thread. From now on rounds tell the kernel what they change,
    /// through `notices`.
    pub fn start(mut self, notices: Arc<Notices>) -> std::io::Result<JoinHandle<()>> {
        self.notices = Some(notices);
        if self.options.inotify && !self.options.interval.is_zero() {
            let driver = self.handle.info.driver.clone();
            let handle = Arc::downgrade(&self.handle);
            let wake = Box::new(move || {
                handle
                    .upgrade()
                    .is_some_and(|h| h.tx.send(Request::Wake).is_ok())
            });
            self.watcher = watch::Watcher::start(&self.remote, &driver, watch::Writers::Any, wake);
            if let Some(w) = &mut self.watcher {
                w.update(&self.view.index());
            }
        }
        if let Some(journal) = &self.journal {
            let tx = self.handle.tx.clone();
            let tell = Box::new(move |ask| tx.send(Request::Journal(ask)).is_ok());
            if let Err(e) = journal::start(self.remote.clone(), journal.clone(), tell) {
                warn!(error = %e, "journal thread not started: full scans every round");
                self.journal = None;
            }
        }
        std::thread::Builder::new()
            .name("refresh".into())
            .spawn(move || {
                let journal = self.journal.clone();
                self.run();
                if let Some(journal) = journal {
                    journal.stop();
                }
            })
    }

    fn run(mut self) {
        let ticker_for = |interval: Duration| {
            if interval.is_zero() {
                never()
            } else {
                tick(interval)
            }
        };
        let mut ticker = ticker_for(self.options.interval);
        loop {
            let mut asked = Asked::default();
            select! {
                recv(self.rx) -> msg => match msg {
                    Ok(Request::Wake) => {
                        // Let a burst of events settle into one round.
                        asked.whole = true;
                        let deadline = Instant::now() + DEBOUNCE;
                        while let Ok(msg) = self.rx.recv_deadline(deadline) {
                            if !asked.take(msg, &mut ticker, ticker_for) {
                                return;
                            }
                        }
                    }
                    Ok(msg) => {
                        if !asked.take(msg, &mut ticker, ticker_for) {
                            return;
                        }
                    }
                    Err(_) => return,
                },
                recv(ticker) -> _ => asked.whole = true,
            }
            // Everybody who asked before this round starts gets this round's report.
            while let Ok(msg) = self.rx.try_recv() {
                if !asked.take(msg, &mut ticker, ticker_for) {
                    return;
                }
            }
            if let Some(why) = &asked.gap {
                debug!(%why, "journal lost track of records: a full round");
            }
            let scope = if asked.full || asked.gap.is_some() {
                Scope::Whole { light: false }
            } else if asked.whole {
                // Light while the journal is followed, but for a full round now and then:
                // the safety net for what no record names (a writer without a publisher).
                let light = self.journal.as_ref().is_some_and(|j| j.live())
                    && self.last_full.elapsed() < FULL_WHILE_FOLLOWING;
                Scope::Whole { light }
            } else if !asked.named.is_empty() {
                Scope::Named(asked.named)
            } else {
                continue;
            };
            let report = self.round_of(scope);
            for reply in asked.replies {
                let _ = reply.send(report.clone());
            }
        }
    }

    /// Runs one full round: scan, diff, swap, invalidate; updates `status`.
    pub fn round(&mut self) -> RoundReport {
        self.round_of(Scope::Whole { light: false })
    }

    /// Runs one round over `scope`: scan, diff, swap, invalidate; updates `status`.
    fn round_of(&mut self, scope: Scope) -> RoundReport {
        let started = SystemTime::now();
        let clock = Instant::now();
        if matches!(scope, Scope::Whole { light: false }) {
            self.last_full = clock;
        }
        let scanned = self
            .scan(scope)
            .and_then(|scanned| self.accept(scanned).map_err(Failure::Remote));
        let (diff, error) = match scanned {
            Ok(None) => {
                self.set_health(true, None);
                (Diff::default(), None)
            }
            Ok(Some(index)) => {
                self.force = false;
                self.set_health(true, None);
                let old = if self.hidden.is_some() {
                    Arc::new(LayoutIndex::default())
                } else {
                    self.view.index()
                };
                let scanned = clock.elapsed();
                let diff = Diff::between(&old, &index);
                drop(old);
                let diffed = clock.elapsed();
                self.log_not_ready(&index);
                self.view.swap_index(index);
                let swapped = clock.elapsed();
                self.hidden = None;
                self.invalidate(&diff);
                if let Some(w) = &mut self.watcher {
                    w.update(&self.view.index());
                }
                debug!(
                    scan_ms = ms(scanned),
                    diff_ms = ms(diffed - scanned),
                    swap_ms = ms(swapped - diffed),
                    invalidate_ms = ms(clock.elapsed() - swapped),
                    "refresh round phases"
                );
                (diff, None)
            }
            Err(Failure::Local(error)) => {
                self.force = true;
                warn!(error = %error, "refresh round could not scan; the view stays as it was");
                (Diff::default(), Some(error))
            }
            Err(Failure::Remote(error)) => {
                self.force = true;
                self.set_health(false, Some(error.clone()));
                let mut diff = Diff::default();
                if self.options.hide_unhealthy && self.hidden.is_none() {
                    let empty = LayoutIndex::default();
                    let shown = self.view.index();
                    diff = Diff::between(&shown, &empty);
                    self.view.swap_index(empty);
                    self.hidden = Some(shown);
                    self.invalidate(&diff);
                }
                (diff, Some(error))
            }
        };
        let index = self.view.index();
        let report = RoundReport {
            started,
            duration: clock.elapsed(),
            added: diff.added,
            removed: diff.removed,
            changed: diff.changed,
            ready_layers: index.layers().count(),
            ready_images: index.images().count(),
            not_ready: not_ready_refs(&index),
            error,
        };
        let busy = !report.added.is_empty()
            || !report.removed.is_empty()
            || !report.changed.is_empty()
            || report.error.is_some();
        if busy {
            info!(
                added = report.added.len(),
                removed = report.removed.len(),
                changed = report.changed.len(),
                layers = report.ready_layers,
                images = report.ready_images,
                ms = report.duration.as_secs_f64() * 1000.0,
                error = report.error.as_deref().unwrap_or(""),
                "refresh round"
            );
        } else {
            debug!(
                ms = report.duration.as_secs_f64() * 1000.0,
                "refresh round: nothing changed"
            );
        }
        if let Some(m) = &self.metrics {
            m.refresh_round(&report);
        }
        let mut state = self.state.lock();
        state.rounds += 1;
        state.last_round = Some(report.clone());
        report
    }

    /// Decides what a scan that came back means for the view. A remote that is empty where
    /// the view has objects (or had them, before it was hidden) is taken for a share that
    /// went away (its empty mount directory left behind), not for one emptied on purpose,
    /// unless the operator said so: it fails the round, so the last good view stays. A
    /// remote whose root or areas are other directories than in the last accepted round was
    /// replaced: the view re-opens it and the kernel drops every name it cached below the
    /// shared areas.
    fn accept(&mut self, scanned: Scanned) -> Result<Option<LayoutIndex>, String> {
        let Scanned { index, probed } = scanned;
        let accept_empty = self.accept_empty.swap(false, AtomicOrdering::Relaxed);
        if let Some(index) = &index {
            let had = self.hidden.clone().unwrap_or_else(|| self.view.index());
            let (layers, images) = (had.layers().count(), had.images().count());
            if is_empty(index) && layers + images > 0 && !accept_empty {
                self.force = true;
                return Err(format!(
                    "remote vanished: {} holds no layers or images where {layers} layers and \
                     {images} images were (an unmounted share?); the last good view stays. \
                     If the remote was emptied on purpose, run `layerfs refresh --accept-empty {}`",
                    self.remote.display(),
                    self.handle.info.mountpoint.display(),
                ));
            }
        }
        if let Some(probed) = probed {
            let gone = self.anchor.and_then(|was| was.unmounted_in(&probed.anchor));
            if let Some(why) = gone.filter(|_| !accept_empty) {
                self.force = true;
                return Err(format!(
                    "remote vanished: {} {why}; the last good view stays. If it was \
                     unmounted on purpose, run `layerfs refresh --accept-empty {}`",
                    self.remote.display(),
                    self.handle.info.mountpoint.display(),
                ));
            }
            let replaced = self.anchor.and_then(|was| was.replaced_by(&probed.anchor));
            if let Some(why) = replaced {
                warn!(remote = %self.remote.display(), %why, "remote replaced: re-opening it");
                let names = self.view.replace_remote(probed.root, probed.anchor.root.0);
                self.drop_names(&names);
                // The next scans must not trust what they cached of the old tree.
                self.force = true;
            }
            let changed = self.view.set_layout_attrs(probed.layout);
            let notices = changed.into_iter().map(Notice::Inode).collect();
            self.tell_kernel(notices, "layout directories' attributes changed");
            self.anchor = Some(probed.anchor);
        }
        Ok(index)
    }

    /// Tells the kernel to drop the names `names` (parent, name) and what it cached of the
    /// layout directories holding them.
    fn drop_names(&self, names: &[(u64, std::ffi::OsString)]) {
        let parents: std::collections::BTreeSet<u64> = names.iter().map(|(p, _)| *p).collect();
        let notices = names
            .iter()
            .map(|(parent, name)| Notice::Entry(*parent, name.clone()))
            .chain(parents.into_iter().map(Notice::Inode))
            .collect();
        self.tell_kernel(notices, "names below the replaced remote dropped");
    }

    fn invalidate(&self, diff: &Diff) {
        let notices = invalidate::apply(&self.view, diff);
        self.tell_kernel(notices, "kernel caches invalidated");
    }

    /// Sends `notices`, waiting for them at most the scan timeout: past it, a request stuck
    /// on the remote holds a directory they need, and they are sent once it returns.
    fn tell_kernel(&self, notices: Vec<Notice>, what: &str) {
        let Some(kernel) = self.notices.as_ref().filter(|_| !notices.is_empty()) else {
            return;
        };
        let count = notices.len();
        match kernel.deliver(notices, self.options.scan_timeout) {
            Some(failed) => debug!(notices = count, failed, "{what}"),
            None => warn!(
                notices = count,
                "kernel cache invalidations are waiting for a directory a request stuck on \
                 the remote holds; refresh rounds go on, and they are sent once it returns"
            ),
        }
    }

    fn set_health(&self, healthy: bool, error: Option<String>) {
        let mut state = self.state.lock();
        let health = &mut state.health;
        if health.healthy != healthy {
            health.since = SystemTime::now();
            if healthy {
                info!(remote = %self.remote.display(), "remote answers again");
            } else {
                warn!(
                    remote = %self.remote.display(),
                    error = error.as_deref().unwrap_or(""),
                    "remote unhealthy"
                );
            }
        }
        health.healthy = healthy;
        if error.is_some() {
            health.last_error = error;
        }
    }

    /// Logs not-ready objects when their state changes, not every round.
    fn log_not_ready(&mut self, index: &LayoutIndex) {
        let now: BTreeMap<(Kind, String), String> = index
            .not_ready()
            .iter()
            .map(|nr| ((nr.kind.into(), nr.name.clone()), nr.reason.clone()))
            .collect();
        for (key, reason) in &now {
            if self.reasons.get(key) != Some(reason) {
                info!(kind = ?key.0, name = %key.1, %reason, "remote object not ready");
            }
        }
        for key in self.reasons.keys() {
            if !now.contains_key(key) {
                let ready = match key.0 {
                    Kind::Layer => index.layer(&key.1).is_some(),
                    Kind::Image => index.image(&key.1).is_some(),
                };
                let what = if ready { "now ready" } else { "gone" };
                info!(kind = ?key.0, name = %key.1, "remote object {what}");
            }
        }
        self.reasons = now;
    }
}

/// What was asked of the refresher since its last round.
#[derive(Default)]
struct Asked {
    replies: Vec<crossbeam_channel::Sender<RoundReport>>,
    /// A round over every area (timer, inotify): light while the journal is followed.
    whole: bool,
    /// A full round, never light: an operator asked for it.
    full: bool,
    /// A full round: why the journal lost track.
    gap: Option<String>,
    named: Named,
}

impl Asked {
    /// Takes one request in; `false` for a stop.
    fn take(
        &mut self,
        msg: Request,
        ticker: &mut Receiver<Instant>,
        ticker_for: impl Fn(Duration) -> Receiver<Instant>,
    ) -> bool {
        match msg {
            // Asked for by an operator (the control socket, SIGUSR1): a full look.
            Request::Round(reply) => {
                self.full = true;
                self.replies.extend(reply);
            }
            Request::Wake => self.whole = true,
            Request::Interval(i) => *ticker = ticker_for(i),
            Request::Journal(journal::Ask::Named(named)) => self.named.extend(named),
            Request::Journal(journal::Ask::Gap(why)) => self.gap = Some(why),
            Request::Stop => return false,
        }
        true
    }
}

/// A duration in milliseconds, for logs.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// An index of nothing at all: no object, ready or not.
fn is_empty(index: &LayoutIndex) -> bool {
    index.layers().next().is_none()
        && index.images().next().is_none()
        && index.not_ready().is_empty()
}

fn not_ready_refs(index: &LayoutIndex) -> Vec<NotReadyRef> {
    index
        .not_ready()
        .iter()
        .map(|nr| NotReadyRef {
            kind: nr.kind.into(),
            name: nr.name.clone(),
            reason: nr.reason.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests;
