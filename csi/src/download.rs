//! Downloading an image from an `http`, `https` or `file` URL into a local file, hashing it
//! (SHA-512) on the way and reporting progress.
//!
//! The driver runs as root, so what a URL may reach is restricted ([`Policy`]): `file://`
//! only below a configured directory (disabled without one), regular files only, never
//! through a symlink swapped in; no loopback, link-local or private hosts unless the operator
//! allows them, checked on the address actually connected to ([`super::addresses`]) at every
//! redirect; only answers that can be disk images (no HTML error pages); a size cap; and a
//! stalled body fails after an idle timeout instead of hanging the job forever.

use std::fs::File;
use std::io::Read;
use std::net::IpAddr;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ureq::unversioned::resolver::{DefaultResolver, Resolver};
use ureq::unversioned::transport::DefaultConnector;

use super::addresses::{own_addresses, refused_ip, CheckedResolver, RefusedAddress};
use super::copy::{self, HashingWriter, StreamError};
use super::error::{CsiError, Result};

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
    /// Allow http(s) hosts that are (or resolve to) loopback, link-local or private
    /// addresses; refused by default, so that an image URL cannot reach the node's own or its
    /// cluster's services (metadata endpoints, the kubelet, internal APIs).
    pub allow_private: bool,
    /// The largest image accepted, in bytes.
    pub max_size: u64,
    /// A download that receives nothing for this long fails.
    pub idle_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            file_root: None,
            allow_private: false,
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
            check_host(&parsed, policy)?;
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

/// Unless private hosts are allowed, refuses a URL whose host is a loopback, link-local or
/// private address, or a `localhost` name. Other names are checked when they are resolved,
/// by [`CheckedResolver`](super::addresses::CheckedResolver), on the addresses connected to.
fn check_host(url: &url::Url, policy: &Policy) -> Result<()> {
    let shown = url.as_str();
    let ip = match url.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if !policy.allow_private && (name == "localhost" || name.ends_with(".localhost")) {
                return Err(refused(shown, "localhost"));
            }
            return Ok(());
        }
        None => {
            return Err(CsiError::InvalidArgument(format!(
                "download url {shown:?} has no host"
            )))
        }
    };
    if !policy.allow_private && refused_ip(&ip, &own_addresses()) {
        return Err(refused(shown, &ip.to_string()));
    }
    Ok(())
}

fn refused(shown: &str, what: &str) -> CsiError {
    CsiError::InvalidArgument(format!(
        "download url {shown:?} points at {what}, a loopback, link-local or private address \
         or one of this node's; such URLs are refused unless the driver runs with --allow-private-urls"
    ))
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

/// Downloads `source` into `dest` (created, fsynced), hashing it in the same pass. Blocking;
/// run it off the async runtime. `progress(done, total)` is called about once a second;
/// `total` is 0 when unknown.
pub fn fetch(
    source: &url::Url,
    dest: &Path,
    policy: &Policy,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Downloaded> {
    let shown = source.as_str();
    let (reader, total): (Box<dyn Read>, u64) = match source.scheme() {
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
    let out = File::options()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| CsiError::io(format!("creating {}", dest.display()), e))?;
    let mut out = HashingWriter::new(out);
    // One byte over the cap is enough to know the image is too big.
    let mut reader = reader.take(policy.max_size.saturating_add(1));
    progress(0, total);
    let pumped = copy::pump_stream(
        &mut reader,
        &mut out,
        &mut |head| sniff(shown, head),
        &mut |done| progress(done, total),
    );
    let done = out.len();
    match pumped {
        Ok(()) => {}
        Err(StreamError::Refused(e)) => return Err(e),
        Err(StreamError::Write(e)) => {
            return Err(CsiError::io(format!("writing {}", dest.display()), e))
        }
        Err(StreamError::Read(e)) if e.kind() == std::io::ErrorKind::TimedOut || is_timeout(&e) => {
            return Err(CsiError::Unavailable(format!(
                "download from {shown:?} stalled: nothing received for {} seconds after \
                 {done} bytes",
                policy.idle_timeout.as_secs()
            )))
        }
        Err(StreamError::Read(e)) => {
            return Err(CsiError::Unavailable(format!(
                "download from {shown:?} broke off after {done} bytes: {e}"
            )))
        }
    }
    if done > policy.max_size {
        return Err(too_big(shown, policy));
    }
    if total != 0 && done != total {
        return Err(CsiError::Unavailable(format!(
            "download from {shown:?} ended after {done} of {total} bytes"
        )));
    }
    let got = out
        .finish()
        .map_err(|e| CsiError::io(format!("writing {}", dest.display()), e))?;
    progress(got.size, got.size);
    Ok(Downloaded {
        size: got.size,
        sha512: got.sha512,
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
    get_with(source, policy, DefaultResolver::default())
}

/// [`get`] with the names resolved by `resolver` (then checked).
fn get_with(
    source: &url::Url,
    policy: &Policy,
    resolver: impl Resolver,
) -> Result<(ureq::http::Response<ureq::Body>, u64)> {
    let config = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        .timeout_per_read(Some(policy.idle_timeout))
        .max_redirects(0)
        // Through a proxy the address checked would be the proxy's, not the image host's.
        .proxy(None)
        .build();
    let resolver = CheckedResolver {
        inner: resolver,
        allow_private: policy.allow_private,
    };
    let agent = ureq::Agent::with_parts(config, DefaultConnector::default(), resolver);
    let mut url = source.clone();
    for _ in 0..=MAX_REDIRECTS {
        let shown = url.as_str().to_owned();
        check_host(&url, policy)?;
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
            ureq::Error::Other(inner) if inner.is::<RefusedAddress>() => {
                CsiError::InvalidArgument(format!(
                    "download url {shown:?}: {inner}, a loopback, link-local or private \
                     address or one of this node's; such URLs are refused unless the driver runs with \
                     --allow-private-urls"
                ))
            }
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
        check_content_type(
            &shown,
            response
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap_or("?")),
        )?;
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

/// The media types a disk image may be served as. Servers label raw and qcow2 files in many
/// ways, but none of them as text: an HTML or JSON answer is an error or login page that a
/// misconfigured server sent with status 200, and must not become a volume's content.
const IMAGE_TYPES: &[&str] = &[
    "application/octet-stream",
    "binary/octet-stream",
    "application/x-raw-disk-image",
    "application/x-qemu-disk",
    "application/x-qcow2",
    "application/x-qcow",
    "application/x-disk-image",
    "application/x-iso9660-image",
    "application/vnd.efi.img",
    "application/vnd.efi.iso",
];

/// Accepts an answer without a Content-Type (many plain servers send none) or with one of
/// [`IMAGE_TYPES`]; parameters (`; charset=…`) are ignored.
fn check_content_type(shown: &str, value: Option<&str>) -> Result<()> {
    let Some(value) = value else {
        return Ok(());
    };
    let media = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if media.is_empty() || IMAGE_TYPES.contains(&media.as_str()) {
        return Ok(());
    }
    Err(CsiError::InvalidArgument(format!(
        "download url {shown:?} answered with Content-Type {value:?}, which is not a disk \
         image (accepted: {}, or none)",
        IMAGE_TYPES.join(", ")
    )))
}

/// Refuses a download whose first bytes are an HTML page, whatever its Content-Type said: as
/// a raw image it would be accepted, since any bytes are a valid raw disk.
fn sniff(shown: &str, head: &[u8]) -> Result<()> {
    let start = head.strip_prefix(b"\xef\xbb\xbf").unwrap_or(head);
    let start = &start[start
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(start.len())..];
    let prefix: Vec<u8> = start.iter().take(16).map(u8::to_ascii_lowercase).collect();
    if prefix.starts_with(b"<!doctype html") || prefix.starts_with(b"<html") {
        return Err(CsiError::InvalidArgument(format!(
            "download url {shown:?} answered with an HTML page, not a disk image"
        )));
    }
    Ok(())
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
    use crate::addresses::is_private;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use ureq::unversioned::resolver::ResolvedSocketAddrs;
    use ureq::unversioned::transport::NextTimeout;

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

    /// IPv6 spellings of refused IPv4 addresses are refused like them.
    #[test]
    fn ipv6_spellings_of_private_addresses() {
        let strict = Policy::default();
        for url in [
            "http://0.0.0.0/x",
            "http://[::ffff:10.0.0.1]/x",
            "http://[::ffff:127.0.0.1]/x",
            "http://[::10.0.0.1]/x",
            "http://[::127.0.0.1]/x",
            "http://[::169.254.169.254]/x",
            "http://[64:ff9b::10.0.0.1]/x",
            "http://[64:ff9b::7f00:1]/x",
            "http://[64:ff9b::169.254.169.254]/x",
            "http://[64:ff9b:1::10.0.0.1]/x",
        ] {
            let err = check_url(url, &strict).unwrap_err();
            assert!(
                err.to_string().contains("--allow-private-urls"),
                "{url}: {err}"
            );
        }
        for ip in ["64:ff9b::8.8.8.8", "::ffff:8.8.8.8"] {
            assert!(!is_private(&ip.parse().unwrap()), "{ip}");
        }
    }

    /// The node's own addresses are refused, public ones included: a URL naming the node
    /// reaches its own services.
    #[test]
    fn the_nodes_own_addresses_are_refused() {
        let own = own_addresses();
        assert!(
            own.iter().any(|ip| ip.is_loopback()),
            "getifaddrs lists loopback: {own:?}"
        );
        let strict = Policy::default();
        for ip in &own {
            let host = match ip {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            let url = format!("http://{host}/x");
            let err = check_url(&url, &strict).unwrap_err();
            assert!(
                err.to_string().contains("--allow-private-urls"),
                "{url}: {err}"
            );
        }
        let public: IpAddr = "203.0.113.7".parse().unwrap();
        assert!(!refused_ip(&public, &[]));
        assert!(refused_ip(&public, &[public]));
        assert!(refused_ip(
            &"::ffff:203.0.113.7".parse().unwrap(),
            &[public]
        ));
    }

    #[test]
    fn url_checks() {
        let strict = Policy::default();
        let err = check_url("file:///etc/shadow", &strict).unwrap_err();
        assert!(err.to_string().contains("--file-root"), "{err}");
        let rooted = Policy {
            file_root: Some("/srv/images".into()),
            ..Policy::default()
        };
        assert!(check_url("file:///srv/images/a.raw", &rooted).is_ok());
        assert!(check_url("file:///srv/images/../../etc/shadow", &rooted).is_err());
        assert!(check_url("file:///etc/shadow", &rooted).is_err());
        // Private hosts are refused by default.
        for url in [
            "http://127.0.0.1:8080/x",
            "http://[::1]/x",
            "http://169.254.169.254/latest/meta-data",
            "http://10.0.0.1/x",
            "http://localhost:8080/x",
            "http://api.localhost./x",
        ] {
            let err = check_url(url, &strict).unwrap_err();
            assert!(matches!(err, CsiError::InvalidArgument(_)), "{url}: {err}");
            assert!(err.to_string().contains("--allow-private-urls"), "{err}");
        }
        assert!(check_url("https://images.example.com/x.raw", &strict).is_ok());
        let open = Policy {
            allow_private: true,
            ..Policy::default()
        };
        assert!(check_url("http://127.0.0.1:8080/x", &open).is_ok());
        assert!(check_url("http://localhost:8080/x", &open).is_ok());
    }

    #[test]
    fn content_types() {
        for ok in [
            None,
            Some("application/octet-stream"),
            Some("Application/Octet-Stream; charset=binary"),
            Some("application/x-qemu-disk"),
            Some("application/x-raw-disk-image"),
            Some(""),
        ] {
            assert!(check_content_type("u", ok).is_ok(), "{ok:?}");
        }
        for bad in [
            "text/html",
            "text/html; charset=utf-8",
            "application/json",
            "text/plain",
        ] {
            let err = check_content_type("u", Some(bad)).unwrap_err();
            assert!(matches!(err, CsiError::InvalidArgument(_)), "{bad}");
        }
    }

    #[test]
    fn html_is_sniffed() {
        for page in [
            &b"<!DOCTYPE html><html>"[..],
            b"\xef\xbb\xbf\r\n  <!doctype HTML>",
            b"<html><body>Not Found</body></html>",
            b"\n<HTML>",
        ] {
            assert!(sniff("u", page).is_err(), "{page:?}");
        }
        for image in [&b"QFI\xfb\0\0\0\x03"[..], &[0u8; 512], b"", b"<h"] {
            assert!(sniff("u", image).is_ok(), "{image:?}");
        }
    }

    /// A resolver for tests: names it knows map to fixed addresses, counted.
    #[derive(Debug)]
    struct FixedResolver {
        names: HashMap<String, Vec<std::net::SocketAddr>>,
        calls: Arc<AtomicUsize>,
    }

    impl Resolver for FixedResolver {
        fn resolve(
            &self,
            uri: &ureq::http::Uri,
            _config: &ureq::config::Config,
            _timeout: NextTimeout,
        ) -> std::result::Result<ResolvedSocketAddrs, ureq::Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let mut out = self.empty();
            for a in self
                .names
                .get(uri.host().unwrap_or_default())
                .ok_or(ureq::Error::HostNotFound)?
            {
                out.push(*a);
            }
            Ok(out)
        }
    }

    /// An HTTP server on 127.0.0.1 that answers every request with `answer`, counting
    /// connections; stops when dropped.
    struct OneAnswer {
        addr: std::net::SocketAddr,
        connections: Arc<AtomicUsize>,
        stop: Arc<AtomicBool>,
    }

    impl OneAnswer {
        fn start(answer: &'static [u8]) -> OneAnswer {
            use std::io::Write;
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            let addr = listener.local_addr().unwrap();
            let connections = Arc::new(AtomicUsize::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let (count, stopped) = (Arc::clone(&connections), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stopped.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((mut s, _)) => {
                            count.fetch_add(1, Ordering::SeqCst);
                            s.set_nonblocking(false).unwrap();
                            let mut head = [0u8; 4096];
                            let _ = s.read(&mut head);
                            let _ = s.write_all(answer);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            });
            OneAnswer {
                addr,
                connections,
                stop,
            }
        }
    }

    impl Drop for OneAnswer {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::SeqCst);
        }
    }

    const IMAGE: &[u8] =
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nQFI\xfb";

    /// A name is resolved once per connection, and the connection goes to the address that
    /// was resolved and checked: a name that resolves to a private address is refused before
    /// any connection is made, and an allowed one reaches exactly the checked address.
    #[test]
    fn the_checked_address_is_the_connected_one() {
        let target = OneAnswer::start(IMAGE);
        let decoy = OneAnswer::start(IMAGE);
        let calls = Arc::new(AtomicUsize::new(0));
        let resolver = || FixedResolver {
            names: [
                ("images.test".to_owned(), vec![target.addr]),
                ("decoy.test".to_owned(), vec![decoy.addr]),
            ]
            .into(),
            calls: Arc::clone(&calls),
        };
        let url =
            url::Url::parse(&format!("http://images.test:{}/a.raw", target.addr.port())).unwrap();

        let strict = Policy::default();
        let err = get_with(&url, &strict, resolver()).unwrap_err();
        assert!(matches!(err, CsiError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("resolves to 127.0.0.1"), "{err}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(
            target.connections.load(Ordering::SeqCst),
            0,
            "nothing connected"
        );

        let open = Policy {
            allow_private: true,
            ..Policy::default()
        };
        let (response, total) = get_with(&url, &open, resolver()).unwrap();
        assert_eq!(total, 4);
        let mut body = Vec::new();
        response
            .into_body()
            .into_reader()
            .read_to_end(&mut body)
            .unwrap();
        assert_eq!(body, b"QFI\xfb");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "one resolution per connection"
        );
        assert_eq!(target.connections.load(Ordering::SeqCst), 1);
        assert_eq!(decoy.connections.load(Ordering::SeqCst), 0);
    }

    /// Every redirect is a new connection, resolved (and so checked) again.
    #[test]
    fn redirects_are_checked_like_the_first_url() {
        let target = OneAnswer::start(IMAGE);
        let redirect: &'static [u8] = Box::leak(
            format!(
                "HTTP/1.1 302 Found\r\nLocation: http://inner.test:{}/a.raw\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n",
                target.addr.port()
            )
            .into_bytes()
            .into_boxed_slice(),
        );
        let hop = OneAnswer::start(redirect);
        let calls = Arc::new(AtomicUsize::new(0));
        // The first host stands for a public one: only the redirect's target is private.
        let names: HashMap<String, Vec<std::net::SocketAddr>> = [
            ("outer.test".to_owned(), vec![hop.addr]),
            ("inner.test".to_owned(), vec![target.addr]),
        ]
        .into();
        let url = url::Url::parse(&format!("http://outer.test:{}/x", hop.addr.port())).unwrap();
        let policy = Policy {
            allow_private: true,
            ..Policy::default()
        };
        let resolver = FixedResolver {
            names,
            calls: Arc::clone(&calls),
        };
        get_with(&url, &policy, resolver).unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2, "each hop resolved");
        assert_eq!(target.connections.load(Ordering::SeqCst), 1);
    }
}
