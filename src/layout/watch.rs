//! inotify on the remote's shared areas: rounds on events when the remote is a local
//! filesystem, and a publisher's view of its own host's writes on any filesystem.
//!
//! inotify reports changes made through the local kernel only: on NFS, CIFS, Ceph or FUSE a
//! writer on another host changes the tree without any event here, so there the timer
//! alone drives rounds and no watch is set.
//!
//! Watched: the three shared areas (objects appear and disappear there) and every object
//! directory in them, up to [`MAX_WATCHES`] (a re-tag renames a file inside an image
//! directory; a pull finishes by writing inside layer directories). An event does not say
//! what changed: it only wakes the refresher, which debounces a burst into one round, and
//! the round's incremental scan finds out. Events are a shortcut, never the only way a
//! change is seen: the timer keeps running.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use super::LayoutIndex;

/// Called on every batch of events; `false` once nobody listens any more, which ends the
/// watching thread.
pub type Wake = Box<dyn Fn() -> bool + Send>;

/// Whose writes a watcher is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writers {
    /// Anybody's: only worth watching where every write goes through this kernel.
    Any,
    /// This host's own: inotify reports them on any filesystem, NFS and FUSE included.
    ThisHost,
}

/// Each watch pins an inode in the kernel; beyond this many only the areas are watched.
pub const MAX_WATCHES: usize = 16384;

/// statfs magic numbers of filesystems where other hosts write without local events.
const REMOTE_FS: [i64; 8] = [
    0x6969,     // NFS
    0xFF534D42, // CIFS
    0xFE534D42, // SMB2
    0x517B,     // SMB
    0x00C36400, // Ceph
    0x65735546, // FUSE
    0x47504653, // GPFS
    0x0BD00BD0, // Lustre
];

/// The inotify watches on the remote's shared areas.
pub struct Watcher {
    inotify: Arc<Inotify>,
    remote: PathBuf,
    driver: String,
    watches: HashMap<PathBuf, WatchDescriptor>,
}

impl Watcher {
    /// Starts watching `remote`; for [`Writers::Any`], not if it is a network or FUSE
    /// filesystem (then `None`).
    pub fn start(remote: &Path, driver: &str, writers: Writers, wake: Wake) -> Option<Watcher> {
        match nix::sys::statfs::statfs(remote) {
            Ok(_) if writers == Writers::ThisHost => {}
            Ok(fs) if REMOTE_FS.contains(&fs.filesystem_type().0) => {
                tracing::debug!("remote is a network filesystem: no inotify, timer only");
                return None;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot tell the remote's filesystem: no inotify");
                return None;
            }
        }
        let inotify = match Inotify::init(InitFlags::IN_CLOEXEC) {
            Ok(i) => Arc::new(i),
            Err(e) => {
                tracing::warn!(error = %e, "inotify unavailable: timer-driven refresh only");
                return None;
            }
        };
        let reader = inotify.clone();
        let spawned = std::thread::Builder::new()
            .name("refresh-inotify".into())
            .spawn(move || read_events(&reader, wake));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "inotify thread not started");
            return None;
        }
        Some(Watcher {
            inotify,
            remote: remote.to_owned(),
            driver: driver.to_owned(),
            watches: HashMap::new(),
        })
    }

    /// Watches the areas and the object directories of `index` and of its not-ready
    /// objects; drops watches of directories no longer there.
    pub fn update(&mut self, index: &LayoutIndex) {
        let d = &self.driver;
        let areas = [
            self.remote.clone(),
            self.remote.join(d),
            self.remote.join(format!("{d}/RO")),
            self.remote.join(format!("{d}-layers")),
            self.remote.join(format!("{d}-layers/RO")),
            self.remote.join(format!("{d}-images")),
        ];
        let mut wanted: Vec<PathBuf> = areas.to_vec();
        let layer_ids = index.layers().map(|l| l.id.clone()).chain(
            index
                .not_ready()
                .iter()
                .filter(|nr| nr.kind == crate::layout::ObjectKind::Layer)
                .map(|nr| nr.name.clone()),
        );
        for id in layer_ids {
            wanted.push(areas[2].join(&id));
            wanted.push(areas[4].join(&id));
        }
        let image_ids = index.images().map(|i| i.id.clone()).chain(
            index
                .not_ready()
                .iter()
                .filter(|nr| nr.kind == crate::layout::ObjectKind::Image)
                .map(|nr| nr.name.clone()),
        );
        wanted.extend(image_ids.map(|id| areas[5].join(id)));
        wanted.truncate(MAX_WATCHES);

        let keep: std::collections::HashSet<&PathBuf> = wanted.iter().collect();
        let gone: Vec<PathBuf> = self
            .watches
            .keys()
            .filter(|p| !keep.contains(p))
            .cloned()
            .collect();
        for path in gone {
            if let Some(wd) = self.watches.remove(&path) {
                // Fails when the kernel already dropped it (directory deleted): fine.
                let _ = self.inotify.rm_watch(wd);
            }
        }
        let flags = AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF
            | AddWatchFlags::IN_ONLYDIR
            | AddWatchFlags::IN_DONT_FOLLOW;
        for (i, path) in wanted.into_iter().enumerate() {
            // The areas are added again every time: one deleted and created again has a
            // new inode the old watch does not follow (adding an existing watch is a no-op).
            if i >= areas.len() && self.watches.contains_key(&path) {
                continue;
            }
            if let Ok(wd) = self.inotify.add_watch(&path, flags) {
                self.watches.insert(path, wd);
            }
        }
    }
}

/// Turns events into wake-ups until nobody listens.
fn read_events(inotify: &Inotify, wake: Wake) {
    loop {
        match inotify.read_events() {
            Ok(events) if !events.is_empty() => {
                if !wake() {
                    return;
                }
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!(error = %e, "inotify read failed: timer-driven refresh only");
                return;
            }
        }
    }
}
