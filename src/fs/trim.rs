//! Keeping the handles the view holds open within the process's limit.
//!
//! Every node the kernel holds keeps its object open (see `view::inodes`), so the kernel's
//! inode cache decides how many descriptors the daemon has open. The kernel trims that
//! cache only under memory pressure, and a walk over a few million files (a scanner, `du`)
//! fills it long before. Once the nodes may hold 60 % of the open-file limit (one
//! descriptor a node, two for a directory: its local and remote parts), the names of the
//! nodes handed out longest ago are dropped from the kernel's cache (`inval_entry`); a FUSE
//! inode nothing uses is evicted at once, so the kernel forgets those nodes and their
//! handles close. A name is looked up again, at the cost of one round trip, when next used.
//!
//! The kernel drops a name only with its directory locked, and a lookup waiting on a
//! stalled remote holds its directory (shared) for as long as the remote stalls. Names in
//! directories whose lookups may ask the remote are therefore handed to the notices' queue
//! near the remote (see `notice`), which such a stall may hold up, while threads of this
//! module go on dropping the names in local directories: local paths keep their descriptors
//! whatever the remote does. Those threads take one directory each, since a local directory
//! can be held too: by a create waiting for a descriptor (see [`Droppers`]). While that
//! queue is held up, a round takes as many more names as it handed it, since those free
//! nothing.
//!
//! Trimming runs beside the requests that fill the table, and the kernel forgets what it
//! drops a little later: a burst of new names can use up the descriptors first. A request
//! that opens objects is served on the FUSE thread that read it, and one that finds no
//! descriptor free there hands its reply back, marks the table crowded (see
//! `InodeTable::run_short`: its nodes may be below the mark while open files, merged
//! directories and files the kernel has not yet released hold more) and is served again
//! on a pool of its own (see `fs::dispatch`), where it waits for descriptors to be freed
//! ([`patiently`]) instead of failing with `EMFILE`: a `mkdir` must not fail because the
//! daemon keeps handles. The FUSE threads never wait so: they read the FORGETs that free
//! descriptors. The directories the kernel holds for a request on that pool are marked
//! held from the moment it is handed over (see `View::held_for`), so their names go to the
//! queue near the remote and no dropping waits on them; whether a directory is held is
//! asked for each name, just before it is dropped.
//!
//! The kernel detaches every mount on or below a name it is told to drop, so the names of
//! mountpoints in the view and of the directories above them are never dropped: a
//! container's root mounted on `overlay/<cid>/merged` must outlive any walk. The mounts are
//! read from this process's mount table each round; a mount only another mount namespace
//! sees is not known here.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use parking_lot::Mutex;
use tracing::{debug, warn};

use crate::fs::kernel_mount::FSTYPE;
use crate::fs::pool;
use crate::notice::{Kernel, Notices};
use crate::store::mountinfo;
use crate::view::View;

/// How often the table is measured when it does not call.
const EVERY: Duration = Duration::from_secs(1);

/// How long a call that finds no descriptor free waits for trimming to free one.
const PATIENCE: Duration = Duration::from_secs(5);
/// How often it tries again meanwhile.
const RETRY: Duration = Duration::from_millis(5);

/// Starts watching the inode table of `view`, mounted at `mountpoint`, for as long as the
/// view lives. Names near the remote go to `notices`.
pub fn spawn(view: &Arc<View>, notices: Arc<Notices>, mountpoint: &Path) -> std::io::Result<()> {
    let kernel = notices
        .kernel()
        .ok_or_else(|| std::io::Error::other("trimming needs the session's notices started"))?;
    let mountpoint = mountinfo::resolve_mountpoint(mountpoint);
    let (high, low) = marks(open_file_limit());
    let (tell, told) = crossbeam_channel::bounded(1);
    view.inodes.watch(high, low, tell);
    // Opened now: a round is most needed when the daemon has no descriptor left to open it.
    let mut table = mountinfo::Table::open()?;
    let droppers = Droppers::start(kernel)?;
    let view: Weak<View> = Arc::downgrade(view);
    std::thread::Builder::new()
        .name("trim".into())
        .spawn(move || loop {
            let _ = told.recv_timeout(EVERY);
            let Some(view) = view.upgrade() else {
                return;
            };
            let live = view.inodes.held();
            // Crowded, the table is taken down to `low` even below `high`: a request may
            // wait on the crowd pool until it is.
            if live > high || (live > low && view.inodes.crowded()) {
                // Without the table no name is known to be safe to drop: wait for the next round.
                let mounts = match table.read() {
                    Ok(mounts) => mounts,
                    Err(e) => {
                        warn!(error = %e, "mount table unreadable, not trimming this round");
                        continue;
                    }
                };
                let pinned = pinned(&mounts, &mountpoint);
                let near = |parent: u64| view.dir_may_wait(parent);
                let want = live - low;
                let mut names = view.least_used_names(want, &pinned);
                // While a stall holds up the names near the remote (their queue does not
                // drain), those free nothing: as many more are taken, so that local names
                // go on being dropped.
                if notices.near_remote_waiting() {
                    let held = names.iter().filter(|(p, _)| near(*p)).count();
                    if held > 0 {
                        names = view.least_used_names(want + held, &pinned);
                    }
                }
                debug!(
                    live,
                    names = names.len(),
                    "dropping least used names from the kernel's cache"
                );
                let mut local: HashMap<u64, Vec<OsString>> = HashMap::new();
                for (parent, name) in names {
                    if near(parent) {
                        notices.trim_near_remote(parent, name);
                    } else {
                        local.entry(parent).or_default().push(name);
                    }
                }
                droppers.drop_names(local);
            }
        })
        .map(drop)
}

/// Runs `call`, which opens descriptors, again while it fails for want of them, for up to
/// [`PATIENCE`], on a pool's worker: trimming frees descriptors as the kernel forgets, and
/// so do the kernel's RELEASEs of closed files, which it sends in the background. The wait
/// does not end when the table leaves the crowd: the nodes may be few while open files
/// (closed, but not yet released) hold the descriptors.
pub fn patiently<T>(mut call: impl FnMut() -> Result<T, Errno>) -> Result<T, Errno> {
    let out_of_descriptors =
        |r: &Result<T, Errno>| r.as_ref().is_err_and(|e| out_of_descriptors(*e));
    let result = call();
    if !out_of_descriptors(&result) || !pool::on_worker() {
        return result;
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        std::thread::sleep(RETRY);
        let result = call();
        if !out_of_descriptors(&result) || Instant::now() >= deadline {
            return result;
        }
    }
}

/// Whether a call failed for want of a descriptor, the process's or the system's.
pub fn out_of_descriptors(e: Errno) -> bool {
    matches!(e, Errno::EMFILE | Errno::ENFILE)
}

/// Threads that drop names in local directories, one directory's names at a time. A drop
/// waits for its directory's lock, which the kernel may hold for a request that is itself
/// waiting for a descriptor (see [`patiently`]): that directory then holds up one thread
/// and its own names, and the others go on freeing descriptors, which lets the request
/// finish. A directory whose names are being dropped gets no more until they are.
struct Droppers {
    jobs: crossbeam_channel::Sender<(u64, Vec<OsString>)>,
    /// Directories handed to a thread and not yet done. Lock order: a leaf lock.
    busy: Arc<Mutex<HashSet<u64>>>,
}

/// Directories whose names can be being dropped at once.
const DROPPERS: usize = 8;

impl Droppers {
    /// Starts the threads; they end once the `Droppers` is dropped and their work done.
    fn start(kernel: Arc<dyn Kernel>) -> std::io::Result<Droppers> {
        let (jobs, queue) = crossbeam_channel::bounded::<(u64, Vec<OsString>)>(DROPPERS);
        let busy: Arc<Mutex<HashSet<u64>>> = Arc::default();
        for i in 0..DROPPERS {
            let (queue, busy, kernel) = (queue.clone(), busy.clone(), kernel.clone());
            std::thread::Builder::new()
                .name(format!("trim-drop-{i}"))
                .spawn(move || {
                    for (parent, names) in queue {
                        for name in names {
                            let _ = kernel.inval_entry(parent, &name);
                        }
                        busy.lock().remove(&parent);
                    }
                })?;
        }
        Ok(Droppers { jobs, busy })
    }

    /// Hands each directory's names to a thread, skipping directories still being done;
    /// what finds every thread busy is left for a later round.
    fn drop_names(&self, names: HashMap<u64, Vec<OsString>>) {
        for (parent, names) in names {
            if !self.busy.lock().insert(parent) {
                continue;
            }
            if self.jobs.try_send((parent, names)).is_err() {
                self.busy.lock().remove(&parent);
                return;
            }
        }
    }
}

/// The paths, relative to the view's root, of everything mounted on the view and of every
/// directory above those mounts. The view is reached at `mountpoint` and through any bind
/// of it (`--expose-into`, a runtime's own): a mount below a bind stands on the view too.
fn pinned(mounts: &[mountinfo::Mount], mountpoint: &Path) -> HashSet<PathBuf> {
    let mut pinned = HashSet::new();
    let Some(view) = mounts
        .iter()
        .rfind(|m| m.point == mountpoint && m.fstype == FSTYPE)
    else {
        return pinned;
    };
    // Where each mount of the view's filesystem shows which of its directories.
    let binds: Vec<(&Path, &Path)> = mounts
        .iter()
        .filter(|m| m.device == view.device && m.fstype == FSTYPE)
        .map(|m| {
            (
                m.point.as_path(),
                m.root.strip_prefix("/").unwrap_or(&m.root),
            )
        })
        .collect();
    for mount in mounts {
        for (point, shows) in &binds {
            let Ok(below) = mount.point.strip_prefix(point) else {
                continue;
            };
            if below.as_os_str().is_empty() {
                continue;
            }
            let mut path = PathBuf::new();
            for part in shows.join(below).components() {
                path.push(part);
                pinned.insert(path.clone());
            }
        }
    }
    pinned
}

/// Where trimming starts and where it stops, for an open-file limit of `limit`: in the
/// descriptors the nodes may hold (a directory counted as two, merged or not). The rest of
/// the limit is headroom for open files and for lookups while the kernel forgets.
fn marks(limit: usize) -> (usize, usize) {
    (limit * 3 / 5, limit * 2 / 5)
}

/// The most descriptors [`grow_descriptor_table`] makes room for: 512 KiB of the kernel's
/// memory.
const TABLE_AT_START: usize = 1 << 16;

/// Grows the process's descriptor table, before any request is served, to hold as many
/// descriptors as the nodes may before trimming starts (at most [`TABLE_AT_START`]).
///
/// The kernel grows the table by doubling it, and in a process of several threads every
/// doubling waits for an RCU grace period (7–19 ms measured), during which no thread of the
/// process can open a descriptor. Every node holds one, so a new mount's requests stalled
/// all together at 256, 512, … 8192 nodes: six stalls in its first 10 000 creates, 7 µs a
/// create on average. Called while the daemon has one thread, before it serves, the table
/// grows once, with no grace period and no request waiting. A grown table is never shrunk.
pub fn grow_descriptor_table() {
    use nix::fcntl::{fcntl, open, FcntlArg, OFlag};
    use std::os::fd::{FromRawFd, OwnedFd};

    let (high, _) = marks(open_file_limit());
    let top = high.min(TABLE_AT_START).saturating_sub(1);
    let Ok(root) = open(
        "/",
        OFlag::O_PATH | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    ) else {
        return;
    };
    // A duplicate at the top number or above makes the table hold it; closing it keeps the table.
    if let Ok(fd) = fcntl(&root, FcntlArg::F_DUPFD_CLOEXEC(top as i32)) {
        // SAFETY: `fd` was just made by F_DUPFD_CLOEXEC and nothing else owns it.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

fn open_file_limit() -> usize {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_on_the_view_pin_their_paths_and_the_ones_above() {
        let info = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
40 22 0:50 / /v rw - fuse.layerfs r rw
41 40 0:51 / /v/overlay/c1/merged rw - overlay overlay rw
42 40 0:52 / /v/binds/resolv.conf rw - tmpfs t rw
43 22 0:53 / /v2/x rw - tmpfs t rw
44 22 0:50 /overlay /srv/storage/overlay rw - fuse.layerfs r rw
45 44 0:54 / /srv/storage/overlay/c2/merged rw - overlay overlay rw
46 22 0:60 / /other rw - fuse.layerfs r2 rw
47 46 0:61 / /other/x rw - tmpfs t rw
";
        let mounts: Vec<_> = mountinfo::parse(info).collect();
        let pinned = pinned(&mounts, Path::new("/v"));
        let mut got: Vec<_> = pinned
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                "binds",
                "binds/resolv.conf",
                "overlay",
                "overlay/c1",
                "overlay/c1/merged",
                "overlay/c2",
                "overlay/c2/merged"
            ]
        );
        assert!(super::pinned(&mounts, Path::new("/nothing")).is_empty());
        // Through a bind alone, the directories above the mount are pinned too.
        let through_bind: Vec<_> = mounts
            .into_iter()
            .filter(|m| m.point != Path::new("/v/overlay/c1/merged"))
            .collect();
        let pinned = super::pinned(&through_bind, Path::new("/v"));
        assert!(pinned.contains(Path::new("overlay")) && pinned.contains(Path::new("overlay/c2")));
    }
}
