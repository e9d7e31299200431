//! Image conversions with `qemu-img`: exporting a volume to raw or qcow2, restoring an image
//! into a raw volume, probing what a file is, and checksumming it.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha512};

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

/// Takes a point-in-time copy of a volume's disk (sparse, reflinked where the filesystem can).
pub async fn cut(disk: &Path, dest: &Path) -> Result<()> {
    run(
        "cp",
        [
            "--sparse=always".as_ref(),
            "--reflink=auto".as_ref(),
            disk.as_os_str(),
            dest.as_os_str(),
        ],
    )
    .await
    .map(|_| ())
}

/// Converts `src` (of format `src_format`) to `dest` in `dest_format`.
pub async fn convert(src: &Path, src_format: &str, dest: &Path, dest_format: &str) -> Result<()> {
    run(
        "qemu-img",
        [
            "convert".as_ref(),
            "-f".as_ref(),
            src_format.as_ref(),
            "-O".as_ref(),
            dest_format.as_ref(),
            src.as_os_str(),
            dest.as_os_str(),
        ],
    )
    .await
    .map(|_| ())
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
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::File::open(&path)
            .map_err(|e| CsiError::io(format!("opening {}", path.display()), e))?;
        let mut hasher = Sha512::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| CsiError::io(format!("reading {}", path.display()), e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(hex(&hasher.finalize()))
    })
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
