//! Integrity regressions: each test is a bug seen on a real mount, and asserts what a correct
//! union filesystem (and, where there is one, the host filesystem as a reference) does.
//!
//! Here, permissions decided as on the host filesystem:
//!
//! - POSIX ACLs are enforced, change the mode `stat` shows at once, and a default ACL replaces
//!   the umask;
//! - unprivileged writes, truncates and fallocates clear the set-ID bits, inside a quota root
//!   too;
//! - changing a quota takes `CAP_SYS_ADMIN`, which a container's root lacks.
//!
//! Most tests compare with the same calls on a plain directory of the host filesystem (the
//! default temp dir, ext4 on the reference machine). Needs root, `/dev/fuse`, and the
//! `setfacl`/`getfacl` tools (Debian package `acl`).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::sys::*;
use common::*;

// ---- POSIX ACLs ----

fn setfacl(args: &[&str], path: &Path) {
    run(Command::new("setfacl").args(args).arg(path));
}

/// `getfacl` of `path` without the comment header.
fn getfacl(path: &Path) -> String {
    run(Command::new("getfacl")
        .args(["--omit-header", "--absolute-names"])
        .arg(path))
}

fn new_acl_dir(m: &Mount, name: &str) -> PathBuf {
    let dir = m.path(name);
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// An access ACL is enforced: after `setfacl -m u:nobody:- f` on a world-readable file,
/// nobody cannot read it, and an ACL entry can grant what the mode does not (the kernel
/// checks ACLs only if the filesystem asks it to; the host filesystem, the reference, does).
/// And `setfacl -m g::r-x` changes the group bits of the mode, which `stat` shows at once,
/// with no cache dropped.
#[test]
fn an_access_acl_is_enforced_and_shows_in_the_mode_at_once() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let host = reference_dir();
    let dir = new_acl_dir(&m, "acl");
    for base in [dir.as_path(), host.path()] {
        let f = base.join("f");
        fs::write(&f, "s\n").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        setfacl(&["-m", "u:nobody:-"], &f);
        let (ok, out) = sh_as_nobody(&format!("LC_ALL=C cat '{}'", f.display()));
        assert!(
            !ok && out.contains("Permission denied"),
            "{}: nobody read a file its ACL denies it: ok={ok}, output {out:?}",
            f.display()
        );
    }
    for base in [dir.as_path(), host.path()] {
        let f = base.join("g");
        fs::write(&f, "g\n").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
        setfacl(&["-m", "u:nobody:r"], &f);
        let (ok, out) = sh_as_nobody(&format!("LC_ALL=C cat '{}'", f.display()));
        assert!(
            ok && out == "g\n",
            "{}: the ACL grants nobody read: {out:?}",
            f.display()
        );
    }
    // The mode follows the ACL at once.
    let mut modes = Vec::new();
    for base in [dir.as_path(), host.path()] {
        let f = base.join("h");
        fs::write(&f, "h\n").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(mode_of(&f), 0o644);
        setfacl(&["-m", "g::r-x"], &f);
        let after = mode_of(&f);
        // A named entry: the group bits become the mask.
        setfacl(&["-m", "u:nobody:rwx"], &f);
        let masked = mode_of(&f);
        modes.push(format!("{after:o} {masked:o}"));
    }
    assert_eq!(modes[1], "654 674", "the host's modes after setfacl");
    assert_eq!(
        modes[0], modes[1],
        "the modes stat shows after setfacl, view vs host"
    );
}

/// A default ACL on a directory decides the modes of what is made in it, instead of the
/// umask, as on the host filesystem: with `u::rwx,g::rwx,o::rwx` as default and umask 022,
/// a new file is 0666 and a new directory 0777, and both carry the ACLs the host gives them.
#[test]
fn a_default_acl_replaces_the_umask() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let host = reference_dir();
    let dir = new_acl_dir(&m, "acl");
    let mut seen = Vec::new();
    for base in [dir.as_path(), host.path()] {
        let d = base.join("inherit");
        fs::create_dir(&d).unwrap();
        setfacl(&["-d", "-m", "u::rwx,g::rwx,o::rwx"], &d);
        run(Command::new("sh").arg("-c").arg(format!(
            "umask 022 && : > '{0}/file' && mkdir '{0}/dir' && mkfifo '{0}/fifo'",
            d.display()
        )));
        let each = ["file", "dir", "fifo"].map(|n| {
            let p = d.join(n);
            let acl = getfacl(&p).replace(&*d.to_string_lossy(), "D");
            (n, format!("{:o}", mode_of(&p)), acl)
        });
        seen.push(each);
    }
    for (view, host) in seen[0].iter().zip(&seen[1]) {
        assert_eq!(
            view, host,
            "{}: the view differs from the host filesystem",
            view.0
        );
    }
    assert_eq!(
        seen[1][0].1, "666",
        "the host applies the default ACL, not the umask"
    );
}

// ---- Set-ID bits ----

/// Makes `path` root-owned (group 0, which nobody is not in) with `mode`.
fn root_file(path: &Path, mode: u32) {
    fs::write(path, b"0123456789").unwrap();
    std::os::unix::fs::chown(path, Some(0), Some(0)).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    assert_eq!(mode_of(path), mode);
}

/// Runs `script` as nobody with `$F` set to `file`; must succeed.
fn as_nobody_on(file: &Path, script: &str) {
    let (ok, out) = sh_as_nobody(&format!(
        "export LC_ALL=C; F='{}'; {script}",
        file.display()
    ));
    assert!(
        ok,
        "`{script}` on {} as nobody failed: {out}",
        file.display()
    );
}

const SGID_STEPS: [(&str, &str); 3] = [
    ("write", r#"echo x >> "$F""#),
    ("truncate", r#"truncate -s 2 "$F""#),
    ("fallocate", r#"fallocate -l 8192 "$F""#),
];

/// An unprivileged write, truncate or fallocate by a caller outside the file's group clears
/// the set-group-ID bit of a file without group execute (modes 02766 and, with set-user-ID
/// too, 06766 and 06666 as xfstests 683-685 use), as the kernel does on the host filesystem
/// (`setattr_should_drop_sgid`); so does setting an access ACL (xfstests 375).
#[test]
fn unprivileged_writes_clear_set_group_id_as_on_the_host() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let host = reference_dir();
    let dir = m.path("sgid");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    let mut differ = Vec::new();
    let acl = ("setfacl", r#"setfacl -m u::rwx,g::rwx,o::rwx "$F""#);
    for (what, script) in SGID_STEPS.into_iter().chain([acl]) {
        for start in [0o2766, 0o6766, 0o6666] {
            let mut modes = Vec::new();
            for base in [dir.as_path(), host.path()] {
                let f = base.join(format!("{what}-{start:o}"));
                root_file(&f, start);
                if what == "setfacl" {
                    // Only the owner may set an ACL: nobody owns it, root's group keeps it.
                    std::os::unix::fs::chown(&f, Some(65534), None).unwrap();
                    fs::set_permissions(&f, fs::Permissions::from_mode(start)).unwrap();
                }
                as_nobody_on(&f, script);
                modes.push(mode_of(&f));
            }
            eprintln!(
                "{what} of {start:o} by nobody: view {:o}, host {:o}",
                modes[0], modes[1]
            );
            if modes[0] != modes[1] {
                differ.push(format!(
                    "{what} of {start:o}: view {:o}, host {:o}",
                    modes[0], modes[1]
                ));
            }
        }
    }
    assert!(
        mode_of(&host.path().join("write-2766")) & 0o2000 == 0,
        "the host clears set-group-ID on a write by a non-member"
    );
    assert!(
        differ.is_empty(),
        "modes after nobody's calls differ: {differ:?}"
    );
}

/// Inside a quota root (where writes go through the daemon, not passthrough), a write by
/// nobody to a root-owned 06777 file clears set-user-ID and set-group-ID, as anywhere else.
#[test]
fn unprivileged_writes_clear_set_id_bits_inside_a_quota_root() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let host = reference_dir();
    let q = m.path("overlay/q");
    fs::create_dir_all(&q).unwrap();
    quota_set(&m, "overlay/q", "100M");
    fs::set_permissions(&q, fs::Permissions::from_mode(0o777)).unwrap();
    let mut modes = Vec::new();
    for base in [q.as_path(), host.path()] {
        let f = base.join("suid");
        root_file(&f, 0o6777);
        as_nobody_on(&f, r#"echo x >> "$F""#);
        modes.push(mode_of(&f));
    }
    assert_eq!(modes[1], 0o777, "the host clears both bits");
    assert_eq!(
        format!("{:o}", modes[0]),
        format!("{:o}", modes[1]),
        "mode after a write by nobody inside a quota root"
    );
    // Truncation too.
    let mut modes = Vec::new();
    for base in [q.as_path(), host.path()] {
        let f = base.join("suid-trunc");
        root_file(&f, 0o6777);
        as_nobody_on(&f, r#"truncate -s 1 "$F""#);
        modes.push(mode_of(&f));
    }
    assert_eq!(
        format!("{:o}", modes[0]),
        format!("{:o}", modes[1]),
        "mode after a truncate by nobody inside a quota root"
    );
}

// ---- Quota changes need CAP_SYS_ADMIN ----

const QUOTA_XATTR: &str = "user.layerfs.quota";

/// Runs `lsetxattr(path, name, value)` (or `lremovexattr` for `None`) in a forked child that
/// is still uid 0 but has dropped every capability (`capset` to empty sets); 0 or the errno.
fn xattr_without_caps(p: &Path, name: &str, value: Option<&[u8]>) -> i32 {
    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let none = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    common::sys::xattr_in_child(p, name, value, "uid 0 without capabilities", || {
        let mut header = CapHeader {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut now = none;
        unsafe {
            libc::syscall(
                libc::SYS_capset,
                &mut header as *mut CapHeader,
                none.as_ptr(),
            ) == 0
                && libc::syscall(
                    libc::SYS_capget,
                    &mut header as *mut CapHeader,
                    now.as_mut_ptr(),
                ) == 0
                && now.iter().all(|d| d.effective == 0 && d.permitted == 0)
                && libc::getuid() == 0
        }
    })
}

fn quota_limit(p: &Path) -> Option<String> {
    xattr_get(p, QUOTA_XATTR)
        .ok()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// Setting, changing or removing a quota by its xattr takes `CAP_SYS_ADMIN`, as for XFS
/// project quotas: uid 0 with no capabilities (a container's root) gets `EPERM` and the
/// limit stays; full root may.
#[test]
fn quota_changes_need_cap_sys_admin() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let dir = m.path("overlay/q");
    fs::create_dir(&dir).unwrap();
    let refused = |what: &str, value: Option<&[u8]>| {
        let e = xattr_without_caps(&dir, QUOTA_XATTR, value);
        assert_eq!(
            e,
            libc::EPERM,
            "uid 0 without capabilities could {what}: {}",
            if e == 0 {
                "succeeded".to_owned()
            } else {
                errname(e)
            }
        );
    };
    refused("set a quota", Some(b"50G"));
    assert_eq!(quota_limit(&dir), None, "no quota was set");
    xattr_set(&dir, QUOTA_XATTR, b"1G").expect("full root sets a quota");
    let limit = quota_limit(&dir).expect("the quota is set");
    refused("raise the quota", Some(b"50G"));
    refused("clear the quota with an empty value", Some(b""));
    refused("remove the quota", None);
    assert_eq!(quota_limit(&dir), Some(limit), "the limit stays");
    // Other user xattrs stay open to it.
    assert_eq!(xattr_without_caps(&dir, "user.other", Some(b"v")), 0);
    xattr_set(&dir, QUOTA_XATTR, b"2G").expect("full root changes a quota");
    xattr_remove(&dir, QUOTA_XATTR).expect("full root removes a quota");
    assert_eq!(quota_limit(&dir), None);
}
