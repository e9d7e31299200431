//! Small file helpers shared by the volume and BackingImage stores: JSON state files written
//! atomically (temp file, fsync, rename), and unique temp names.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::error::{CsiError, Result};

/// Prefix of every temporary entry; names starting with `.` are never objects.
pub const TMP_PREFIX: &str = ".tmp-";

/// A name in `dir` no other caller gets: `.tmp-<stem>-<pid>-<counter>`.
pub fn temp_path(dir: &Path, stem: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{TMP_PREFIX}{stem}-{}-{n}", std::process::id()))
}

/// Writes `value` as JSON to `path` so that readers see the old or the new file, never a part,
/// and durably: once it returns, the new file survives a crash.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    write_json_via(path, &temp_path(dir, &stem), value)
}

/// [`write_json`] through the temp file `tmp` (in the same directory), for stores whose temp
/// names must say who made them.
pub fn write_json_via(path: &Path, tmp: &Path, value: &impl Serialize) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let data = serde_json::to_vec_pretty(value)
        .map_err(|e| CsiError::Internal(format!("encoding {}: {e}", path.display())))?;
    let result = (|| {
        let mut file = fs::File::create(tmp)?;
        file.write_all(&data)?;
        file.sync_all()?;
        fs::rename(tmp, path)?;
        // The rename is only durable once the directory is.
        fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(tmp);
        return Err(CsiError::io(format!("writing {}", path.display()), e));
    }
    Ok(())
}

/// Fsyncs a directory, so that the entries just renamed into it survive a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CsiError::io(format!("syncing {}", dir.display()), e))
}

/// Reads a JSON state file; `None` when it does not exist.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match fs::read(path) {
        Ok(data) => serde_json::from_slice(&data).map(Some).map_err(|e| {
            CsiError::Internal(format!("state file {} is corrupt: {e}", path.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CsiError::io(format!("reading {}", path.display()), e)),
    }
}

/// Reads a JSON state file that may be damaged: `None` when it does not exist, `Some(Err(why))`
/// when it cannot be decoded (garbled, cut short), for the caller to move it aside rather
/// than fail on it at every call.
pub fn read_json_lenient<T: DeserializeOwned>(
    path: &Path,
) -> Result<Option<std::result::Result<T, String>>> {
    match fs::read(path) {
        Ok(data) => Ok(Some(
            serde_json::from_slice(&data).map_err(|e| e.to_string()),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CsiError::io(format!("reading {}", path.display()), e)),
    }
}

/// Seconds since the epoch, now.
pub fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Removes temp entries left in `dir` by an interrupted run.
pub fn clean_temps(dir: &Path) {
    clean_temps_with_prefix(dir, TMP_PREFIX)
}

/// Removes the file at `path`; one already gone is fine.
pub fn remove_if_there(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::io(format!("removing {}", path.display()), e)),
    }
}

/// Removes the entries of `dir` whose names start with `prefix` (one that starts with
/// [`TMP_PREFIX`]).
pub fn clean_temps_with_prefix(dir: &Path, prefix: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let path = entry.path();
            let result = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            match result {
                Ok(()) => tracing::info!(path = %path.display(), "removed leftover temp entry"),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove temp entry")
                }
            }
        }
    }
}
