//! Where a mount's control socket lives: derived from the mountpoint alone, so that the
//! server and any client agree without asking anyone.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The environment variable that overrides [`DEFAULT_RUN_DIR`].
pub const RUN_DIR_ENV: &str = "LAYERFS_RUN_DIR";

/// Where control sockets live unless [`RUN_DIR_ENV`] says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/run/layerfs";

/// The longest path a unix socket address holds (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The run dir: `$LAYERFS_RUN_DIR` if set and not empty, else [`DEFAULT_RUN_DIR`].
pub fn run_dir() -> PathBuf {
    match std::env::var_os(RUN_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(DEFAULT_RUN_DIR),
    }
}

/// The control socket of the mount at `mountpoint` (canonical), under [`run_dir`].
pub fn socket_path(mountpoint: &Path) -> PathBuf {
    socket_path_in(&run_dir(), mountpoint)
}

/// The control socket of the mount at `mountpoint` (canonical), under `run_dir`.
pub fn socket_path_in(run_dir: &Path, mountpoint: &Path) -> PathBuf {
    let dir = run_dir.join("mounts");
    let named = dir.join(format!("{}.sock", escape_path(mountpoint)));
    if named.as_os_str().len() <= MAX_SOCKET_PATH {
        return named;
    }
    // Too long to bind: a digest still names exactly one mountpoint and stays short.
    let digest = Sha256::digest(mountpoint.as_os_str().as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{hex}.sock"))
}

/// `path` escaped like `systemd-escape --path`: surrounding and repeated slashes dropped,
/// `/` → `-`, every byte but ASCII letters, digits, `:`, `_` and a non-leading `.` → `\xNN`.
/// The root is `-`.
pub fn escape_path(path: &Path) -> String {
    let parts: Vec<&[u8]> = path
        .as_os_str()
        .as_bytes()
        .split(|b| *b == b'/')
        .filter(|p| !p.is_empty())
        .collect();
    if parts.is_empty() {
        return "-".to_owned();
    }
    let mut out = String::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('-');
        }
        for (j, &b) in part.iter().enumerate() {
            let plain = b.is_ascii_alphanumeric() || b == b':' || b == b'_' || b == b'.';
            if plain && !(i == 0 && j == 0 && b == b'.') {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("\\x{b:02x}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn escapes_like_systemd() {
        for (path, want) in [
            ("/", "-"),
            ("/var/lib/isulad/storage", "var-lib-isulad-storage"),
            ("/var//lib/", "var-lib"),
            ("/mnt/a-b", "mnt-a\\x2db"),
            ("/mnt/my dir", "mnt-my\\x20dir"),
            ("/.hidden/x.y", "\\x2ehidden-x.y"),
            ("/a\\b", "a\\x5cb"),
        ] {
            assert_eq!(escape_path(Path::new(path)), want, "{path}");
        }
        let odd = Path::new(OsStr::from_bytes(b"/m\xffn"));
        assert_eq!(escape_path(odd), "m\\xffn");
    }

    #[test]
    fn distinct_mountpoints_get_distinct_sockets() {
        let dir = Path::new("/run/layerfs");
        let a = socket_path_in(dir, Path::new("/a-b"));
        let b = socket_path_in(dir, Path::new("/a/b"));
        assert_ne!(a, b);
        assert_eq!(
            socket_path_in(dir, Path::new("/var/lib/isulad/storage")),
            Path::new("/run/layerfs/mounts/var-lib-isulad-storage.sock")
        );
        // The CSI driver's socket sits in the run dir itself.
        assert_ne!(
            socket_path_in(dir, Path::new("/csi")),
            Path::new("/run/layerfs/csi.sock")
        );
    }

    #[test]
    fn long_mountpoints_still_fit_a_socket_address() {
        let dir = Path::new("/run/layerfs");
        let long = PathBuf::from(format!("/{}", "x".repeat(200)));
        let other = PathBuf::from(format!("/{}", "y".repeat(200)));
        let p = socket_path_in(dir, &long);
        assert!(p.as_os_str().len() <= MAX_SOCKET_PATH, "{}", p.display());
        assert!(p.starts_with("/run/layerfs/mounts"));
        assert_eq!(p, socket_path_in(dir, &long));
        assert_ne!(p, socket_path_in(dir, &other));
    }
}
