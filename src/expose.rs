//! `--expose-into ROOT`: the view's `<driver>/`, `<driver>-layers/` and `<driver>-images/`
//! bind-mounted into a directory of a regular filesystem.
//!
//! iSulad's overlay2 driver looks at `statfs().f_type` of the directory holding its driver
//! home and refuses filesystems it does not know, FUSE among them: a storage root that is
//! the view itself cannot start. Bind mounts keep the view's content and its FUSE `f_type`
//! below ROOT, while ROOT itself stays on the filesystem iSulad checks.
//!
//! The binds hold the FUSE superblock alive: unmounting the view alone would not end the
//! session. So the daemon watches the mount table and withdraws its binds once its own
//! mount is gone, and again (lazily) when it exits. A daemon that was killed leaves binds
//! whose connection is dead; the next mount finds them and replaces them instead of
//! stacking its own on top.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use parking_lot::Mutex;

use crate::fs::kernel_mount::{self, FSTYPE};
use crate::store::mountinfo::{self, Mount};

/// `statfs().f_type` of a FUSE filesystem.
pub const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// How many mounts may stand stacked at one target before replacing them stops: more than
/// any sequence of crashed daemons leaves, and a bound on a loop that unmounts.
const MAX_STACKED: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ExposeError {
    #[error("expose-into {}: {reason}: {source}", path.display())]
    Sys {
        path: PathBuf,
        reason: &'static str,
        #[source]
        source: Errno,
    },
    #[error(
        "expose-into {}: a {fstype} mount of {source_name} is there and is not layerfs's to replace; unmount it first",
        path.display()
    )]
    Foreign {
        path: PathBuf,
        fstype: String,
        source_name: String,
    },
    #[error(
        "expose-into {}: the live layerfs mount at {} is exposed there already; unmount it first",
        path.display(),
        mountpoint.display()
    )]
    Live { path: PathBuf, mountpoint: PathBuf },
    #[error("expose-into {}: more than {MAX_STACKED} stale mounts are stacked there", path.display())]
    Stacked { path: PathBuf },
}

/// The directories of the view that are exposed, for graph driver `driver`.
pub fn names(driver: &str) -> [String; 3] {
    [
        driver.to_owned(),
        format!("{driver}-layers"),
        format!("{driver}-images"),
    ]
}

/// Why `root` cannot take the binds, checked before anything is mounted.
pub fn unsuitable(root: &Path) -> Option<String> {
    // f_type's width differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    match nix::sys::statfs::statfs(root) {
        Ok(fs) if fs.filesystem_type().0 as i64 == FUSE_SUPER_MAGIC => Some(
            "is on a FUSE filesystem; it must be on a regular one (that is what iSulad checks)"
                .into(),
        ),
        Ok(_) => None,
        Err(e) => Some(format!("statfs: {e}")),
    }
}

/// The mount on top at `point`.
fn top_at(table: &[Mount], point: &Path) -> Option<Mount> {
    table.iter().rfind(|m| m.point == point).cloned()
}

/// Removes what stands at `target` from earlier mounts of `mountpoint` or from daemons that
/// are gone, so that the new bind is the only one there. A bind of another live layerfs
/// mount, or any other filesystem, is left alone and refused.
fn clear_stale(target: &Path, mountpoint: &Path) -> Result<(), ExposeError> {
    for _ in 0..MAX_STACKED {
        let table = mountinfo::current();
        let Some(top) = top_at(&table, target) else {
            return Ok(());
        };
        if top.fstype != FSTYPE {
            return Err(ExposeError::Foreign {
                path: target.to_owned(),
                fstype: top.fstype,
                source_name: top.source,
            });
        }
        let dead = matches!(
            kernel_mount::ask_root(target),
            Err(Errno::ENOTCONN | Errno::ECONNABORTED)
        );
        // The view it shows, if that is still mounted somewhere.
        let main = table
            .iter()
            .find(|m| m.device == top.device && m.root == Path::new("/") && m.fstype == FSTYPE);
        if let Some(main) = main {
            if !dead && main.point != mountpoint {
                return Err(ExposeError::Live {
                    path: target.to_owned(),
                    mountpoint: main.point.clone(),
                });
            }
        }
        nix::mount::umount2(target, MntFlags::MNT_DETACH).map_err(|source| ExposeError::Sys {
            path: target.to_owned(),
            reason: "detaching a stale bind",
            source,
        })?;
        tracing::info!(
            target = %target.display(),
            source = %top.source,
            dead,
            "replaced a stale bind an earlier mount left"
        );
    }
    Err(ExposeError::Stacked {
        path: target.to_owned(),
    })
}

/// A bind this daemon made: the target and the mount id it got.
#[derive(Debug)]
struct Bind {
    target: PathBuf,
    id: u64,
}

/// The binds of a mount; dropping it withdraws them.
#[derive(Debug)]
pub struct Exposed {
    binds: Mutex<Vec<Bind>>,
    withdrawn: AtomicBool,
}

/// Binds the view's layout dirs at `mountpoint` into `root`, creating the target dirs as
/// needed. The view must be served already: the binds look their sources up through it.
pub fn expose(root: &Path, mountpoint: &Path, driver: &str) -> Result<Exposed, ExposeError> {
    let exposed = Exposed {
        binds: Mutex::new(Vec::new()),
        withdrawn: AtomicBool::new(false),
    };
    for name in names(driver) {
        let target = root.join(&name);
        let source = mountpoint.join(&name);
        let sys = |reason| {
            let path = target.clone();
            move |source| ExposeError::Sys {
                path,
                reason,
                source,
            }
        };
        // A killed daemon's dead bind answers ENOTCONN to everything: clear before mkdir.
        clear_stale(&target, mountpoint)?;
        match nix::unistd::mkdir(&target, nix::sys::stat::Mode::from_bits_truncate(0o700)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(sys("creating the directory")(e)),
        }
        nix::mount::mount(
            Some(&source),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(sys("bind-mounting the view's directory"))?;
        let id = top_at(&mountinfo::current(), &target).map_or(0, |m| m.id);
        exposed.binds.lock().push(Bind { target, id });
    }
    tracing::info!(root = %root.display(), "view exposed");
    Ok(exposed)
}

impl Exposed {
    /// Detaches the binds still in place. Lazily: a container running on them keeps what it
    /// uses, and the view's daemon serves it until it lets go.
    pub fn withdraw(&self) {
        self.withdrawn.store(true, Ordering::Release);
        let binds = std::mem::take(&mut *self.binds.lock());
        if binds.is_empty() {
            return;
        }
        let table = mountinfo::current();
        for bind in binds {
            // Another mount may have replaced ours meanwhile; that one is not ours to remove.
            if top_at(&table, &bind.target).is_none_or(|m| m.id != bind.id) {
                continue;
            }
            if let Err(e) = nix::mount::umount2(&bind.target, MntFlags::MNT_DETACH) {
                tracing::warn!(error = %e, target = %bind.target.display(), "detaching a bind failed");
            }
        }
        tracing::info!("view no longer exposed");
    }

    /// Waits until the mount of the view (mount id `view`) is gone from the mount table,
    /// then withdraws the binds. Returns early once they are withdrawn otherwise.
    pub fn withdraw_when_unmounted(&self, view: u64) {
        let mut table = mountinfo::Table::open().ok();
        while !self.withdrawn.load(Ordering::Acquire) {
            // Only a table that was read and lacks the view says it is gone: an unreadable
            // one (the daemon at its open-file limit) says nothing.
            let read = match table.as_mut() {
                Some(table) => table.read().ok(),
                None => mountinfo::read().ok(),
            };
            if read.is_some_and(|mounts| !mounts.iter().any(|m| m.id == view)) {
                self.withdraw();
                return;
            }
            wait_for_mount_change(table.as_ref().map(mountinfo::Table::file));
        }
    }
}

/// Blocks until the mount table changes, or for a second: `poll` on mountinfo reports a
/// change as `POLLPRI` to a reader that has read the table since, which the caller has just
/// done; the timeout keeps a missed wake-up (or no /proc) from lasting.
fn wait_for_mount_change(info: Option<&std::fs::File>) {
    use std::os::fd::AsFd;
    let Some(file) = info else {
        std::thread::sleep(std::time::Duration::from_secs(1));
        return;
    };
    let mut fd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&file.as_fd()),
        events: libc::POLLPRI,
        revents: 0,
    };
    // SAFETY: one pollfd that lives across the call.
    unsafe { libc::poll(&mut fd, 1, 1000) };
}

impl Drop for Exposed {
    fn drop(&mut self) {
        self.withdraw();
    }
}

/// The mount id of the `fuse.layerfs` mount on top at `mountpoint`.
pub fn view_mount_id(mountpoint: &Path) -> Option<u64> {
    top_at(&mountinfo::current(), mountpoint)
        .filter(|m| m.fstype == FSTYPE)
        .map(|m| m.id)
}
