//! Downloading an image from an `http`, `https` or `file` URL into a local file, hashing it
//! (SHA-512) on the way and reporting progress.
//!
//! The driver runs as root, so what a URL may reach is restricted ([`Policy`]): `file://`
//! only below a configured directory (disabled without one), regular files only, never
//! through a symlink swapped in; optionally no loopback, link-local or private hosts; a size
//! cap; and a stalled body fails after an idle timeout instead of hanging the job forever.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, ToSocketAddrs};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
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

/// What downloads may read, and how long they may stall.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `file://` URLs must name a regular file under this directory; `None` disables them
    /// (the driver runs as root: an unrestricted `file://` would read any host file).
    pub file_root: Option<PathBuf>,
    /// Refuse http(s) hosts that are loopback, link-local or private addresses.
    pub deny_private: bool,
    /// The largest image accepted, in bytes.
    pub max_size: u64,
    /// A download that receives nothing for this long fails.
    pub idle_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            file_root: None,
            deny_private: false,
            max_size: DEFAULT_MAX_SIZE,
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// The default cap on the size of a downloaded image: 1 TiB.
pub const DEFAULT_MAX_SIZE: u64 = 1 << 40;

/// How many redirects are followed (each one checked like the first URL).
const MAX_REDIRECTS: usize = 10;

/// Checks a download URL before anything is created for it.
pub fn check_url(raw: &str, policy: &Policy) -> Result<url::Url> {
    let parsed = url::Url::parse(raw)
        .map_err(|e| CsiError::InvalidArgument(format!("invalid download url {raw:?}: {e}")))?;
    match parsed.scheme() {
        "http" | "https" => {
            // Names are resolved by the download job, not here (under the controller lock).
            check_host(&parsed, policy, false)?;
            Ok(parsed)
        }
        "file" => {
            let Some(root) = &policy.file_root else {
                return Err(CsiError::InvalidArgument(format!(
                    "download url {raw:?}: file:// downloads are disabled; start the driver \
                     with --file-root"
                )));
            };
            let path = parsed.to_file_path().map_err(|()| {
                CsiError::InvalidArgument(format!("download url {raw:?} is not a local file path"))
            })?;
            if !path.starts_with(root) {
                return Err(outside_root(raw, root));
            }
            Ok(parsed)
        }
        other => Err(CsiError::InvalidArgument(format!(
            "download url {raw:?} has scheme {other:?}; use http, https or file"
        ))),
    }
}

fn outside_root(shown: &str, root: &Path) -> CsiError {
    CsiError::InvalidArgument(format!(
        "download url {shown:?} is outside the directory file:// downloads may read ({})",
        root.display()
    ))
}

/// With `deny_private`, refuses a host that is (or, with `resolve`, resolves to) a loopback,
/// link-local or private address.
fn check_host(url: &url::Url, policy: &Policy, resolve: bool) -> Result<()> {
    if !policy.deny_private {
        return Ok(());
    }
    let shown = url.as_str();
    let addrs: Vec<IpAddr> = match url.host() {
        Some(url::Host::Ipv4(ip)) => vec![IpAddr::V4(ip)],
        Some(url::Host::Ipv6(ip)) => vec![IpAddr::V6(ip)],
        Some(url::Host::Domain(_)) if !resolve => return Ok(()),
        Some(url::Host::Domain(name)) => {
            let port = url.port_or_known_default().unwrap_or(80);
            (name, port)
                .to_socket_addrs()
                .map_err(|e| {
                    CsiError::Unavailable(format!("download url {shown:?} is unreachable: {e}"))
                })?
                .map(|a| a.ip())
                .collect()
        }
        None => {
            return Err(CsiError::InvalidArgument(format!(
                "download url {shown:?} has no host"
            )))
        }
    };
    match addrs.iter().find(|ip| is_private(ip)) {
        Some(ip) => Err(CsiError::InvalidArgument(format!(
            "download url {shown:?} points at {ip}, a loopback, link-local or private address, \
             which this driver is configured to refuse (--deny-private-urls)"
        ))),
        None => Ok(()),
    }
}

/// Loopback, link-local, private (RFC 1918, unique local, shared), unspecified and broadcast
/// addresses.
pub fn is_private(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private(&IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
    }
}

/// Opens a `file://` source: canonicalized, under the root, not a symlink, a regular file.
fn open_file(source: &url::Url, policy: &Policy) -> Result<(File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let shown = source.as_str();
    let root = policy.file_root.as_ref().ok_or_else(|| {
        CsiError::InvalidArgument(format!(
            "download url {shown:?}: file:// downloads are disabled; start the driver with \
             --file-root"
        ))
    })?;
    let path = source.to_file_path().map_err(|()| {
        CsiError::InvalidArgument(format!("download url {shown:?} is not a local file path"))
    })?;
    let not_found = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => {
            CsiError::NotFound(format!("download url {shown:?}: no such file"))
        }
        _ => CsiError::Unavailable(format!("download url {shown:?} cannot be read: {e}")),
    };
    let root = std::fs::canonicalize(root)
        .map_err(|e| CsiError::io(format!("file root {}", root.display()), e))?;
    let real = std::fs::canonicalize(&path).map_err(not_found)?;
    if !real.starts_with(&root) {
        return Err(outside_root(shown, &root));
    }
    // O_NOFOLLOW: the resolved name must not have become a symlink since; O_NONBLOCK: opening
    // a FIFO must not hang (it is refused below).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&real)
        .map_err(not_found)?;
    // The name may have been swapped between canonicalize and open: check what was opened.
    let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| CsiError::io(format!("checking {}", real.display()), e))?;
    if !opened.starts_with(&root) {
        return Err(outside_root(shown, &root));
    }
    let meta = file
        .metadata()
        .map_err(|e| CsiError::io(format!("{}", real.display()), e))?;
    if !meta.is_file() {
        return Err(CsiError::InvalidArgument(format!(
            "download url {shown:?} is not a regular file"
        )));
    }
    Ok((file, meta.len()))
}

/// Downloads `source` into `dest` (created, fsynced). Blocking; run it off the async runtime.
/// `progress(done, total)` is called about once a second; `total` is 0 when unknown.
pub fn fetch(
    source: &url::Url,
    dest: &Path,
    policy: &Policy,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Downloaded> {
    let shown = source.as_str();
    let (mut reader, total): (Box<dyn Read>, u64) = match source.scheme() {
        "file" => {
            let (file, total) = open_file(source, policy)?;
            (Box::new(file), total)
        }
        _ => {
            let (response, total) = get(source, policy)?;
            (Box::new(response.into_body().into_reader()), total)
        }
    };
    if total > policy.max_size {
        return Err(too_big(shown, policy));
    }
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
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut || is_timeout(&e) => {
                return Err(CsiError::Unavailable(format!(
                    "download from {shown:?} stalled: nothing received for {} seconds after \
                     {done} bytes",
                    policy.idle_timeout.as_secs()
                )))
            }
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
        if done > policy.max_size {
            return Err(too_big(shown, policy));
        }
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

fn too_big(shown: &str, policy: &Policy) -> CsiError {
    CsiError::InvalidArgument(format!(
        "download url {shown:?} is larger than {} bytes, the most this driver accepts",
        policy.max_size
    ))
}

/// GETs an http(s) URL: the response and its length (0 when unknown). Redirects are followed
/// here, each target checked like the first URL, so that a public URL cannot redirect to a
/// refused one. A body that stalls for `idle_timeout` fails the read.
fn get(source: &url::Url, policy: &Policy) -> Result<(ureq::http::Response<ureq::Body>, u64)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .timeout_per_read(Some(policy.idle_timeout))
        .max_redirects(0)
        .build()
        .into();
    let mut url = source.clone();
    for _ in 0..=MAX_REDIRECTS {
        let shown = url.as_str().to_owned();
        check_host(&url, policy, true)?;
        let response = agent.get(url.as_str()).call().map_err(|e| match e {
            ureq::Error::StatusCode(404) | ureq::Error::StatusCode(410) => {
                CsiError::NotFound(format!(
                    "download url {shown:?} answered HTTP {}: no such image",
                    status(&e)
                ))
            }
            ureq::Error::StatusCode(code) => {
                CsiError::Unavailable(format!("download url {shown:?} answered HTTP {code}"))
            }
            ureq::Error::Timeout(t) => CsiError::Unavailable(format!(
                "download url {shown:?} did not answer in time ({t})"
            )),
            other => {
                CsiError::Unavailable(format!("download url {shown:?} is unreachable: {other}"))
            }
        })?;
        if response.status().is_redirection() {
            let location = response
                .headers()
                .get("location")
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| {
                    CsiError::Unavailable(format!(
                        "download url {shown:?} redirects without a Location"
                    ))
                })?;
            let next = url.join(location).map_err(|e| {
                CsiError::Unavailable(format!("download url {shown:?} redirects badly: {e}"))
            })?;
            if !matches!(next.scheme(), "http" | "https") {
                return Err(CsiError::InvalidArgument(format!(
                    "download url {shown:?} redirects to {next}, which is not http or https"
                )));
            }
            url = next;
            continue;
        }
        let total = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        return Ok((response, total));
    }
    Err(CsiError::Unavailable(format!(
        "download url {:?} redirects more than {MAX_REDIRECTS} times",
        source.as_str()
    )))
}

/// Whether a read error is ureq's timeout, wrapped in an I/O error by its body reader.
fn is_timeout(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<ureq::Error>())
        .is_some_and(|u| matches!(u, ureq::Error::Timeout(_)))
}

fn status(e: &ureq::Error) -> u16 {
    match e {
        ureq::Error::StatusCode(code) => *code,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_addresses() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_private(&ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "172.32.0.1", "2001:db8::1", "::ffff:1.1.1.1"] {
            assert!(!is_private(&ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn url_checks() {
        let open = Policy::default();
        let err = check_url("file:///etc/shadow", &open).unwrap_err();
        assert!(err.to_string().contains("--file-root"), "{err}");
        let rooted = Policy {
            file_root: Some("/srv/images".into()),
            ..Policy::default()
        };
        assert!(check_url("file:///srv/images/a.raw", &rooted).is_ok());
        assert!(check_url("file:///srv/images/../../etc/shadow", &rooted).is_err());
        assert!(check_url("file:///etc/shadow", &rooted).is_err());
        let strict = Policy {
            deny_private: true,
            ..Policy::default()
        };
        assert!(check_url("http://127.0.0.1:8080/x", &strict).is_err());
        assert!(check_url("http://[::1]/x", &strict).is_err());
        assert!(check_url("http://127.0.0.1:8080/x", &open).is_ok());
    }
}
