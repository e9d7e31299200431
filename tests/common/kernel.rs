//! The kernel's part around a view: its caches, kernel overlayfs stacked on the view as a
//! container runtime stacks it, a filesystem of the test's own under local, the offer of FUSE
//! over io_uring; and what a test does where the host lacks what it checks.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{is_mounted, run, sh_as_nobody, unmount_patiently};

/// Drops the kernel's dentry, inode and page caches.
pub fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").expect("drop_caches");
}

/// Says a test cannot check what it is for because the host lacks `capability`, and lets it
/// skip; unless `LAYERFS_TEST_REQUIRE` (a comma-separated list such as
/// `passthrough,io_uring`, or `all`) names it, which makes the absence a failure. CI sets
/// it, so a host without the capability cannot pass for one with it.
pub fn missing_capability(capability: &str, why: &str) {
    let required = std::env::var("LAYERFS_TEST_REQUIRE").unwrap_or_default();
    if required
        .split(',')
        .map(str::trim)
        .any(|c| c == capability || c == "all")
    {
        panic!("{why}, and LAYERFS_TEST_REQUIRE requires {capability}");
    }
    eprintln!("skipped: {why} (LAYERFS_TEST_REQUIRE={capability} makes this a failure)");
}

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Turns the kernel's offer of FUSE over io_uring on for as long as it lives; the last one
/// of a test binary to go puts back what the first found. Mounts that run meanwhile and do
/// not refuse the ring (`noio_uring`) or have a keeper take it too.
pub struct RingOffered(());

/// How many [`RingOffered`] live in this process, and what the first found.
static OFFERED: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

impl RingOffered {
    /// `None` where the kernel has no such parameter (no FUSE over io_uring).
    pub fn turn_on() -> Option<RingOffered> {
        let mut offered = OFFERED.lock().unwrap_or_else(|e| e.into_inner());
        if offered.0 == 0 {
            offered.1 = fs::read_to_string(URING_PARAM).ok()?;
            fs::write(URING_PARAM, "Y").expect("enable_uring");
        }
        offered.0 += 1;
        Some(RingOffered(()))
    }
}

impl Drop for RingOffered {
    fn drop(&mut self) {
        let mut offered = OFFERED.lock().unwrap_or_else(|e| e.into_inner());
        offered.0 -= 1;
        if offered.0 == 0 {
            let _ = fs::write(URING_PARAM, offered.1.trim());
        }
    }
}

/// A kernel overlayfs mount, unmounted on drop (before the view it stacks on).
pub struct Overlay {
    target: PathBuf,
}

impl Overlay {
    pub fn mount(
        lowers: &[PathBuf],
        upper: &Path,
        work: &Path,
        target: &Path,
    ) -> Result<Overlay, String> {
        let lowerdir = lowers
            .iter()
            .map(|p| p.to_str().expect("a UTF-8 path").to_owned())
            .collect::<Vec<_>>()
            .join(":");
        let out = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!(
                "lowerdir={lowerdir},upperdir={},workdir={}",
                upper.display(),
                work.display()
            ))
            .arg(target)
            .stdin(Stdio::null())
            .output()
            .expect("run mount");
        if out.status.success() && is_mounted(target) {
            Ok(Overlay {
                target: target.to_owned(),
            })
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        unmount_patiently(&self.target);
    }
}

/// Copies a small layer (directories 0755, `etc/conf.d/f` 0644 holding "readable") to
/// `into` with `cp -a`, as a runtime copies a layer in, stacks kernel overlayfs on the copy
/// (its own directories in `scratch`), and reads `etc/conf.d` and the file there as
/// `nobody`: whether that succeeded, and what it printed.
pub fn read_a_copied_layer_as_nobody(into: &Path, scratch: &Path) -> (bool, String) {
    let src = scratch.join("layer");
    fs::create_dir_all(src.join("etc/conf.d")).unwrap();
    fs::write(src.join("etc/conf.d/f"), "readable\n").unwrap();
    for dir in ["", "etc", "etc/conf.d"] {
        fs::set_permissions(src.join(dir), fs::Permissions::from_mode(0o755)).unwrap();
    }
    fs::set_permissions(src.join("etc/conf.d/f"), fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(into)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cp -a: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (upper, work, merged) = (
        scratch.join("upper"),
        scratch.join("work"),
        scratch.join("merged"),
    );
    for dir in [&upper, &work, &merged] {
        fs::create_dir(dir).unwrap();
    }
    fs::set_permissions(scratch, fs::Permissions::from_mode(0o755)).unwrap();
    let _ov = Overlay::mount(&[into.to_owned()], &upper, &work, &merged).unwrap();
    sh_as_nobody(&format!(
        "ls '{0}/etc/conf.d' && cat '{0}/etc/conf.d/f'",
        merged.display()
    ))
}

/// A filesystem of the test's own mounted on a mount's local dir before the daemon starts
/// (from `prepare`), so that no other process allocates there; unmounted (after the view)
/// on drop, even when the test fails. The mount's temp dir, whose removal the filesystem
/// got in the way of, is removed then.
#[derive(Default)]
pub struct LocalFs {
    local: Option<PathBuf>,
}

impl LocalFs {
    /// A tmpfs with `options`.
    pub fn tmpfs(&mut self, local: &Path, options: &str) {
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(local));
        self.mounted(local);
    }

    /// A fresh ext4 of `mib` MiB in an image file beside `local`, loop-mounted.
    pub fn ext4(&mut self, local: &Path, mib: u64) {
        self.ext4_with(local, mib, &[]);
    }

    /// Like [`LocalFs::ext4`], with extra `mkfs.ext4` arguments.
    pub fn ext4_with(&mut self, local: &Path, mib: u64, mkfs: &[&str]) {
        let image = local.with_file_name("local.ext4");
        let f = fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        drop(f);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .args(mkfs)
            .arg(&image));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(local));
        self.mounted(local);
    }

    /// A fresh btrfs of `mib` MiB (at least 114, btrfs's smallest) in an image file beside
    /// `local`, loop-mounted.
    pub fn btrfs(&mut self, local: &Path, mib: u64) {
        let image = local.with_file_name("local.btrfs");
        let f = fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        drop(f);
        run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&image));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(local));
        self.mounted(local);
    }

    fn mounted(&mut self, local: &Path) {
        self.local = Some(local.to_owned());
        fs::set_permissions(local, fs::Permissions::from_mode(0o755)).unwrap();
    }
}

impl Drop for LocalFs {
    fn drop(&mut self) {
        let Some(local) = self.local.take() else {
            return;
        };
        unmount_patiently(&local);
        if let Some(dir) = local.parent() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}
