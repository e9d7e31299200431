//! `layerfs publish --watch REMOTE`: the publisher that runs on a writer host beside the
//! runtime writing the shared tree, and journals what that runtime makes ready (DESIGN §14).
//!
//! It sees the host's own writes through inotify, which reports them on any filesystem (NFS
//! and CephFS included: only other hosts' writes go unreported), and judges the tree by the
//! same rules and the same incremental scanner readers use. So a record says what a reader
//! will find once it looks: a layer or image that became ready, changed, or is gone. A scan
//! also runs every `interval`, for what inotify missed (a watch not yet set on a directory
//! created a moment ago, a write by another process on a host without a publisher).
//!
//! Before it appends, the publisher flushes the remote's filesystem on this host
//! (`syncfs`), so the objects a record names are on the server before the record is; the
//! record is durable before the ring; a reader acts on rings only.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};
use tracing::{debug, info, warn};

use crate::journal::bell::{self, Ring};
use crate::journal::record::{is_publisher_name, Body, Event};
use crate::journal::segment::Writer;
use crate::journal::{self, JournalError, HEARTBEAT};
use crate::layout::watch::{Watcher, Writers};
use crate::layout::{Fingerprint, LayoutIndex, Scanner};
use crate::report::Kind;

/// How `publish --watch` runs.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    pub remote: PathBuf,
    pub driver: String,
    /// The publisher's name in the journal; the host name by default.
    pub name: Option<String>,
    /// Time between scans that no event asked for.
    pub interval: Duration,
    /// Past this size a segment is sealed and the next begun.
    pub segment_limit: u64,
}

impl WatchOptions {
    pub fn new(remote: &Path) -> WatchOptions {
        WatchOptions {
            remote: remote.to_owned(),
            driver: "overlay".to_owned(),
            name: None,
            interval: Duration::from_secs(5),
            segment_limit: 4 << 20,
        }
    }
}

/// After an event, scans follow at these delays too: a pull writes a directory's files
/// after creating it, before the watch on it is set.
const FOLLOW_UPS: [Duration; 3] = [
    Duration::from_millis(300),
    Duration::from_secs(1),
    Duration::from_secs(3),
];

/// Events are collected this long before they make one scan.
const DEBOUNCE: Duration = Duration::from_millis(50);

/// What the publisher last judged ready, with the fingerprints that tell a change.
type Judged = BTreeMap<(Kind, String), Fingerprint>;

/// Runs the publisher until `stop` receives (or is dropped).
pub fn watch(options: &WatchOptions, stop: Receiver<()>) -> Result<(), JournalError> {
    let name = match &options.name {
        Some(name) => name.clone(),
        None => host_name(),
    };
    if !is_publisher_name(&name) {
        return Err(JournalError::BadName(name));
    }
    let dir = journal::dir_of(&options.remote);
    let io_at = |path: &Path| {
        let path = path.to_owned();
        move |source| JournalError::Io {
            path,
            error: source,
        }
    };
    let remote = std::fs::File::open(&options.remote).map_err(io_at(&options.remote))?;
    match std::fs::create_dir(&dir) {
        Ok(()) => journal::sync_dir(&options.remote).map_err(io_at(&options.remote))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_at(&dir)(e)),
    }
    let mut writer = Writer::begin(&dir, &name, options.segment_limit)?;
    let bell_path = dir.join(journal::BELL);
    let ring = |writer: &Writer| -> Result<(), JournalError> {
        let (generation, length) = writer.position();
        let ring = Ring {
            publisher: writer.publisher().to_owned(),
            generation,
            length,
            token: token(),
            unix_ms: journal::unix_ms(),
        };
        bell::ring(&bell_path, &ring).map_err(io_at(&bell_path))
    };

    let (wake_tx, wake_rx) = bounded::<()>(1);
    let wake = Box::new(move || {
        !matches!(
            wake_tx.try_send(()),
            Err(crossbeam_channel::TrySendError::Disconnected(_))
        )
    });
    let mut watcher = Watcher::start(&options.remote, &options.driver, Writers::ThisHost, wake);
    if watcher.is_none() {
        warn!("no inotify: changes are journaled at the next scan only");
    }
    let mut scanner = Scanner::new(&options.remote, &options.driver);
    // What is ready already is found by every reader's own first scan: not journaled.
    let first = scanner.scan().map_err(|e| JournalError::Io {
        path: options.remote.clone(),
        error: std::io::Error::other(e.0),
    })?;
    let mut judged = judged_of(&first);
    if let Some(w) = &mut watcher {
        w.update(&first);
    }
    ring(&writer)?;
    let mut last_ring = Instant::now();
    info!(
        publisher = %name,
        remote = %options.remote.display(),
        layers = first.layers().count(),
        images = first.images().count(),
        "publishing: journaling what this host makes ready"
    );

    let mut next_scan = Instant::now() + options.interval;
    let mut follow_ups: Vec<Instant> = Vec::new();
    loop {
        let due = follow_ups
            .first()
            .copied()
            .unwrap_or(next_scan)
            .min(next_scan);
        let deadline = due.min(last_ring + HEARTBEAT);
        crossbeam_channel::select! {
            recv(stop) -> _ => break,
            recv(wake_rx) -> _ => {
                std::thread::sleep(DEBOUNCE);
                let _ = wake_rx.try_recv();
                let now = Instant::now();
                follow_ups = FOLLOW_UPS.iter().map(|d| now + *d).collect();
                next_scan = now;
            }
            default(deadline.saturating_duration_since(Instant::now())) => {}
        }
        let now = Instant::now();
        if now >= due || now >= next_scan {
            follow_ups.retain(|at| *at > now);
            next_scan = now + options.interval;
            match scanner.scan_if_changed(false) {
                Ok(Some(index)) => {
                    let now_judged = judged_of(&index);
                    let bodies = changes(&judged, &now_judged);
                    if !bodies.is_empty() {
                        // The objects named reach the server before the records naming them.
                        if let Err(e) = nix::unistd::syncfs(&remote) {
                            warn!(error = %e, "syncfs of the remote failed; journaling anyway");
                        }
                        let count = bodies.len();
                        writer.append(bodies)?;
                        ring(&writer)?;
                        last_ring = Instant::now();
                        info!(records = count, "journaled");
                    }
                    judged = now_judged;
                    if let Some(w) = &mut watcher {
                        w.update(&index);
                    }
                }
                Ok(None) => {}
                Err(e) => warn!(error = %e.0, "scan of the remote failed; retrying"),
            }
        }
        if last_ring.elapsed() >= HEARTBEAT {
            // Readers take a bell that stays silent for long for a publisher gone.
            ring(&writer)?;
            last_ring = Instant::now();
            debug!("heartbeat");
        }
    }
    info!(publisher = %name, "publisher stopped");
    Ok(())
}

fn judged_of(index: &LayoutIndex) -> Judged {
    let layers = index
        .layers_with_fingerprints()
        .map(|(l, f)| ((Kind::Layer, l.id.clone()), f.clone()));
    let images = index
        .images_with_fingerprints()
        .map(|(i, f)| ((Kind::Image, i.id.clone()), f.clone()));
    layers.chain(images).collect()
}

/// The records that take readers from `old` to `new`: layers before images, so a reader
/// that acts on part of a batch never looks for an image before its layers.
fn changes(old: &Judged, new: &Judged) -> Vec<Body> {
    let mut bodies = Vec::new();
    for ((kind, id), fingerprint) in new {
        let event = match old.get(&(*kind, id.clone())) {
            None => Event::Ready,
            Some(was) if was.files_differ(fingerprint) => Event::Changed,
            Some(_) => continue,
        };
        bodies.push(Body::Object {
            event,
            kind: *kind,
            id: id.clone(),
        });
    }
    for (kind, id) in old.keys().filter(|key| !new.contains_key(*key)) {
        bodies.push(Body::Object {
            event: Event::Removed,
            kind: *kind,
            id: id.clone(),
        });
    }
    bodies
}

/// This host's name, made fit for a publisher name.
fn host_name() -> String {
    let name: String = super::place::host_name()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        "publisher".to_owned()
    } else {
        name
    }
}

/// A value no earlier ring had.
fn token() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got == 8 {
        u64::from_ne_bytes(bytes)
    } else {
        // No entropy to be had: the clock in nanoseconds still differs from ring to ring.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_become_publisher_names() {
        assert!(is_publisher_name(&host_name()));
    }

    #[test]
    fn tokens_differ() {
        assert_ne!(token(), token());
    }
}
