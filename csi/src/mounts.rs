//! Node-side plumbing: loop devices for volume images, ext4 formatting, mounts.

use std::path::{Path, PathBuf};

use super::command::{run, run_accepting};
use super::error::{CsiError, Result};
use layerfs::store::mountinfo;

/// The loop device already attached to `disk`, if any.
pub async fn find_loop(disk: &Path) -> Result<Option<PathBuf>> {
    let out = run("losetup", ["-j".as_ref(), disk.as_os_str()]).await?;
    Ok(out
        .lines()
        .filter_map(|line| line.split_once(':').map(|(dev, _)| dev.trim()))
        .find(|dev| dev.starts_with("/dev/"))
        .map(PathBuf::from))
}

/// Attaches `disk` to a free loop device, or returns the one it is attached to.
pub async fn attach(disk: &Path) -> Result<PathBuf> {
    if let Some(dev) = find_loop(disk).await? {
        return Ok(dev);
    }
    let out = run(
        "losetup",
        ["--find".as_ref(), "--show".as_ref(), disk.as_os_str()],
    )
    .await?;
    let dev = out.trim();
    if dev.starts_with("/dev/") {
        Ok(PathBuf::from(dev))
    } else {
        Err(CsiError::Internal(format!(
            "losetup gave no device for {}",
            disk.display()
        )))
    }
}

/// Detaches every loop device attached to `disk`. A device still in use elsewhere (a mount
/// in another namespace) is only marked to go when its last user closes it, and stays
/// listed meanwhile: that is `FailedPrecondition`, for the caller to retry, rather than a
/// detach asked for again and again.
pub async fn detach_all(disk: &Path) -> Result<()> {
    let mut detached: Vec<PathBuf> = Vec::new();
    while let Some(dev) = find_loop(disk).await? {
        if detached.contains(&dev) {
            if leaves(disk, &dev).await? {
                continue;
            }
            return Err(CsiError::FailedPrecondition(format!(
                "{} still backs {}: it is in use, and goes when its last user closes it",
                dev.display(),
                disk.display()
            )));
        }
        let result = run("losetup", ["-d".as_ref(), dev.as_os_str()]).await;
        detached.push(dev.clone());
        if let Err(e) = result {
            // A device whose detach already went through stays listed for a moment while
            // the kernel tears it down, and detaching it again fails (ENXIO). Only a device
            // that stays attached is an error.
            if !leaves(disk, &dev).await? {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Whether `dev` stops backing `disk` within a couple of seconds.
async fn leaves(disk: &Path, dev: &Path) -> Result<bool> {
    for _ in 0..20 {
        if find_loop(disk).await?.as_deref() != Some(dev) {
            return Ok(true);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(false)
}

/// Makes the loop device see the current size of its file.
pub async fn refresh_size(dev: &Path) -> Result<()> {
    run("losetup", ["-c".as_ref(), dev.as_os_str()])
        .await
        .map(|_| ())
}

/// The filesystem type on `dev` ("" when the device holds no signature at all).
///
/// Only two answers of `blkid` are trusted: exit 0 with a type (a filesystem), and exit 2
/// (nothing found: an empty device). Anything else is an error, never "empty": the caller
/// formats an empty device, so a missing `blkid`, an I/O error or ambiguous signatures (exit 8)
/// must not look like one.
pub async fn fs_type(dev: &Path) -> Result<String> {
    let out = run_accepting(
        "blkid",
        [
            "-p".as_ref(),
            "-o".as_ref(),
            "export".as_ref(),
            dev.as_os_str(),
        ],
        &[0, 2],
    )
    .await
    .map_err(|e| {
        CsiError::FailedPrecondition(format!(
            "cannot tell whether {} holds a filesystem, so it is not formatted: {e}",
            dev.display()
        ))
    })?;
    parse_blkid_export(&out).map_err(|what| {
        CsiError::FailedPrecondition(format!(
            "{} holds {what} but no filesystem; refusing to format it",
            dev.display()
        ))
    })
}

/// The `TYPE` of `blkid -o export` output: "" when blkid found nothing; `Err` naming what was
/// found when that is something else than a filesystem (e.g. a partition table).
fn parse_blkid_export(out: &str) -> std::result::Result<String, String> {
    let mut fs = None;
    let mut other = None;
    for line in out.lines() {
        if let Some(t) = line.strip_prefix("TYPE=") {
            fs = Some(t.trim().to_owned());
        } else if let Some(t) = line.strip_prefix("PTTYPE=") {
            other = Some(format!("a {} partition table", t.trim()));
        }
    }
    match (fs, other) {
        (Some(t), _) if !t.is_empty() => Ok(t),
        (_, Some(what)) => Err(what),
        _ if out.trim().is_empty() => Ok(String::new()),
        _ => Err("an unknown signature".to_owned()),
    }
}

/// Formats `dev` as ext4.
pub async fn mkfs_ext4(dev: &Path) -> Result<()> {
    run("mkfs.ext4", ["-q".as_ref(), "-F".as_ref(), dev.as_os_str()])
        .await
        .map(|_| ())
}

/// Grows the ext4 filesystem on `dev` to fill it (online if it is mounted).
pub async fn grow_fs(dev: &Path) -> Result<()> {
    run("resize2fs", [dev.as_os_str()]).await.map(|_| ())
}

/// Size in bytes of the ext4 filesystem on `dev`, from its superblock.
pub async fn ext4_size(dev: &Path) -> Result<u64> {
    let out = run("dumpe2fs", ["-h".as_ref(), dev.as_os_str()]).await?;
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    match (field("Block count:"), field("Block size:")) {
        (Some(count), Some(size)) => Ok(count.saturating_mul(size)),
        _ => Err(CsiError::Internal(format!(
            "cannot read the filesystem size on {}",
            dev.display()
        ))),
    }
}

/// Grows the unmounted ext4 filesystem on `dev` to `size` bytes if it is smaller (a volume
/// restored into a bigger capacity, or expanded while unpublished). Checked first, as
/// resize2fs requires offline.
pub async fn grow_offline(dev: &Path, size: u64) -> Result<()> {
    if ext4_size(dev).await? >= size {
        return Ok(());
    }
    tracing::info!(device = %dev.display(), size, "growing the filesystem");
    run_accepting(
        "e2fsck",
        ["-f".as_ref(), "-y".as_ref(), dev.as_os_str()],
        &[0, 1],
    )
    .await?;
    run("resize2fs", [dev.as_os_str()]).await.map(|_| ())
}

pub async fn mount(
    dev: &Path,
    target: &Path,
    fstype: Option<&str>,
    options: &[String],
) -> Result<()> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    if let Some(t) = fstype {
        args.push("-t".into());
        args.push(t.into());
    }
    if !options.is_empty() {
        args.push("-o".into());
        args.push(options.join(",").into());
    }
    args.push(dev.into());
    args.push(target.into());
    run("mount", &args).await.map(|_| ())
}

pub async fn umount(target: &Path) -> Result<()> {
    run("umount", [target.as_os_str()]).await.map(|_| ())
}

/// What is mounted on top at a target path, as one volume sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Occupant {
    /// Not a mount point.
    Nothing,
    /// The volume's device: its ext4 filesystem (root and all), or the device node itself
    /// bound onto a file.
    Volume,
    /// Something else: `what` is its source and type, for messages.
    Other(String),
}

/// What is mounted on top at `target`, told from the mount table and the kernel's own device
/// numbers rather than from any record of the driver, so that the answer holds after a
/// restart or a lost record. `device` is the loop device the volume is attached to now (a
/// volume with none cannot be mounted anywhere). `target` must not be a symlink: callers
/// refuse those, as mount and umount would follow them elsewhere.
pub fn occupant(target: &Path, device: Option<&Path>) -> Result<Occupant> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let point = match std::fs::canonicalize(target) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Occupant::Nothing),
        Err(e) => return Err(CsiError::io(format!("resolving {}", target.display()), e)),
    };
    let table =
        mountinfo::read().map_err(|e| CsiError::io("reading the mount table".to_owned(), e))?;
    // Mounts stacked on one point are listed in mount order: the last one is what a path
    // lookup reaches, and what umount removes.
    let Some(top) = table.into_iter().rfind(|m| m.point == point) else {
        return Ok(Occupant::Nothing);
    };
    if let Some(device) = device {
        let rdev = std::fs::metadata(device)
            .map_err(|e| CsiError::io(format!("{}", device.display()), e))?
            .rdev();
        let numbers = format!("{}:{}", libc::major(rdev), libc::minor(rdev));
        if top.device == numbers && top.root == Path::new("/") {
            return Ok(Occupant::Volume);
        }
        let here = std::fs::metadata(target)
            .map_err(|e| CsiError::io(format!("{}", target.display()), e))?;
        if here.file_type().is_block_device() && here.rdev() == rdev {
            return Ok(Occupant::Volume);
        }
    }
    Ok(Occupant::Other(format!("{} ({})", top.source, top.fstype)))
}

/// Whether `dev` is mounted anywhere (as a filesystem source).
pub fn is_device_mounted(dev: &Path) -> bool {
    mountinfo::current()
        .iter()
        .any(|m| Path::new(&m.source) == dev)
}

#[cfg(test)]
mod tests {
    #[test]
    fn blkid_output() {
        use super::parse_blkid_export as p;
        assert_eq!(p(""), Ok(String::new()));
        assert_eq!(
            p("DEVNAME=/dev/loop0\nUUID=x\nTYPE=ext4\n"),
            Ok("ext4".into())
        );
        assert!(p("DEVNAME=/dev/loop0\nPTUUID=x\nPTTYPE=dos\n").is_err());
        assert!(p("DEVNAME=/dev/loop0\nUUID=x\n").is_err());
    }

    /// A loop device someone else still has open is only marked to go: detaching it
    /// again finds it listed again. That must end, as an error to retry, and the device
    /// must go once its last user closes it. Needs root and loop devices.
    #[tokio::test]
    async fn a_busy_loop_device_is_an_error_not_an_endless_detach() {
        use super::*;
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk.img");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let dev = attach(&disk).await.unwrap();
        let user = std::fs::File::open(&dev).unwrap();
        let detached =
            tokio::time::timeout(std::time::Duration::from_secs(20), detach_all(&disk)).await;
        drop(user);
        let gone = leaves(&disk, &dev).await.unwrap();
        if !gone {
            let _ = run("losetup", ["-d".as_ref(), dev.as_os_str()]).await;
        }
        let detached = detached.expect("detaching a busy device never ended");
        assert!(
            matches!(detached, Err(CsiError::FailedPrecondition(_))),
            "{detached:?}"
        );
        assert!(
            gone,
            "{} stays after its last user closed it",
            dev.display()
        );
    }
}
