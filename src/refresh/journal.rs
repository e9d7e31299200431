//! Following the remote's publication journal (DESIGN §14).
//!
//! A thread of its own polls the bell every `journal_poll` ([`crate::journal::follow`]).
//! When records name objects, it hands their ids to the refresher, which looks at exactly
//! those ([`Ask::Named`]); when it lost track of records, it asks for a full round
//! ([`Ask::Gap`]). While the bell rings (publishers ring at least every
//! [`HEARTBEAT`]), the refresher's timed rounds are light scans, whose cost does not grow
//! with the tree. A journal that is absent, silent for too long, or unreadable puts the
//! reader back on full scans every round, and `status` says which and since when.
//!
//! The thread touches the remote only for the bell and the segments, and holds nothing
//! while it does: a stuck remote stalls this thread alone, its last poll ages, and the
//! refresher stops trusting the journal.
//!
//! Lock order: [`Journal::shared`] is a leaf; nothing is called while it is held.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use tracing::{debug, info, warn};

use crate::journal::follow::{Follower, Heard, Named};
use crate::journal::HEARTBEAT;
use crate::report::{JournalInfo, JournalState};

/// A bell silent for this long means no publisher is alive.
pub const STALE_AFTER: Duration = Duration::from_secs(3 * HEARTBEAT.as_secs());

/// What the follower thread, the refresher and `status` share.
pub struct Journal {
    shared: Mutex<Shared>,
    stop: AtomicBool,
    poll: Duration,
}

struct Shared {
    info: JournalInfo,
    /// When the last poll came back, whatever it found.
    polled: Option<Instant>,
}

impl Journal {
    pub fn new(poll: Duration) -> Journal {
        Journal {
            shared: Mutex::new(Shared {
                info: JournalInfo {
                    since: SystemTime::now(),
                    poll_ms: u64::try_from(poll.as_millis()).unwrap_or(u64::MAX),
                    ..JournalInfo::default()
                },
                polled: None,
            }),
            stop: AtomicBool::new(false),
            poll,
        }
    }

    /// Whether the journal is followed right now: the bell rings, and the last poll is
    /// recent (a poll stuck on the remote does not count as following).
    pub fn live(&self) -> bool {
        let shared = self.shared.lock();
        let fresh = self.poll * 3 + Duration::from_secs(2);
        shared.info.state == JournalState::Following
            && shared.polled.is_some_and(|at| at.elapsed() <= fresh)
    }

    pub fn info(&self) -> JournalInfo {
        self.shared.lock().info.clone()
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    fn set(&self, state: JournalState, detail: Option<String>) {
        let mut shared = self.shared.lock();
        shared.polled = Some(Instant::now());
        let info = &mut shared.info;
        if info.state != state {
            info.since = SystemTime::now();
            match state {
                JournalState::Following => info!("following the publication journal"),
                JournalState::Starting => {}
                _ => info!(
                    state = ?state,
                    detail = detail.as_deref().unwrap_or(""),
                    "not following the publication journal: full scans every round"
                ),
            }
        }
        info.state = state;
        info.detail = detail;
    }

    fn record(&self, heard: &Heard) {
        let mut shared = self.shared.lock();
        let info = &mut shared.info;
        info.polls += 1;
        info.named += heard.named.len() as u64;
        info.torn += heard.torn as u64;
        info.gaps += u64::from(heard.gap.is_some());
        if let Some(ring) = &heard.ring {
            info.last_publisher = Some(ring.publisher.clone());
            info.last_ring_ms = ring.unix_ms;
        }
    }
}

/// What the follower asks of the refresher.
pub enum Ask {
    /// Look at these objects now.
    Named(Named),
    /// Records were lost track of: a full round now.
    Gap(String),
}

/// Hands an [`Ask`] to the refresher; `false` once it is gone.
pub type Tell = Box<dyn Fn(Ask) -> bool + Send>;

/// Starts the follower thread for the remote at `remote`.
pub(super) fn start(
    remote: PathBuf,
    journal: Arc<Journal>,
    tell: Tell,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("refresh-journal".into())
        .spawn(move || follow(&remote, &journal, &tell))
}

fn follow(remote: &std::path::Path, journal: &Journal, tell: &Tell) {
    let mut follower = Follower::new(remote);
    let mut last_error: Option<String> = None;
    while !journal.stop.load(Ordering::Relaxed) {
        std::thread::sleep(journal.poll);
        let heard = match follower.poll() {
            Ok(heard) => heard,
            Err(e) => {
                let error = e.to_string();
                if last_error.as_deref() != Some(&error) {
                    warn!(error = %error, "publication journal unreadable");
                }
                journal.set(JournalState::Failing, Some(error.clone()));
                last_error = Some(error);
                continue;
            }
        };
        last_error = None;
        journal.record(&heard);
        if heard.absent {
            journal.set(JournalState::Absent, None);
            continue;
        }
        if heard.torn > 0 {
            warn!(
                lines = heard.torn,
                "publication journal: torn lines skipped"
            );
        }
        let quiet = follower.quiet_for();
        if quiet > STALE_AFTER {
            journal.set(
                JournalState::Stalled,
                Some(format!(
                    "the bell has been silent for {} s",
                    quiet.as_secs()
                )),
            );
        } else {
            journal.set(JournalState::Following, None);
        }
        if let Some(why) = heard.gap {
            debug!(%why, "publication journal: a full round");
            if !tell(Ask::Gap(why)) {
                return;
            }
        }
        if !heard.named.is_empty() && !tell(Ask::Named(heard.named)) {
            return;
        }
    }
}
