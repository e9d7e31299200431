//! Image conversions with `qemu-img`: exporting a volume's cut ([`super::cut`]) to raw or
//! qcow2, restoring an image into a raw volume, probing what a file is, and checksumming it.

use std::path::{Path, PathBuf};

use super::command::{self, run};
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

/// Converts `src` (of format `src_format`) to `dest` in `dest_format`.
pub async fn convert(src: &Path, src_format: &str, dest: &Path, dest_format: &str) -> Result<()> {
    convert_with_progress(src, src_format, dest, dest_format, None, |_| {}).await
}

/// Like [`convert`], reading at most `rate` bytes per second when given (`qemu-img convert
/// -r`), and calling `progress` with the percentage `qemu-img convert -p` reports.
pub async fn convert_with_progress(
    src: &Path,
    src_format: &str,
    dest: &Path,
    dest_format: &str,
    rate: Option<std::num::NonZeroU64>,
    mut progress: impl FnMut(f64) + Send,
) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut command = tokio::process::Command::from(command::tool("qemu-img"));
    command.arg("convert").arg("-p");
    if let Some(rate) = rate {
        command.args(["-r", &rate.to_string()]);
    }
    let mut child = command
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
