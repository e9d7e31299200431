//! Processes around a mount: commands run as an unprivileged user, the layerfs CLI, the
//! daemon's descendants, and the limit on what a process may open.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use super::{Mount, BIN};

/// Runs `sh -c script` as an unprivileged user (uid/gid 65534), returning (status, stdout+stderr).
pub fn sh_as_nobody(script: &str) -> (bool, String) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("sh");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Runs `cmd`, which must succeed; its standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `layerfs ARGS... MOUNTPOINT`, its output collected.
pub fn cli(args: &[&str], mnt: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .arg(mnt)
        .stdin(Stdio::null())
        .output()
        .expect("run layerfs")
}

/// `layerfs quota SUB MOUNTPOINT REST...`.
pub fn quota_cmd(m: &Mount, sub: &str, rest: &[&str]) -> Output {
    Command::new(BIN)
        .arg("quota")
        .arg(sub)
        .arg(&m.mnt)
        .args(rest)
        .output()
        .expect("run layerfs quota")
}

pub fn quota_set(m: &Mount, rel: &str, size: &str) {
    let out = quota_cmd(m, "set", &[rel, size]);
    assert!(
        out.status.success(),
        "layerfs quota set {rel} {size}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the process `pid` has exited (a zombie waiting to be reaped), read from /proc so
/// that its pipes stay readable by `wait_with_output`.
pub fn exited(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state == "Z")
        })
        .unwrap_or(true)
}

/// The processes descended from `pid` (not `pid` itself).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((p, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for (child, _) in parents.iter().filter(|(_, pp)| *pp == p) {
            out.push(*child);
            frontier.push(*child);
        }
    }
    out
}

/// Pids of live processes whose command line has `arg` as one of its arguments.
pub fn processes_with_arg(arg: &Path) -> Vec<u32> {
    let want = arg.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // A zombie's (or a vanished process's) command line reads empty.
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmdline.split(|b| *b == 0).any(|a| a == want) {
            pids.push(pid);
        }
    }
    pids
}

/// Runs `cmd` with an open-file limit of `n`, soft and hard (so it cannot raise it).
pub fn limit_open_files(cmd: &mut Command, n: u64) {
    use std::os::unix::process::CommandExt;
    let limit = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: setrlimit is async-signal-safe and `limit` is a plain value.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// Runs `cmd` holding `file` as descriptor `at`, without close-on-exec: what a caller that
/// forgot to close one (or means to share it, as make's jobserver does) hands a child.
pub fn inherit_descriptor(cmd: &mut Command, file: &fs::File, at: i32) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let from = file.as_raw_fd();
    // SAFETY: dup2 is async-signal-safe. The caller keeps `file` open until the command is
    // spawned, so `from` is still its descriptor then.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(from, at) == at {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// `pid` and every process below it.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut at = 0;
    while at < tree.len() {
        let p = tree[at];
        let children =
            fs::read_to_string(format!("/proc/{p}/task/{p}/children")).unwrap_or_default();
        tree.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
        at += 1;
    }
    tree
}

/// The descriptors `pid` holds, with what each points at (a path, `pipe:[…]`, a deleted
/// file's path with ` (deleted)`); none if the process is gone.
pub fn descriptor_targets(pid: u32) -> Vec<(u32, PathBuf)> {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| {
            let number = fd.file_name().to_str()?.parse().ok()?;
            Some((number, fs::read_link(fd.path()).ok()?))
        })
        .collect()
}

/// The descriptors of `pid` open on `path`.
pub fn descriptors_on(pid: u32, path: &Path) -> Vec<u32> {
    descriptor_targets(pid)
        .into_iter()
        .filter(|(_, target)| target == path)
        .map(|(fd, _)| fd)
        .collect()
}
