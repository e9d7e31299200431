//! Downloading an image from an `http`, `https` or `file` URL into a local file, hashing it
//! (SHA-512) on the way and reporting progress.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha512};

use super::error::{CsiError, Result};
use super::export::hex;

/// How often progress is reported.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What a finished download produced.
#[derive(Debug, Clone)]
pub struct Downloaded {
    pub size: u64,
    pub sha512: String,
}

/// Checks a download URL before anything is created for it.
pub fn check_url(raw: &str) -> Result<url::Url> {
    let parsed = url::Url::parse(raw)
        .map_err(|e| CsiError::InvalidArgument(format!("invalid download url {raw:?}: {e}")))?;
    match parsed.scheme() {
        "http" | "https" | "file" => Ok(parsed),
        other => Err(CsiError::InvalidArgument(format!(
            "download url {raw:?} has scheme {other:?}; use http, https or file"
        ))),
    }
}

/// Downloads `source` into `dest` (created, fsynced). Blocking; run it off the async runtime.
/// `progress(done, total)` is called about once a second; `total` is 0 when unknown.
pub fn fetch(
    source: &url::Url,
    dest: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Downloaded> {
    let shown = source.as_str();
    let (mut reader, total): (Box<dyn Read>, u64) = match source.scheme() {
        "file" => {
            let path = source.to_file_path().map_err(|()| {
                CsiError::InvalidArgument(format!(
                    "download url {shown:?} is not a local file path"
                ))
            })?;
            let file = File::open(&path).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    CsiError::NotFound(format!("download url {shown:?}: no such file"))
                }
                _ => CsiError::Unavailable(format!("download url {shown:?} cannot be read: {e}")),
            })?;
            let total = file.metadata().map(|m| m.len()).unwrap_or(0);
            (Box::new(file), total)
        }
        _ => {
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_connect(Some(Duration::from_secs(30)))
                .timeout_recv_response(Some(Duration::from_secs(60)))
                .build()
                .into();
            let response = agent.get(shown).call().map_err(|e| match e {
                ureq::Error::StatusCode(404) | ureq::Error::StatusCode(410) => {
                    CsiError::NotFound(format!(
                        "download url {shown:?} answered HTTP {}: no such image",
                        status(&e)
                    ))
                }
                ureq::Error::StatusCode(code) => {
                    CsiError::Unavailable(format!("download url {shown:?} answered HTTP {code}"))
                }
                other => {
                    CsiError::Unavailable(format!("download url {shown:?} is unreachable: {other}"))
                }
            })?;
            let total = response
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            let reader = response.into_body().into_reader();
            (Box::new(reader), total)
        }
    };
    let mut out =
        File::create(dest).map_err(|e| CsiError::io(format!("creating {}", dest.display()), e))?;
    let mut hasher = Sha512::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let mut last = Instant::now();
    progress(0, total);
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(CsiError::Unavailable(format!(
                    "download from {shown:?} broke off after {done} bytes: {e}"
                )))
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| CsiError::io(format!("writing {}", dest.display()), e))?;
        done += n as u64;
        if last.elapsed() >= PROGRESS_EVERY {
            progress(done, total);
            last = Instant::now();
        }
    }
    if total != 0 && done != total {
        return Err(CsiError::Unavailable(format!(
            "download from {shown:?} ended after {done} of {total} bytes"
        )));
    }
    out.sync_all()
        .map_err(|e| CsiError::io(format!("syncing {}", dest.display()), e))?;
    progress(done, done);
    Ok(Downloaded {
        size: done,
        sha512: hex(&hasher.finalize()),
    })
}

fn status(e: &ureq::Error) -> u16 {
    match e {
        ureq::Error::StatusCode(code) => *code,
        _ => 0,
    }
}
