//! Keeping the handles the view holds open within the process's limit.
//!
//! Every node the kernel holds keeps its object open (see `view::inodes`), so the kernel's
//! inode cache decides how many descriptors the daemon has open. The kernel trims that
//! cache only under memory pressure, and a walk over a few million files (a scanner, `du`)
//! fills it long before. Past 40 % of the open-file limit in nodes, the names of the
//! nodes handed out longest ago are dropped from the kernel's cache (`inval_entry`); a FUSE
//! inode nothing uses is evicted at once, so the kernel forgets those nodes and their
//! handles close. A name is looked up again, at the cost of one round trip, when next used.

use std::sync::{Arc, Weak};
use std::time::Duration;

use fuser::{INodeNo, Notifier};
use tracing::debug;

use crate::view::View;

/// How often the table is measured when it does not call.
const EVERY: Duration = Duration::from_secs(1);

/// Starts watching the inode table of `view` for as long as the view lives.
pub fn spawn(view: &Arc<View>, notifier: Notifier) -> std::io::Result<()> {
    let limit = open_file_limit();
    // Nodes, not descriptors: a merged directory holds two, open files hold one more each,
    // and the rest of the limit is headroom for lookups while the kernel forgets.
    let (high, low) = (limit * 2 / 5, limit / 4);
    let (tell, told) = crossbeam_channel::bounded(1);
    view.inodes.watch(high, tell);
    let view: Weak<View> = Arc::downgrade(view);
    std::thread::Builder::new()
        .name("trim".into())
        .spawn(move || loop {
            let _ = told.recv_timeout(EVERY);
            let Some(view) = view.upgrade() else {
                return;
            };
            let live = view.inodes.len();
            if live > high {
                let names = view.least_used_names(live - low);
                debug!(
                    live,
                    names = names.len(),
                    "dropping least used names from the kernel's cache"
                );
                for (parent, name) in names {
                    let _ = notifier.inval_entry(INodeNo(parent), &name);
                }
            }
        })
        .map(drop)
}

fn open_file_limit() -> usize {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft as usize)
}
