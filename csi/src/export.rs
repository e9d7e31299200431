//! Image conversions with `qemu-img`: exporting a volume to raw or qcow2, restoring an image
//! into a raw volume, probing what a file is, and checksumming it.

use std::path::{Path, PathBuf};

use super::command::run;
use super::error::{CsiError, Result};

pub const RAW: &str = "raw";
pub const QCOW2: &str = "qcow2";

/// What `qemu-img info` says about an image file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: String,
    pub virtual_size: u64,
}

/// Checks an export type (`raw` or `qcow2`).
pub fn check_export_type(value: &str) -> Result<()> {
    if value == RAW || value == QCOW2 {
        Ok(())
    } else {
        Err(CsiError::InvalidArgument(format!(
            "unsupported export type {value:?}: use \"raw\" or \"qcow2\""
        )))
    }
}

/// What must be quiesced to cut a volume: the published places of its loop device.
#[derive(Debug, Clone, Default)]
pub struct Quiesce {
    /// Mount targets (ext4 on the volume's loop device) to freeze during the cut.
    pub mounts: Vec<(PathBuf, PathBuf)>,
    /// Loop devices whose page cache is flushed before the cut (Block access writes).
    pub devices: Vec<PathBuf>,
}

/// Takes a point-in-time copy of a volume's disk into `dest` (sparse, reflinked where the
/// filesystem can). Blocking; run it off the async runtime.
///
/// The guarantee: the copy holds everything written to the volume before the cut started.
/// For `Mount` publications the ext4 filesystem is frozen (FIFREEZE, what `fsfreeze -f` does)
/// for the whole copy, which also writes its dirty pages and journal out to the loop device;
/// writers block until it is thawed, which always happens, also on error. The loop devices
/// and the disk file are then fsynced, so that data still in the block device's or the
/// file's page cache is in the file that is copied. The result is crash-consistent: what an
/// application had not written yet (or only in its own buffers) is not in it.
pub fn cut_volume(disk: &Path, quiesce: &Quiesce, dest: &Path) -> Result<()> {
    let mut frozen: Vec<Frozen> = Vec::new();
    for (target, device) in &quiesce.mounts {
        match Frozen::freeze(target, device)? {
            Some(f) => frozen.push(f),
            None => continue,
        }
    }
    for device in &quiesce.devices {
        sync_file(device)?;
    }
    sync_file(disk)?;
    let out = std::process::Command::new("cp")
        .arg("--sparse=always")
        .arg("--reflink=auto")
        .arg(disk)
        .arg(dest)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| CsiError::Internal(format!("cannot run cp: {e}")))?;
    drop(frozen);
    if !out.status.success() {
        return Err(CsiError::Internal(format!(
            "copying {} failed ({}): {}",
            disk.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    sync_file(dest)
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| CsiError::io(format!("syncing {}", path.display()), e))
}

/// `_IOWR('X', 119, int)` and `_IOWR('X', 120, int)` from `linux/fs.h`.
const FIFREEZE: u64 = 0xC004_5877;
const FITHAW: u64 = 0xC004_5878;

/// A frozen filesystem; thawed when dropped.
struct Frozen {
    dir: std::fs::File,
    target: PathBuf,
}

impl Frozen {
    /// Freezes the filesystem mounted at `target`, which must be the one on `device`: the
    /// target is opened first and its device compared, because freezing a directory that is
    /// no longer a mount point would freeze the host filesystem that holds it. The open
    /// directory also keeps the mount from going away while frozen. `None` when `target` is no
    /// longer a mount of `device`, or when the filesystem is frozen already (another target
    /// of the same device was frozen first: they share one superblock).
    fn freeze(target: &Path, device: &Path) -> Result<Option<Frozen>> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        use std::os::unix::io::AsRawFd;
        let dir = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(target)
        {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CsiError::io(format!("opening {}", target.display()), e)),
        };
        let dev = std::fs::metadata(device)
            .map_err(|e| CsiError::io(format!("{}", device.display()), e))?;
        let here = dir
            .metadata()
            .map_err(|e| CsiError::io(format!("{}", target.display()), e))?;
        if here.dev() != dev.rdev() {
            tracing::info!(target = %target.display(), "not a mount of the volume any more; not freezing it");
            return Ok(None);
        }
        // SAFETY: FIFREEZE takes no argument; the fd is open for the duration of the call.
        let rc = unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE as _, 0) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBUSY) {
                return Ok(None);
            }
            return Err(CsiError::io(format!("freezing {}", target.display()), e));
        }
        tracing::debug!(target = %target.display(), "froze filesystem");
        Ok(Some(Frozen {
            dir,
            target: target.to_owned(),
        }))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        use std::os::unix::io::AsRawFd;
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

/// Converts `src` (of format `src_format`) to `dest` in `dest_format`.
pub async fn convert(src: &Path, src_format: &str, dest: &Path, dest_format: &str) -> Result<()> {
    convert_with_progress(src, src_format, dest, dest_format, |_| {}).await
}

/// Like [`convert`], calling `progress` with the percentage `qemu-img convert -p` reports.
pub async fn convert_with_progress(
    src: &Path,
    src_format: &str,
    dest: &Path,
    dest_format: &str,
    mut progress: impl FnMut(f64) + Send,
) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut child = tokio::process::Command::new("qemu-img")
        .arg("convert")
        .arg("-p")
        .args(["-f", src_format, "-O", dest_format])
        .arg(src)
        .arg(dest)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| CsiError::Internal(format!("cannot run qemu-img: {e}")))?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| CsiError::Internal("qemu-img has no stdout".into()))?;
    let mut stderr = child
        .stderr
        .take()
        .ok_or_else(|| CsiError::Internal("qemu-img has no stderr".into()))?;
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut pending = String::new();
    let mut buf = [0u8; 512];
    loop {
        let n = stdout
            .read(&mut buf)
            .await
            .map_err(|e| CsiError::Internal(format!("reading qemu-img output: {e}")))?;
        if n == 0 {
            break;
        }
        pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        while let Some(end) = pending.find(['\r', '\n']) {
            if let Some(pct) = parse_percent(&pending[..end]) {
                progress(pct);
            }
            pending.drain(..=end);
        }
    }
    let status = child
        .wait()
        .await
        .map_err(|e| CsiError::Internal(format!("waiting for qemu-img: {e}")))?;
    if status.success() {
        return Ok(());
    }
    let stderr = errors.await.unwrap_or_default();
    Err(CsiError::Internal(format!(
        "qemu-img convert {} to {dest_format} failed ({status}): {}",
        src.display(),
        stderr.trim()
    )))
}

/// The percentage in a `qemu-img -p` line: `    (12.34/100%)`.
fn parse_percent(line: &str) -> Option<f64> {
    let inner = line.trim().strip_prefix('(')?.strip_suffix("/100%)")?;
    inner
        .parse::<f64>()
        .ok()
        .filter(|p| (0.0..=100.0).contains(p))
}

/// Probes an image file. Only self-contained raw and qcow2 images are accepted: an image that
/// refers to a backing file or an external data file could make `qemu-img` read host files.
pub async fn probe(path: &Path) -> Result<ImageInfo> {
    let out = run(
        "qemu-img",
        ["info".as_ref(), "--output=json".as_ref(), path.as_os_str()],
    )
    .await
    .map_err(|e| CsiError::InvalidArgument(format!("the image is not readable: {e}")))?;
    let info: serde_json::Value = serde_json::from_str(&out)
        .map_err(|e| CsiError::Internal(format!("qemu-img info gave bad JSON: {e}")))?;
    let format = info
        .get("format")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned();
    if format != RAW && format != QCOW2 {
        return Err(CsiError::InvalidArgument(format!(
            "the image format is {format:?}; only raw and qcow2 images are supported"
        )));
    }
    if info.get("backing-filename").is_some() || info.get("full-backing-filename").is_some() {
        return Err(CsiError::InvalidArgument(
            "the image refers to a backing file; only self-contained images are supported".into(),
        ));
    }
    let data_file = info
        .pointer("/format-specific/data/data-file")
        .map(|v| !v.is_null())
        .unwrap_or(false);
    if data_file {
        return Err(CsiError::InvalidArgument(
            "the image uses an external data file; only self-contained images are supported".into(),
        ));
    }
    let virtual_size = info
        .get("virtual-size")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| CsiError::Internal("qemu-img info gave no virtual size".into()))?;
    Ok(ImageInfo {
        format,
        virtual_size,
    })
}

/// SHA-512 of a whole file, as 128 lower-case hex digits.
pub async fn sha512_file(path: &Path) -> Result<String> {
    let path: PathBuf = path.to_owned();
    tokio::task::spawn_blocking(move || super::copy::sha512_file(&path))
        .await
        .map_err(|e| CsiError::Internal(format!("checksum task failed: {e}")))?
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Normalizes and checks a SHA-512 checksum: surrounding space trimmed, 128 hex digits.
pub fn check_checksum(value: &str) -> Result<String> {
    let value = value.trim().to_ascii_lowercase();
    if value.len() == 128 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(value)
    } else {
        Err(CsiError::InvalidArgument(format!(
            "invalid backingImageChecksum {value:?}: expected a SHA-512 digest, 128 hex digits"
        )))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_qemu_img_progress() {
        assert_eq!(super::parse_percent("    (12.50/100%)"), Some(12.5));
        assert_eq!(super::parse_percent("(100.00/100%)"), Some(100.0));
        assert_eq!(super::parse_percent("garbage"), None);
        assert_eq!(super::parse_percent("(250.00/100%)"), None);
    }
}
