//! Scans run on a disposable thread each, which the refresher waits for at most the scan
//! timeout: a scan stuck on a remote that stopped answering is abandoned, never joined.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::SystemTime;

use crossbeam_channel::{bounded, Receiver};

use super::anchor::Probed;
use super::{Refresher, Scope, Source, ANCHOR_EVERY_LIGHT, LIGHT_BUDGET};
use crate::layout::{self, LayoutIndex};

/// The scan source, or the thread it is busy on.
pub(super) enum Slot {
    Idle(Box<dyn Source>),
    Busy {
        rx: Receiver<ScanDone>,
        since: SystemTime,
    },
}

/// What a scan thread brings back: the source, the remote root it opened (with what it
/// is) and the scan's result.
pub(super) type ScanDone = (Box<dyn Source>, Result<Scanned, Failure>);

/// Why a round left the view as it was.
pub(super) enum Failure {
    /// The remote failed, or is not to be believed: it is unhealthy.
    Remote(String),
    /// This host ran short of descriptors or memory while scanning. Nothing is known of the
    /// remote, whose health stays as it was; the next round judges every object afresh.
    Local(String),
}

/// A scan's result: the new index (`None`: nothing changed) and the remote root as it is now.
pub(super) struct Scanned {
    pub(super) index: Option<LayoutIndex>,
    pub(super) probed: Option<Probed>,
}

impl Refresher {
    /// Runs the scan on a disposable thread, waiting at most the scan timeout.
    pub(super) fn scan(&mut self, scope: Scope) -> Result<Scanned, Failure> {
        let source = match self.slot.take() {
            Some(Slot::Idle(source)) => source,
            Some(Slot::Busy { rx, since }) => match rx.try_recv() {
                // The stuck scan came back: its result is old, scan again.
                Ok((source, _)) => source,
                Err(_) => {
                    let secs = SystemTime::now()
                        .duration_since(since)
                        .unwrap_or_default()
                        .as_secs();
                    self.slot = Some(Slot::Busy { rx, since });
                    return Err(Failure::Remote(format!(
                        "remote not answering: a scan started {secs} s ago has not returned"
                    )));
                }
            },
            None => {
                return Err(Failure::Local(
                    "no scanner (an earlier scan thread could not start)".into(),
                ))
            }
        };
        let force = self.force;
        let light = matches!(scope, Scope::Whole { light: true }) && !force;
        let anchor = if light {
            self.light_rounds += 1;
            self.light_rounds % ANCHOR_EVERY_LIGHT == 1
        } else {
            true
        };
        let (tx, rx) = bounded::<ScanDone>(1);
        let worker = std::thread::Builder::new()
            .name("refresh-scan".into())
            .spawn(move || {
                let mut source = source;
                layout::ran_short();
                let result = catch_unwind(AssertUnwindSafe(|| match scope {
                    // Named objects only: the areas and the root are the next round's.
                    Scope::Named(named) if !force => Ok(Scanned {
                        index: source.scan_named(&named)?,
                        probed: None,
                    }),
                    _ => {
                        source.set_light(light.then_some(LIGHT_BUDGET));
                        let probed = match anchor {
                            true => source.anchor().transpose()?,
                            false => None,
                        };
                        let index = source.scan(force)?;
                        Ok(Scanned { index, probed })
                    }
                }))
                .unwrap_or_else(|_| Err("the scan panicked".to_owned()));
                let result = match layout::ran_short() {
                    // Whatever the scan made of it: an error names the first casualty.
                    true => Err(Failure::Local(format!(
                        "this host ran short of descriptors or memory while scanning{}",
                        result.err().map(|e| format!(": {e}")).unwrap_or_default()
                    ))),
                    false => result.map_err(Failure::Remote),
                };
                let _ = tx.send((source, result));
            });
        if let Err(e) = worker {
            return Err(Failure::Local(format!("cannot start a scan thread: {e}")));
        }
        match rx.recv_timeout(self.options.scan_timeout) {
            Ok((source, result)) => {
                self.slot = Some(Slot::Idle(source));
                result
            }
            Err(_) => {
                self.slot = Some(Slot::Busy {
                    rx,
                    since: SystemTime::now(),
                });
                Err(Failure::Remote(format!(
                    "remote not answering: scan did not finish within {} s",
                    self.options.scan_timeout.as_secs_f64()
                )))
            }
        }
    }
}
