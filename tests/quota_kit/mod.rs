//! What the quota tests share: the `layerfs quota` commands read back as [`Quota`]s, quota
//! roots made in a fixture mount, and writes that go on until a root refuses them. Each
//! quota test file uses a part of it.
//!
//! Usage is allocated space in local (`st_blocks`), so the figures are compared with what the
//! local backing dir takes on disk ([`allocated_under`]), allowing [`SLACK`] for the blocks a
//! filesystem adds for its own metadata (extent blocks, directory growth).

#![allow(dead_code)]

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::common::*;
use serde_json::Value;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1 << 20;
/// Blocks a filesystem may allocate for its own metadata beyond what the data needs.
pub const SLACK: u64 = 64 * KIB;
/// The most one write may overshoot by: one FUSE write in flight.
pub const ONE_WRITE: u64 = MIB;

// ---- The `layerfs quota` commands --------------------------------------------------------

/// One quota root as `layerfs quota get|set|list --json` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    pub path: String,
    pub limit: u64,
    pub used: u64,
    pub available: u64,
    pub inode_limit: Option<u64>,
    pub inodes_used: u64,
    /// Who enforces it: `fuse` or `btrfs`.
    pub backend: String,
}

pub fn parse_quota(v: &Value) -> Quota {
    let num = |k: &str| {
        v.get(k)
            .unwrap_or_else(|| panic!("no {k:?} in {v}"))
            .as_u64()
            .unwrap_or_else(|| panic!("{k:?} is not a number in {v}"))
    };
    let q = Quota {
        path: v["path"]
            .as_str()
            .unwrap_or_else(|| panic!("no \"path\" in {v}"))
            .to_owned(),
        limit: num("limit"),
        used: num("used"),
        available: num("available"),
        inode_limit: match v.get("inode_limit") {
            Some(Value::Null) => None,
            Some(n) => Some(
                n.as_u64()
                    .unwrap_or_else(|| panic!("bad inode_limit in {v}")),
            ),
            None => panic!("no \"inode_limit\" in {v}"),
        },
        inodes_used: num("inodes_used"),
        backend: v["backend"]
            .as_str()
            .unwrap_or_else(|| panic!("no \"backend\" in {v}"))
            .to_owned(),
    };
    assert_eq!(
        q.available,
        q.limit.saturating_sub(q.used),
        "available is limit - used in {v}"
    );
    q
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs a quota command that must succeed; its stdout.
pub fn quota_ok(m: &Mount, sub: &str, rest: &[&str]) -> String {
    let out = quota_cmd(m, sub, rest);
    assert!(
        out.status.success(),
        "layerfs quota {sub} {rest:?} failed ({}): {}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs a quota command that must fail with a one-line message; that line.
pub fn quota_err(m: &Mount, sub: &str, rest: &[&str]) -> String {
    let out = quota_cmd(m, sub, rest);
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "layerfs quota {sub} {rest:?} succeeded: {}{err}",
        text(&out.stdout)
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "layerfs quota {sub} {rest:?}: one line on stderr, got {err:?}"
    );
    err.trim_end().to_owned()
}

pub fn json_of(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s:?}"))
}

pub fn get(m: &Mount, rel: &str) -> Quota {
    let q = parse_quota(&json_of(&quota_ok(m, "get", &[rel, "--json"])));
    assert_eq!(q.path, rel);
    q
}

pub fn set(m: &Mount, rel: &str, size: &str, extra: &[&str]) -> Quota {
    let mut args = vec![rel, size];
    args.extend_from_slice(extra);
    args.push("--json");
    let q = parse_quota(&json_of(&quota_ok(m, "set", &args)));
    assert_eq!(q.path, rel);
    q
}

pub fn list(m: &Mount) -> Vec<Quota> {
    let v = json_of(&quota_ok(m, "list", &["--json"]));
    let mut out: Vec<Quota> = v
        .as_array()
        .unwrap_or_else(|| panic!("quota list --json is not an array: {v}"))
        .iter()
        .map(parse_quota)
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

pub fn used(m: &Mount, rel: &str) -> u64 {
    get(m, rel).used
}

/// Polls until the usage of `rel` satisfies `ok` (credits for closed files arrive with the
/// kernel's asynchronous RELEASE); returns it.
pub fn used_until(m: &Mount, rel: &str, what: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let last = used(m, rel);
        if ok(last) {
            return last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{rel}: {what}; usage stays at {last}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

// ---- Quota roots in a fixture mount ------------------------------------------------------

pub fn mount() -> Mount {
    Mount::new()
}

/// Makes `overlay/<name>` and gives it a quota of `size`; its path in the view.
pub fn root(m: &Mount, name: &str, size: &str, extra: &[&str]) -> PathBuf {
    let dir = m.path(&format!("overlay/{name}"));
    fs::create_dir_all(&dir).unwrap();
    set(m, &format!("overlay/{name}"), size, extra);
    dir
}

/// Where a quota is set and read through the view itself.
pub const XATTR: &str = "user.layerfs.quota";

/// L1's `diff/`: a ready remote layer's dir, where a change copies a file up.
pub fn l1_diff_rel() -> String {
    format!("overlay/RO/{}/diff", id("L1"))
}

/// Whether files opened for writing outside a root get FUSE passthrough on this mount: then
/// a quota cannot be set over one of them (as `a_handle_opened_before_the_quota_was_set_
/// cannot_bypass_it` relies on). Probes with a throwaway dir `overlay/<name>`.
pub fn passthrough_in_use(m: &Mount, name: &str) -> bool {
    let dir = m.path(&format!("overlay/{name}"));
    fs::create_dir(&dir).unwrap();
    let f = fs::File::create(dir.join("p")).unwrap();
    let out = quota_cmd(m, "set", &[&format!("overlay/{name}"), "1M", "--json"]);
    drop(f);
    if out.status.success() {
        quota_ok(m, "clear", &[&format!("overlay/{name}")]);
        false
    } else {
        let err = text(&out.stderr);
        assert!(
            err.contains("passthrough"),
            "quota set over a file open for writing failed for another reason: {err}"
        );
        true
    }
}

/// What the local backing dir of view path `rel` takes on disk.
pub fn local_alloc(m: &Mount, rel: &str) -> u64 {
    allocated_under(&m.local.join(rel)).0
}

pub fn assert_close(what: &str, a: u64, b: u64, tol: u64) {
    assert!(
        a.abs_diff(b) <= tol,
        "{what}: {a} and {b} differ by {} (> {tol})",
        a.abs_diff(b)
    );
}

/// The quota's own figure agrees with what local takes on disk.
pub fn assert_usage_matches_local(m: &Mount, rel: &str) -> Quota {
    let q = get(m, rel);
    assert_close(
        &format!("usage of {rel} vs its local dir"),
        q.used,
        local_alloc(m, rel),
        SLACK,
    );
    q
}

// ---- Errors, and writes until a root refuses them ----------------------------------------

pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error()
        .unwrap_or_else(|| panic!("not an OS error: {e}"))
}

/// An errno's message with its number, as quota failures are reported.
pub fn errname(n: i32) -> String {
    format!("{} ({n})", crate::common::sys::errname(n))
}

pub fn assert_errno<T: std::fmt::Debug>(what: &str, r: std::io::Result<T>, want: i32) {
    match r {
        Ok(v) => panic!("{what}: succeeded ({v:?}), expected {}", errname(want)),
        Err(e) => assert_eq!(
            errno(&e),
            want,
            "{what}: got {}, expected {}",
            errname(errno(&e)),
            errname(want)
        ),
    }
}

/// Writes `chunk` bytes at a time from the file's offset until a write fails. A short write
/// must be followed by a failing one. Returns the bytes written and the failure's errno;
/// what was written is `pattern(chunk, 7)` over and over.
pub fn fill(f: &mut fs::File, chunk: usize, cap: u64) -> (u64, i32) {
    let data = pattern(chunk, 7);
    let mut total = 0u64;
    loop {
        assert!(total <= cap, "wrote {total} bytes and no write failed");
        match f.write(&data) {
            Ok(0) => panic!("write returned 0 after {total} bytes"),
            Ok(n) if n == chunk => total += n as u64,
            Ok(n) => {
                total += n as u64;
                let e = f
                    .write(&data[n..])
                    .expect_err("after a short write, the next write fails");
                return (total, errno(&e));
            }
            Err(e) => return (total, errno(&e)),
        }
    }
}

/// What [`fill`] wrote, `len` bytes of it.
pub fn filled(chunk: usize, len: u64) -> Vec<u8> {
    let data = pattern(chunk, 7);
    let mut out = Vec::with_capacity(len as usize);
    while (out.len() as u64) < len {
        let n = (len as usize - out.len()).min(chunk);
        out.extend_from_slice(&data[..n]);
    }
    out
}

/// Fills the root at `dir` with file `name` until a write fails; the bytes written.
pub fn fill_root(dir: &Path, name: &str, want: i32) -> u64 {
    let mut f = fs::File::create(dir.join(name)).unwrap();
    let (n, e) = fill(&mut f, MIB as usize, 1 << 30);
    assert_eq!(e, want, "filling {}: got {}", dir.display(), errname(e));
    n
}

pub fn write_file(p: &Path, len: usize, seed: u64) -> Vec<u8> {
    let data = pattern(len, seed);
    fs::write(p, &data).unwrap();
    data
}
