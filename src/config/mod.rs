//! A mount's configuration, and the one parser for `-o` options.
//!
//! `layerfs mount` and the `mount.layerfs` helper both build a [`MountConfig`] through
//! [`MountConfig::apply_options`], so an option means the same everywhere. Every option has
//! a default that suits a container host; [`options::OPTIONS`] is the one table of them, from
//! which the parser, `--help` and the README's table are made.

pub mod options;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::fs::kernel_mount::MountSpec;
use crate::store::atime::AccessTimes;
use crate::view::LinkStyle;

/// When requests come through FUSE over io_uring (`-o io_uring`, `-o noio_uring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingUse {
    /// Where the kernel offers it (the fuse module's `enable_uring`) and no keeper holds the
    /// connection: a ring's registrations die with the daemon that made them, and on 6.18
    /// the requests in flight on them are not sent again to the next one.
    Auto,
    /// Where the kernel offers it, and a mount that asks for it has no keeper by default.
    Always,
    /// Never: `/dev/fuse` only.
    Never,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MountConfig {
    pub remote: PathBuf,
    pub local: PathBuf,
    pub mountpoint: PathBuf,
    pub driver: String,
    pub link_style: LinkStyle,
    pub allow_other: bool,
    pub allow_root: bool,
    pub read_only: bool,
    pub suid: bool,
    pub dev: bool,
    /// When reads move access times.
    pub atime: AccessTimes,
    pub foreground: bool,
    pub threads: usize,
    pub remote_threads: usize,
    pub passthrough: bool,
    /// Whether requests come through FUSE over io_uring where the kernel offers it.
    pub io_uring: RingUse,
    /// A keeper holds the connection and restarts a daemon that dies (DESIGN §13); `None`:
    /// as [`MountConfig::kept`] decides.
    pub keeper: Option<bool>,
    pub entry_timeout: Duration,
    pub attr_timeout: Duration,
    pub log_file: Option<PathBuf>,
    /// A `tracing` filter (`debug`, `layerfs=debug,fuser=info`…); `RUST_LOG` wins over it.
    pub log_level: Option<String>,
    pub fsname: Option<String>,
    /// Time between refresh rounds; zero = only on demand.
    pub refresh: Duration,
    pub scan_timeout: Duration,
    pub hide_unhealthy: bool,
    pub inotify: bool,
    /// Follow the remote's publication journal (DESIGN §14).
    pub journal: bool,
    /// Time between two reads of the journal's bell.
    pub journal_poll: Duration,
    /// What allocations over a quota fail with: `ENOSPC` (as XFS project quotas and
    /// block-backed layers do) or `EDQUOT`.
    pub quota_errno: nix::errno::Errno,
    /// Who enforces new quota roots: btrfs where it can, the daemon (FUSE), or btrfs only.
    pub quota_backend: crate::quota::Choice,
    /// Where Prometheus metrics are served; `None` = not served.
    pub metrics: Option<std::net::SocketAddr>,
    /// A directory on a regular filesystem the view's layout dirs are bind-mounted into.
    pub expose_into: Option<PathBuf>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            remote: PathBuf::new(),
            local: PathBuf::new(),
            mountpoint: PathBuf::new(),
            driver: "overlay".into(),
            link_style: LinkStyle::Absolute,
            allow_other: false,
            allow_root: false,
            read_only: false,
            suid: false,
            dev: false,
            atime: AccessTimes::default(),
            foreground: false,
            // One per CPU: the kernel hands each request to the thread that has waited
            // longest, so spare threads only move requests to cold CPUs (a third more CPU
            // per request on 2 CPUs). Requests that wait run on pools of their own.
            threads: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(2, 64),
            // As many calls as may be outstanding on the remote at once.
            remote_threads: 32,
            passthrough: true,
            io_uring: RingUse::Auto,
            keeper: None,
            entry_timeout: Duration::from_secs(3600),
            attr_timeout: Duration::from_secs(3600),
            log_file: None,
            log_level: None,
            fsname: None,
            refresh: Duration::from_secs(5),
            scan_timeout: Duration::from_secs(30),
            hide_unhealthy: false,
            quota_errno: nix::errno::Errno::ENOSPC,
            quota_backend: crate::quota::Choice::Auto,
            inotify: true,
            journal: true,
            journal_poll: Duration::from_millis(200),
            metrics: None,
            expose_into: None,
        }
    }
}

impl MountConfig {
    /// Applies a comma-separated option list, as given to `-o`.
    pub fn apply_options(&mut self, list: &str) -> Result<()> {
        for opt in list.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            self.apply_option(opt)?;
        }
        Ok(())
    }

    /// Applies one option, `key` or `key=value`.
    pub fn apply_option(&mut self, opt: &str) -> Result<()> {
        options::apply(self, opt)
    }

    /// Checks everything that can be checked before mounting, so that a bad configuration
    /// fails with one clear line and nothing half-started.
    pub fn validate(&mut self) -> Result<()> {
        self.mountpoint = existing_dir("mountpoint", &self.mountpoint)?;
        self.validate_paths()?;
        if is_mountpoint(&self.mountpoint) {
            return Err(Error::Busy(self.mountpoint.clone()));
        }
        if let Some(root) = &self.expose_into {
            self.expose_into = Some(self.check_expose_into(root)?);
        }
        // The keeper mounts with mount(2) itself, to hold the device it mounted.
        if self.keeper == Some(true) && !nix::unistd::geteuid().is_root() {
            return Err(bad(
                "keeper",
                "needs root (the keeper makes the mount itself)",
            ));
        }
        if let Err(e) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
        {
            let denied = e.kind() == std::io::ErrorKind::PermissionDenied;
            if denied && !nix::unistd::geteuid().is_root() {
                return Err(Error::Denied(self.mountpoint.clone()));
            }
            return Err(Error::NoFuse(e.to_string()));
        }
        Ok(())
    }

    /// [`MountConfig::validate`] for a daemon a keeper started on a mount it made: the
    /// mountpoint is busy with that mount, and the device open.
    pub fn validate_kept(&mut self) -> Result<()> {
        // Resolved without a look at the mountpoint itself: that asks the mount, which only
        // this process will serve.
        self.mountpoint = match (self.mountpoint.parent(), self.mountpoint.file_name()) {
            (Some(parent), Some(name)) if !parent.as_os_str().is_empty() => {
                existing_dir("mountpoint's directory", parent)?.join(name)
            }
            (_, Some(name)) => existing_dir("mountpoint's directory", Path::new("."))?.join(name),
            _ => existing_dir("mountpoint", &self.mountpoint)?,
        };
        self.validate_paths()?;
        if let Some(root) = &self.expose_into {
            self.expose_into = Some(self.check_expose_into(root)?);
        }
        Ok(())
    }

    /// The two trees given, existing, and apart from each other and from the (resolved)
    /// mountpoint.
    fn validate_paths(&mut self) -> Result<()> {
        if self.remote.as_os_str().is_empty() {
            return Err(bad("remote", "no remote directory given"));
        }
        if self.local.as_os_str().is_empty() {
            return Err(bad("local", "no local directory given"));
        }
        self.remote = existing_dir("remote directory", &self.remote)?;
        self.local = existing_dir("local directory", &self.local)?;
        for (what, dir) in [
            ("local directory", &self.local),
            ("remote directory", &self.remote),
        ] {
            if dir.starts_with(&self.mountpoint) || self.mountpoint.starts_with(dir) {
                return Err(Error::BadPath {
                    what,
                    path: dir.clone(),
                    reason: format!("overlaps the mountpoint {}", self.mountpoint.display()),
                });
            }
        }
        if self.local.starts_with(&self.remote) || self.remote.starts_with(&self.local) {
            return Err(Error::BadPath {
                what: "local directory",
                path: self.local.clone(),
                reason: format!("overlaps the remote directory {}", self.remote.display()),
            });
        }
        Ok(())
    }
}

impl MountConfig {
    /// Whether a keeper holds the mount (DESIGN §13): as asked, else for a detached mount
    /// by root that does not ask for io_uring (whose rings die with the daemon). A mount in
    /// the foreground is a supervisor's child (systemd, a test), which asks for one itself.
    pub fn kept(&self) -> bool {
        self.keeper.unwrap_or_else(|| {
            !self.foreground && self.io_uring != RingUse::Always && nix::unistd::geteuid().is_root()
        })
    }

    /// The source `/proc/mounts` shows.
    pub fn fsname(&self) -> String {
        self.fsname
            .clone()
            .unwrap_or_else(|| self.remote.display().to_string())
    }

    /// What the kernel is told when layerfs mounts itself (as root).
    pub fn mount_spec<'a>(&'a self, fsname: &'a str) -> MountSpec<'a> {
        MountSpec {
            mountpoint: &self.mountpoint,
            fsname,
            allow_other: self.allow_other || self.allow_root,
            read_only: self.read_only,
            suid: self.suid,
            dev: self.dev,
            atime: self.atime,
        }
    }

    /// ROOT of `expose_into`, canonical: a directory that neither holds nor lies in one of
    /// the mount's trees, on a filesystem that is not FUSE.
    fn check_expose_into(&self, root: &Path) -> Result<PathBuf> {
        const WHAT: &str = "expose-into directory";
        let root = existing_dir(WHAT, root)?;
        let refuse = |reason: String| Error::BadPath {
            what: WHAT,
            path: root.clone(),
            reason,
        };
        for (what, dir) in [
            ("the mountpoint", &self.mountpoint),
            ("the local directory", &self.local),
            ("the remote directory", &self.remote),
        ] {
            if dir.starts_with(&root) || root.starts_with(dir) {
                return Err(refuse(format!("overlaps {what} {}", dir.display())));
            }
        }
        if let Some(reason) = crate::expose::unsuitable(&root) {
            return Err(refuse(reason));
        }
        if !nix::unistd::geteuid().is_root() {
            return Err(refuse("bind mounts need root".into()));
        }
        Ok(root)
    }
}

fn bad(option: &str, reason: &str) -> Error {
    Error::BadOption {
        option: option.to_owned(),
        reason: reason.to_owned(),
    }
}

fn parse_driver(opt: &str, name: &str) -> Result<String> {
    let ok = name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(name.to_owned())
    } else {
        Err(bad(
            opt,
            "a driver name is 1-64 characters of a-z, 0-9, '_' and '-'",
        ))
    }
}

fn parse_secs(opt: &str, value: &str) -> Result<Duration> {
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0 && *s <= 1e7)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| bad(opt, "must be a number of seconds"))
}

/// Seconds, as a plain number or with an `s` or `ms` suffix (`refresh=5s`, `refresh=500ms`).
fn parse_duration(opt: &str, value: &str) -> Result<Duration> {
    let (number, scale) = if let Some(ms) = value.strip_suffix("ms") {
        (ms, 0.001)
    } else if let Some(s) = value.strip_suffix('s') {
        (s, 1.0)
    } else {
        (value, 1.0)
    };
    number
        .parse::<f64>()
        .ok()
        .map(|n| n * scale)
        .filter(|s| s.is_finite() && *s >= 0.0 && *s <= 1e7)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| bad(opt, "must be a number of seconds (e.g. 5, 5s, 500ms)"))
}

fn existing_dir(what: &'static str, path: &Path) -> Result<PathBuf> {
    let err = |reason: String| Error::BadPath {
        what,
        path: path.to_owned(),
        reason,
    };
    let canonical = std::fs::canonicalize(path).map_err(|e| err(e.to_string()))?;
    if !canonical.is_dir() {
        return Err(err("not a directory".into()));
    }
    Ok(canonical)
}

/// Whether `path` (canonical) is the mountpoint of a mounted filesystem.
pub fn is_mountpoint(path: &Path) -> bool {
    crate::store::mountinfo::current()
        .iter()
        .any(|m| m.point == path)
}

/// Options mount(8) and fstab carry for mount(8) itself or for other programs (systemd,
/// fsck ordering, user mounts): the mount helper and a remount accept and ignore them.
pub fn is_for_mount8(option: &str) -> bool {
    let key = option.split_once('=').map_or(option, |(k, _)| k);
    matches!(
        key,
        "defaults"
            | "nofail"
            | "_netdev"
            | "auto"
            | "noauto"
            | "user"
            | "users"
            | "nouser"
            | "owner"
            | "group"
            | "comment"
    ) || key.starts_with("x-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_into_the_config() {
        let mut c = MountConfig::default();
        c.apply_options(
            "local=/l,allow_other,driver=vfs,link_style=relative,threads=4,ro,nopassthrough",
        )
        .unwrap();
        assert_eq!(c.local, PathBuf::from("/l"));
        assert!(c.allow_other && c.read_only && !c.passthrough);
        assert_eq!(c.driver, "vfs");
        assert_eq!(c.link_style, LinkStyle::Relative);
        assert_eq!(c.threads, 4);
    }

    #[test]
    fn bad_options_name_themselves() {
        let mut c = MountConfig::default();
        for (opt, needle) in [
            ("bogus", "bogus"),
            ("threads=0", "threads=0"),
            ("driver=../x", "driver=../x"),
            ("link_style=sideways", "link_style=sideways"),
            ("local", "local"),
            ("allow_other=1", "allow_other=1"),
            ("entry_timeout=-3", "entry_timeout=-3"),
            ("refresh=soon", "refresh=soon"),
            ("scan_timeout=0", "scan_timeout=0"),
            ("hide_unhealthy=1", "hide_unhealthy=1"),
        ] {
            let err = c.apply_options(opt).unwrap_err().to_string();
            assert!(err.contains(needle), "{opt}: {err}");
        }
    }

    #[test]
    fn quota_backend_option() {
        use crate::quota::Choice;
        let mut c = MountConfig::default();
        assert_eq!(c.quota_backend, Choice::Auto);
        c.apply_options("quota_backend=btrfs").unwrap();
        assert_eq!(c.quota_backend, Choice::Btrfs);
        c.apply_options("quota-backend=FUSE").unwrap();
        assert_eq!(c.quota_backend, Choice::Fuse);
        let err = c
            .apply_options("quota_backend=xfs")
            .unwrap_err()
            .to_string();
        assert!(err.contains("quota_backend=xfs"), "{err}");
    }

    #[test]
    fn quota_errno_option() {
        let mut c = MountConfig::default();
        assert_eq!(c.quota_errno, nix::errno::Errno::ENOSPC);
        c.apply_options("quota_errno=EDQUOT").unwrap();
        assert_eq!(c.quota_errno, nix::errno::Errno::EDQUOT);
        c.apply_options("quota-errno=enospc").unwrap();
        assert_eq!(c.quota_errno, nix::errno::Errno::ENOSPC);
        let err = c.apply_options("quota_errno=eio").unwrap_err().to_string();
        assert!(err.contains("quota_errno=eio"), "{err}");
    }

    #[test]
    fn refresh_options() {
        let mut c = MountConfig::default();
        assert_eq!(c.refresh, Duration::from_secs(5));
        c.apply_options("refresh=5s,scan_timeout=2.5,hide_unhealthy,noinotify")
            .unwrap();
        assert_eq!(c.refresh, Duration::from_secs(5));
        assert_eq!(c.scan_timeout, Duration::from_millis(2500));
        assert!(c.hide_unhealthy && !c.inotify);
        c.apply_options("refresh=0").unwrap();
        assert!(c.refresh.is_zero());
        c.apply_options("refresh=250ms").unwrap();
        assert_eq!(c.refresh, Duration::from_millis(250));
    }

    #[test]
    fn metrics_option() {
        let mut c = MountConfig::default();
        assert_eq!(c.metrics, None);
        c.apply_options("metrics=127.0.0.1:9100").unwrap();
        assert_eq!(c.metrics, Some("127.0.0.1:9100".parse().unwrap()));
        c.apply_options("metrics=[::1]:0").unwrap();
        assert_eq!(c.metrics, Some("[::1]:0".parse().unwrap()));
        for opt in [
            "metrics=localhost",
            "metrics=9100",
            "metrics=1.2.3.4:99999",
            "metrics",
        ] {
            let err = c.apply_options(opt).unwrap_err().to_string();
            assert!(err.contains(opt), "{opt}: {err}");
        }
        assert!(options::help().contains("metrics=ADDR:PORT"));
    }

    #[test]
    fn log_levels_are_checked() {
        let mut c = MountConfig::default();
        c.apply_options("log=layerfs=debug").unwrap();
        assert_eq!(c.log_level.as_deref(), Some("layerfs=debug"));
        let err = c.apply_options("log=loud=[").unwrap_err().to_string();
        assert!(err.contains("log=loud=["), "{err}");
    }

    #[test]
    fn empty_items_are_ignored() {
        let mut c = MountConfig::default();
        c.apply_options(",allow_root,,").unwrap();
        assert!(c.allow_root);
    }

    #[test]
    fn validation_refuses_missing_and_overlapping_dirs() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = MountConfig {
            remote: tmp.path().join("missing"),
            local: tmp.path().into(),
            mountpoint: tmp.path().into(),
            ..MountConfig::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("remote directory"), "{err}");

        std::fs::create_dir(tmp.path().join("r")).unwrap();
        std::fs::create_dir(tmp.path().join("m")).unwrap();
        let mut c = MountConfig {
            remote: tmp.path().join("r"),
            local: tmp.path().join("m/inside"),
            mountpoint: tmp.path().join("m"),
            ..MountConfig::default()
        };
        std::fs::create_dir(tmp.path().join("m/inside")).unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("overlaps"), "{err}");
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(crate::store::mountinfo::unescape("/a\\040b"), "/a b");
        assert_eq!(crate::store::mountinfo::unescape("/plain"), "/plain");
        assert!(is_mountpoint(Path::new("/proc")));
    }
}
