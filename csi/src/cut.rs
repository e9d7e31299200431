//! The cut: the point-in-time copy of a volume a snapshot is made from, kept durably in
//! `<store>/cuts/<image>.raw` until its image is complete.
//!
//! CreateSnapshot returns once the cut is taken, so the cut *is* the snapshot: whatever
//! happens afterwards (the volume is overwritten or deleted, the driver is stopped or killed),
//! the image must be made from it and from nothing else. It is therefore written to a temp
//! name, fsynced, renamed into place and its directory fsynced before the image's state file
//! records `cut: true` (itself written durably); a state that says `cut` always has its cut.
//! At start-up the driver resumes the export of every cut it finds a state for and removes
//! everything else here.
//!
//! The cuts live in the local store, not in the BackingImage directory: they are this node's
//! (the volume is), and next to the volumes a reflink copy is possible.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use super::error::{CsiError, Result};
use super::files::{self, TMP_PREFIX};
use super::hold::WriteHold;
use super::jobs::Cancel;
use super::names::is_plain;

const SUFFIX: &str = ".raw";

/// What must be quiesced to cut a volume: the published places of its loop device.
#[derive(Debug, Clone, Default)]
pub struct Quiesce {
    /// Mount targets (ext4 on the volume's loop device) to freeze during the cut.
    pub mounts: Vec<(PathBuf, PathBuf)>,
    /// Loop devices whose page cache is flushed before the cut (Block access writes).
    pub devices: Vec<PathBuf>,
}

/// The directory of durable cuts.
#[derive(Debug, Clone)]
pub struct Cuts {
    dir: PathBuf,
}

impl Cuts {
    pub fn open(dir: PathBuf) -> Result<Cuts> {
        fs::create_dir_all(&dir)
            .map_err(|e| CsiError::io(format!("creating {}", dir.display()), e))?;
        Ok(Cuts { dir })
    }

    /// Where the cut for the image `name` is kept.
    pub fn path(&self, name: &str) -> Option<PathBuf> {
        is_plain(name).then(|| self.dir.join(format!("{name}{SUFFIX}")))
    }

    /// Whether the cut for `name` exists.
    pub fn exists(&self, name: &str) -> bool {
        self.path(name).is_some_and(|p| p.is_file())
    }

    /// Cuts the volume `disk` for the image `name` and makes the cut durable. Blocking; run it
    /// off the async runtime. A cancelled cut stops its copy and leaves nothing.
    pub fn take(&self, name: &str, disk: &Path, quiesce: &Quiesce, cancel: &Cancel) -> Result<()> {
        let dest = self
            .path(name)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad image name {name:?}")))?;
        let tmp = files::temp_path(&self.dir, name);
        let result = cut_volume(disk, quiesce, &tmp, cancel).and_then(|()| {
            fs::rename(&tmp, &dest)
                .map_err(|e| CsiError::io(format!("storing the cut of {name}"), e))?;
            files::sync_dir(&self.dir)
        });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    /// Removes the cut of `name`; a missing one is fine.
    pub fn remove(&self, name: &str) {
        let Some(path) = self.path(name) else { return };
        match fs::remove_file(&path) {
            Ok(()) => tracing::debug!(image = %name, "removed cut"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(image = %name, error = %e, "cannot remove cut"),
        }
    }

    /// Start-up: removes temp files and every cut not in `keep` (one whose image is complete,
    /// deleted, or was never recorded as cut).
    pub fn clean(&self, keep: &HashSet<String>) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let kept = file
                .strip_suffix(SUFFIX)
                .is_some_and(|name| keep.contains(name));
            if kept {
                continue;
            }
            let path = entry.path();
            let result = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            let what = if file.starts_with(TMP_PREFIX) {
                "removed an interrupted cut"
            } else {
                "removed a cut nothing uses"
            };
            match result {
                Ok(()) => tracing::info!(path = %path.display(), "{what}"),
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
            }
        }
    }
}

/// Takes a point-in-time copy of a volume's disk into `dest` (sparse) and fsyncs it.
/// Blocking.
///
/// The guarantee: the copy is the volume at one instant, while writers keep running. Every
/// write acknowledged before that instant is in it and none started after, which is what a
/// crash at that instant would have left (crash-consistent).
/// - `Mount` publications: the ext4 filesystem is frozen (FIFREEZE, what `fsfreeze -f`
///   does) for the whole cut, which also writes its dirty pages and journal to the loop
///   device. Writers block until it is thawed, which always happens, also on error or
///   cancellation.
/// - The loop devices and the disk file are then fsynced, so that writes still in the block
///   device's page cache are in the file.
/// - The file is then copied at one instant: reflinked where the store can (FICLONE is
///   atomic against writes), else copied with the file's writers held out ([`WriteHold`]),
///   which also stops a `Block` publication's writes at the loop device. The pause is logged.
pub fn cut_volume(disk: &Path, quiesce: &Quiesce, dest: &Path, cancel: &Cancel) -> Result<()> {
    let mut frozen: Vec<Frozen> = Vec::new();
    for (target, device) in &quiesce.mounts {
        if let Some(f) = Frozen::freeze(target, device)? {
            frozen.push(f);
        }
    }
    for device in &quiesce.devices {
        sync_file(device)?;
    }
    sync_file(disk)?;
    let copied = copy(disk, dest, quiesce, cancel);
    drop(frozen);
    copied?;
    sync_file(dest)
}

/// `FICLONE` from `linux/fs.h`: `_IOW(0x94, 9, int)`.
const FICLONE: u64 = 0x4004_9409;
/// How much is read at a time under a hold; all-zero chunks stay holes in the copy.
const CHUNK: usize = 1 << 20;

/// Copies `disk` to `dest` (which must not exist) at one instant.
fn copy(disk: &Path, dest: &Path, quiesce: &Quiesce, cancel: &Cancel) -> Result<()> {
    use std::os::unix::io::AsRawFd;
    let source = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(disk)
        .map_err(|e| CsiError::io(format!("opening {}", disk.display()), e))?;
    let target = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| CsiError::io(format!("creating {}", dest.display()), e))?;
    // SAFETY: FICLONE takes the source fd as its argument; both fds are open for the call.
    if unsafe { libc::ioctl(target.as_raw_fd(), FICLONE as _, source.as_raw_fd()) } == 0 {
        tracing::info!(disk = %disk.display(), "cut taken by reflink");
        return Ok(());
    }
    let cause = std::io::Error::last_os_error();
    if !matches!(
        cause.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY)
    ) {
        return Err(CsiError::io(
            format!("reflinking {}", disk.display()),
            cause,
        ));
    }
    let hold = match WriteHold::take(&source) {
        Ok(hold) => Some(hold),
        // A volume published nowhere has no writers to hold.
        Err(e) if quiesce.mounts.is_empty() && quiesce.devices.is_empty() => {
            tracing::debug!(disk = %disk.display(), error = %e, "copying an unpublished volume without a hold");
            None
        }
        Err(e) => {
            return Err(CsiError::Unavailable(format!(
                "cannot hold the writes of {} for its cut: {e}",
                disk.display()
            )))
        }
    };
    let copied = copy_plainly(&source, &target, cancel);
    if let Some(hold) = hold {
        let pause = hold.held();
        drop(hold);
        tracing::info!(disk = %disk.display(), pause_ms = pause.as_secs_f64() * 1e3, "cut taken with writes held");
    }
    copied.map_err(|e| match e {
        Copy::Cancelled(e) => e,
        Copy::Io(e) => CsiError::io(format!("copying {}", disk.display()), e),
    })
}

/// Whether `bytes` are all zero, a word at a time: this runs while writers wait.
fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: any bytes are valid u64s; `align_to` splits off what is not aligned.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

enum Copy {
    Cancelled(CsiError),
    Io(std::io::Error),
}

impl From<std::io::Error> for Copy {
    fn from(e: std::io::Error) -> Copy {
        Copy::Io(e)
    }
}

/// Copies `source` into the empty `target`, leaving holes where `source` reads as zeros.
/// Plain reads and writes only: under a [`WriteHold`], anything that takes the source's
/// inode lock (`SEEK_DATA`, `FICLONE`, `copy_file_range` on some filesystems) would wait
/// for the hold forever.
fn copy_plainly(
    source: &fs::File,
    target: &fs::File,
    cancel: &Cancel,
) -> std::result::Result<(), Copy> {
    use std::os::unix::fs::FileExt;
    let size = source.metadata()?.len();
    let mut buf = vec![0u8; CHUNK];
    let mut at = 0u64;
    while at < size {
        if cancel.is_cancelled() {
            return Err(Copy::Cancelled(cancel.error()));
        }
        let want = (size - at).min(CHUNK as u64) as usize;
        let chunk = &mut buf[..want];
        source.read_exact_at(chunk, at)?;
        if !is_zero(chunk) {
            target.write_all_at(chunk, at)?;
        }
        at += want as u64;
    }
    target.set_len(size)?;
    Ok(())
}

fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| CsiError::io(format!("syncing {}", path.display()), e))
}

/// Start-up: thaws the filesystem mounted at `target` if it is the one on `device` and is
/// frozen. A driver killed during a cut never thawed what it froze, and every writer of that
/// volume would hang until someone did.
pub fn thaw_leftover(target: &Path, device: &Path) {
    use std::os::unix::io::AsRawFd;
    let dir = match open_mount_of(target, device) {
        Ok(Some(dir)) => dir,
        Ok(None) => return,
        Err(e) => {
            tracing::debug!(target = %target.display(), error = %e, "not checking for a freeze");
            return;
        }
    };
    // SAFETY: as for FIFREEZE. EINVAL: it was not frozen, the usual case.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), FITHAW as _, 0) };
    if rc == 0 {
        tracing::warn!(target = %target.display(), "thawed a filesystem an interrupted cut left frozen");
    }
}

/// The directory `target`, opened, if it is the root of a mount of `device`: freezing or
/// thawing a directory that is no longer such a mount point would act on the host filesystem
/// that holds it.
fn open_mount_of(target: &Path, device: &Path) -> Result<Option<fs::File>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let dir = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(target)
    {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CsiError::io(format!("opening {}", target.display()), e)),
    };
    let dev = fs::metadata(device).map_err(|e| CsiError::io(format!("{}", device.display()), e))?;
    let here = dir
        .metadata()
        .map_err(|e| CsiError::io(format!("{}", target.display()), e))?;
    if here.dev() != dev.rdev() {
        tracing::info!(target = %target.display(), "not a mount of the volume any more");
        return Ok(None);
    }
    Ok(Some(dir))
}

/// `_IOWR('X', 119, int)` and `_IOWR('X', 120, int)` from `linux/fs.h`.
const FIFREEZE: u64 = 0xC004_5877;
const FITHAW: u64 = 0xC004_5878;

/// How many [`Frozen`] hold each filesystem this process froze, by its device number.
/// Two cuts of one volume at once, or two publications of it in one cut, freeze the same
/// superblock: the kernel refuses the second FIFREEZE (`EBUSY`), and the filesystem must stay
/// frozen until the last of them is done. Locked across FIFREEZE and FITHAW themselves, so
/// that no cut copies a filesystem another is still freezing; cuts are rare.
static FROZEN: LazyLock<Mutex<HashMap<u64, usize>>> = LazyLock::new(Mutex::default);

/// A frozen filesystem; thawed when the last holder of it is dropped.
struct Frozen {
    dir: fs::File,
    dev: u64,
    target: PathBuf,
}

impl Frozen {
    /// Freezes the filesystem mounted at `target`, which must be the one on `device`
    /// ([`open_mount_of`]), or holds it frozen if this process froze it already. The open
    /// directory also keeps the mount from going away while frozen. `None` when `target` is
    /// no longer a mount of `device`. A filesystem frozen by another process is refused:
    /// that process may thaw it in the middle of the copy.
    fn freeze(target: &Path, device: &Path) -> Result<Option<Frozen>> {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;
        let Some(dir) = open_mount_of(target, device)? else {
            return Ok(None);
        };
        let dev = dir
            .metadata()
            .map_err(|e| CsiError::io(format!("{}", target.display()), e))?
            .dev();
        let mut frozen = FROZEN.lock().unwrap_or_else(|e| e.into_inner());
        let holders = frozen.entry(dev).or_insert(0);
        if *holders == 0 {
            // SAFETY: FIFREEZE takes no argument; the fd is open for the duration of the call.
            let rc = unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE as _, 0) };
            if rc != 0 {
                frozen.remove(&dev);
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EBUSY) {
                    return Err(CsiError::Aborted(format!(
                        "the filesystem on {} is frozen by another process; retry once it is \
                         thawed",
                        target.display()
                    )));
                }
                return Err(CsiError::io(format!("freezing {}", target.display()), e));
            }
            tracing::debug!(target = %target.display(), "froze filesystem");
        }
        *holders += 1;
        Ok(Some(Frozen {
            dir,
            dev,
            target: target.to_owned(),
        }))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        use std::os::unix::io::AsRawFd;
        let mut frozen = FROZEN.lock().unwrap_or_else(|e| e.into_inner());
        let Some(holders) = frozen.get_mut(&self.dev) else {
            return;
        };
        *holders -= 1;
        if *holders > 0 {
            return;
        }
        frozen.remove(&self.dev);
        // SAFETY: as for FIFREEZE.
        let rc = unsafe { libc::ioctl(self.dir.as_raw_fd(), FITHAW as _, 0) };
        if rc != 0 {
            tracing::error!(target = %self.target.display(), error = %std::io::Error::last_os_error(),
                "cannot thaw filesystem; run fsfreeze -u on it");
        } else {
            tracing::debug!(target = %self.target.display(), "thawed filesystem");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A fresh ext4 in an image file, mounted through a loop device of its own; unmounted
    /// and detached on drop. Needs root.
    struct Ext4 {
        _dir: tempfile::TempDir,
        mnt: PathBuf,
        device: PathBuf,
    }

    impl Ext4 {
        fn new() -> Ext4 {
            let dir = tempfile::tempdir().unwrap();
            let image = dir.path().join("fs.img");
            fs::File::create(&image).unwrap().set_len(32 << 20).unwrap();
            let run = |cmd: &mut Command| {
                let out = cmd.output().unwrap();
                assert!(out.status.success(), "{cmd:?}: {out:?}");
                String::from_utf8(out.stdout).unwrap().trim().to_owned()
            };
            run(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&image));
            let device = PathBuf::from(run(Command::new("losetup")
                .args(["--find", "--show"])
                .arg(&image)));
            let mnt = dir.path().join("mnt");
            fs::create_dir(&mnt).unwrap();
            let ext4 = Ext4 {
                _dir: dir,
                mnt,
                device,
            };
            run(Command::new("mount").arg(&ext4.device).arg(&ext4.mnt));
            ext4
        }
    }

    impl Drop for Ext4 {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.mnt).status();
            let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
        }
    }

    /// Two cuts of one volume at once: the first to finish must not thaw the filesystem
    /// under the second, whose copy would then take in writes made during it.
    #[test]
    fn a_filesystem_stays_frozen_until_its_last_cut_is_done() {
        let ext4 = Ext4::new();
        let first = Frozen::freeze(&ext4.mnt, &ext4.device).unwrap();
        let second = Frozen::freeze(&ext4.mnt, &ext4.device).unwrap();
        assert!(
            first.is_some() && second.is_some(),
            "both cuts hold it frozen"
        );
        drop(first);
        let (tx, rx) = mpsc::channel();
        let file = ext4.mnt.join("written");
        std::thread::spawn(move || {
            let _ = tx.send(fs::write(file, b"x"));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "written while the second cut holds the filesystem frozen"
        );
        drop(second);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("written once thawed")
            .unwrap();
    }
}
