//! The refresh engine's handle: what the mount, the control socket and the signal and
//! inotify threads ask of the refresher thread, answered from its shared state and the
//! view's index without touching the remote.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crossbeam_channel::{bounded, Sender};
use parking_lot::Mutex;

use super::journal::{Ask, Journal};
use super::{not_ready_refs, MountInfo, Options};
use crate::report::{ImageInfo, LayerInfo, RemoteHealth, RoundReport, Status};
use crate::view::View;

/// What the handle asks of the refresher thread.
pub(super) enum Request {
    /// Run a round; the report goes back on the channel, if any.
    Round(Option<Sender<RoundReport>>),
    /// Something changed remotely (inotify): run a round soon.
    Wake,
    /// Rounds from now on run at this interval (zero: only on demand).
    Interval(Duration),
    /// What the journal follower asks for.
    Journal(Ask),
    Stop,
}

/// The state `status` reports, updated by every round.
pub(super) struct State {
    pub(super) rounds: u64,
    pub(super) health: RemoteHealth,
    pub(super) last_round: Option<RoundReport>,
    pub(super) socket: String,
    pub(super) interval: Duration,
}

/// The refresh engine's side of the control socket: status, rounds, layers and images
/// from the refresher's shared state and the view's index, without ever touching the remote itself.
pub struct RefreshHandle {
    pub(super) tx: Sender<Request>,
    /// The operator said an empty remote is what they want (see [`RefreshHandle::accept_empty`]).
    pub(super) accept_empty: Arc<AtomicBool>,
    pub(super) state: Arc<Mutex<State>>,
    pub(super) view: Arc<View>,
    pub(super) info: MountInfo,
    pub(super) options: Options,
    /// How the journal is followed, when it is.
    pub(super) journal: Option<Arc<Journal>>,
}

impl RefreshHandle {
    /// Records the control socket's path, which `status` shows.
    pub fn set_socket(&self, path: &Path) {
        self.state.lock().socket = path.display().to_string();
    }

    /// Asks for a round without waiting for it (`SIGUSR1`, inotify).
    pub fn trigger(&self) {
        let _ = self.tx.send(Request::Round(None));
    }

    /// Runs a round that accepts an empty remote tree where there were objects: the operator
    /// says the remote was emptied on purpose, not lost (see [`Refresher::round`]).
    pub fn accept_empty(&self) -> RoundReport {
        self.accept_empty.store(true, AtomicOrdering::Relaxed);
        self.refresh()
    }

    /// Changes the time between rounds of a running mount (zero: only on demand).
    pub fn set_interval(&self, interval: Duration) {
        self.state.lock().interval = interval;
        let _ = self.tx.send(Request::Interval(interval));
    }

    /// Asks the refresher thread to stop after its current round.
    pub fn stop(&self) {
        let _ = self.tx.send(Request::Stop);
    }

    /// The remote's health now.
    pub fn health(&self) -> RemoteHealth {
        self.state.lock().health.clone()
    }

    fn failed_report(&self, error: String) -> RoundReport {
        let index = self.view.index();
        RoundReport {
            started: SystemTime::now(),
            duration: Duration::ZERO,
            added: Vec::new(),
            removed: Vec::new(),
            changed: Vec::new(),
            ready_layers: index.layers().count(),
            ready_images: index.images().count(),
            not_ready: not_ready_refs(&index),
            error: Some(error),
        }
    }
}

/// What the control socket asks of the engine. None of it touches the remote.
impl RefreshHandle {
    /// The engine's state now (the mount adds its quota roots).
    pub fn status(&self) -> Status {
        let state = self.state.lock();
        Status {
            mountpoint: self.info.mountpoint.display().to_string(),
            remote: self.info.remote.display().to_string(),
            local: self.info.local.display().to_string(),
            driver: self.info.driver.clone(),
            socket: state.socket.clone(),
            refresh_interval_secs: state.interval.as_secs_f64(),
            rounds: state.rounds,
            remote_health: state.health.clone(),
            last_round: state.last_round.clone(),
            // Filled in by the mount, which knows them.
            quotas: Vec::new(),
            metrics: None,
            transport: None,
            log: None,
            daemon_pid: std::process::id(),
            keeper: None,
            journal: self.journal.as_ref().map(|j| j.info()),
        }
    }

    /// Runs a round now and reports it; a round already running is waited for, within the
    /// scan timeout.
    pub fn refresh(&self) -> RoundReport {
        let (tx, rx) = bounded(1);
        if self.tx.send(Request::Round(Some(tx))).is_err() {
            return self.failed_report("the refresh thread is not running".into());
        }
        // A round in progress finishes first, and each waits at most the scan timeout for
        // its scan and as long again for its invalidations.
        let wait = self.options.scan_timeout * 4 + Duration::from_secs(10);
        match rx.recv_timeout(wait) {
            Ok(report) => report,
            Err(_) => self.failed_report(format!(
                "no refresh round finished within {} s",
                wait.as_secs()
            )),
        }
    }

    /// The ready layers.
    pub fn layers(&self) -> Vec<LayerInfo> {
        self.view
            .index()
            .layers()
            .map(|l| LayerInfo {
                id: l.id.clone(),
                short: l.short.clone(),
                parent: l.parent.clone(),
            })
            .collect()
    }

    /// The ready images.
    pub fn images(&self) -> Vec<ImageInfo> {
        self.view
            .index()
            .images()
            .map(|i| ImageInfo {
                id: i.id.clone(),
                top_layer: i.top_layer.clone(),
                names: i.names.clone(),
            })
            .collect()
    }
}
