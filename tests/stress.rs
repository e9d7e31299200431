//! Concurrent stress on a real mount. Many worker *processes* (16 by default) run at once,
//! each alone in its own directory, through a seeded random mix of creates, writes,
//! read-backs, renames over existing names, unlinks, hard links, symlinks, mkdir/rmdir,
//! xattrs, listings with an `lstat` of every listed name, `stat`s and `mmap` reads. Each
//! worker keeps a model of its directories (name → content, kind, symlink target, xattr) and
//! checks every result against it: a failed call that should have worked is an *error*, a
//! result other than the model's is a *mismatch*. The test passes only with none of either.
//!
//! Two scenarios:
//! - `local_only_area`: each worker in a new directory at the mount root (local only);
//! - `shared_area_with_copy_ups`: each worker in a new directory inside the diff of the
//!   ready remote layer L1, plus a remote directory of its own, put into the remote copy
//!   before mounting, whose files it reads, overwrites, appends to, truncates, unlinks,
//!   renames and links (copy-ups, whiteouts, names recreated over whiteouts).
//!
//! After a failure the worker takes what the view then shows as its model of the name (so a
//! failure is counted where it happens, and less often again by every later operation on
//! the name) and leaves the name out of the final check until an operation sets it again.
//! Each worker describes its first distinct failures in detail, with what the name is on
//! disk in local and remote at that moment; the parent prints them, the operation counts
//! and the failures by kind.
//!
//! After the workers finish, the parent re-reads the final state of every worker's
//! directories through the view (as left, after dropping the kernel caches, and after a
//! remount) and compares it with the models the workers left outside the mount.
//!
//! Workers are this test binary run again (`--ignored --exact stress_worker`) with
//! `LAYERFS_STRESS_WORKER` set; without it `stress_worker` does nothing.
//!
//! Knobs (environment):
//! - `LAYERFS_STRESS_SECS`: how long the workers run, per scenario (default 50);
//! - `LAYERFS_STRESS_PROCS`: how many workers (default 16);
//! - `LAYERFS_STRESS_OPTS`: extra `-o` mount options, e.g. `nopassthrough`;
//! - `LAYERFS_STRESS_SEED`: the base seed (default: from the clock; printed);
//! - `LAYERFS_STRESS_PLAIN`: if set, the workers work in plain directories beside the mount
//!   instead of through it (a check of the test's own model: it must pass there).
//!
//! Run it in release mode: a debug daemon is too slow to show races.
//! `cargo test --release --test stress -- --nocapture`

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use common::*;

// ---- Knobs and the parent/worker protocol ------------------------------------------------

/// Set in a worker: the path of its own (not yet existing) directory in the view.
const ENV_WORKER: &str = "LAYERFS_STRESS_WORKER";
/// Set in a worker of the shared scenario: its remote directory in the view.
const ENV_REMOTE_AREA: &str = "LAYERFS_STRESS_REMOTE_AREA";
/// The worker's index (names its remote files' contents).
const ENV_INDEX: &str = "LAYERFS_STRESS_INDEX";
const ENV_SEED: &str = "LAYERFS_STRESS_SEED";
/// Milliseconds since the epoch at which the worker stops.
const ENV_DEADLINE: &str = "LAYERFS_STRESS_DEADLINE_MS";
/// How long the worker runs, in milliseconds (paces its copy-ups over the run).
const ENV_DURATION: &str = "LAYERFS_STRESS_DURATION_MS";
/// Where the worker writes its result (JSON), outside the mount.
const ENV_RESULT: &str = "LAYERFS_STRESS_RESULT";
/// Where the worker writes its final model (JSON), outside the mount.
const ENV_MODEL: &str = "LAYERFS_STRESS_MODEL";
/// L1's `diff/` through the view: fixture files to read.
const ENV_FIXTURE: &str = "LAYERFS_STRESS_FIXTURE";
/// The mountpoint and its local and remote trees (unset in plain mode): failures are
/// reported with what the name is on disk.
const ENV_MNT: &str = "LAYERFS_STRESS_MNT";
const ENV_LOCAL: &str = "LAYERFS_STRESS_LOCAL";
const ENV_REMOTE: &str = "LAYERFS_STRESS_REMOTE";

const DEFAULT_SECS: u64 = 50;
const DEFAULT_PROCS: usize = 16;
/// A worker still running this long after its deadline is killed (and the test fails).
const GRACE: Duration = Duration::from_secs(60);
/// Failures described in detail, per worker and in the final assertion.
const DETAILS: usize = 20;

/// Remote files each worker of the shared scenario gets in its remote directory.
const REMOTE_FILES: usize = 300;
/// Empty remote dirs, and remote symlinks, each worker gets there.
const REMOTE_DIRS: usize = 4;
const REMOTE_LINKS: usize = 4;
/// Names a worker creates things under (in each of its directories).
const POOL: usize = 32;

/// Fixture files of L1 a worker reads through the view, relative to its `diff/`.
const FIXTURE_FILES: &[&str] = &[
    "etc/passwd",
    "etc/hostname",
    "etc/os-release",
    "usr/lib/libfake.so",
    "usr/share/doc/readme.txt",
    "bin/hello",
];

/// The operations and their weights.
const OPS: &[(&str, u32)] = &[
    ("write", 12),
    ("replace", 6),
    ("read", 12),
    ("append", 5),
    ("truncate", 3),
    ("rename", 12),
    ("unlink", 8),
    ("mkdir", 6),
    ("rmdir", 2),
    ("symlink", 6),
    ("link", 5),
    ("scandir", 5),
    ("xattr", 5),
    ("fixture", 2),
    ("scratch", 6),
    ("stat", 6),
    ("mmap", 3),
];

const XATTR: &str = "user.stress";

fn env_num(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// A short description of some content, to tell objects apart in a report: every content a
/// worker writes starts with a tag naming the worker and the write.
fn describe(data: &[u8]) -> String {
    let head: String = String::from_utf8_lossy(&data[..data.len().min(24)])
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '.' })
        .collect();
    format!(
        "{} bytes, sha256 {}…, starts {head:?}",
        data.len(),
        &sha(data)[..12]
    )
}

/// xorshift64*, seeded.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn fill(&mut self, out: &mut Vec<u8>, len: usize) {
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
    }
}

/// The content of remote file `j` of worker `worker` (the parent puts it into the remote
/// copy, the worker expects it).
fn remote_content(worker: usize, j: usize) -> Vec<u8> {
    let len = match j % 25 {
        0 => 70 * 1024,
        1..=3 => 4096,
        _ => 10 + j % 50,
    };
    let mut v = format!("<remote w{worker} r{j:03}>").into_bytes();
    v.extend(pattern(len, (worker as u64) << 32 | j as u64));
    v.truncate(len);
    v
}

fn remote_name(j: usize) -> String {
    format!("r{j:03}")
}

fn pool_name(k: usize) -> String {
    format!("n{k:02}")
}

// ---- The worker --------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Ent {
    /// A regular file: the object it links to (hard links share one).
    File(u64),
    Link(String),
    /// Always empty.
    Dir,
}

struct Obj {
    data: Vec<u8>,
    links: u32,
    xattr: Option<Vec<u8>>,
    /// Still the untouched remote file (a change would copy it up).
    remote: bool,
}

struct Area {
    dir: PathBuf,
    names: BTreeMap<String, Ent>,
    /// Names to create things under (existing or not).
    pool: Vec<String>,
}

struct Worker {
    index: usize,
    rng: Rng,
    areas: Vec<Area>,
    objs: HashMap<u64, Obj>,
    next_obj: u64,
    seq: u64,
    fixtures: Vec<(PathBuf, Vec<u8>)>,
    remote_total: usize,
    start: Instant,
    duration: Duration,
    ops: u64,
    counts: BTreeMap<&'static str, u64>,
    errors: u64,
    mismatches: u64,
    details: Vec<Value>,
    /// (op, path, got) of the failures described so far: each is described once.
    described: BTreeSet<(String, String, String)>,
    /// Failures by kind, operation and error.
    kinds: BTreeMap<String, u64>,
    /// Names whose state the model does not know since a failure (what the view showed
    /// then cannot be trusted): the final check skips them until an operation sets them.
    tainted: BTreeSet<(usize, String)>,
    backing: Option<Backing>,
}

/// The worker, a subprocess entry point and not a test: the scenarios run this binary again
/// with `--ignored --exact stress_worker`.
#[test]
#[ignore = "a subprocess entry point, run by the stress scenarios"]
fn stress_worker() {
    let Ok(dir) = std::env::var(ENV_WORKER) else {
        return;
    };
    let index = env_num(ENV_INDEX, 0) as usize;
    let seed = env_num(ENV_SEED, 1);
    let deadline_ms = env_num(ENV_DEADLINE, 0);
    let duration = Duration::from_millis(env_num(ENV_DURATION, 1000));
    let result_path = PathBuf::from(std::env::var(ENV_RESULT).expect("result path"));
    let model_path = PathBuf::from(std::env::var(ENV_MODEL).expect("model path"));
    let fixture_dir = PathBuf::from(std::env::var(ENV_FIXTURE).expect("fixture dir"));
    let remote_area = std::env::var(ENV_REMOTE_AREA).ok().map(PathBuf::from);

    let l1 = repo()
        .join("fixtures/remote/overlay/RO")
        .join(id("L1"))
        .join("diff");
    let fixtures = FIXTURE_FILES
        .iter()
        .map(|f| (fixture_dir.join(f), fs::read(l1.join(f)).expect("fixture")))
        .collect();

    let mut w = Worker {
        index,
        rng: Rng::new(seed),
        areas: Vec::new(),
        objs: HashMap::new(),
        next_obj: 1,
        seq: 0,
        fixtures,
        remote_total: 0,
        start: Instant::now(),
        duration,
        ops: 0,
        counts: BTreeMap::new(),
        errors: 0,
        mismatches: 0,
        details: Vec::new(),
        described: BTreeSet::new(),
        kinds: BTreeMap::new(),
        tainted: BTreeSet::new(),
        backing: Backing::from_env(),
    };
    w.setup(PathBuf::from(dir), remote_area);
    let deadline = Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
    if !w.areas.is_empty() {
        while Instant::now() < deadline {
            w.step();
        }
        // A last look at everything, then the model for the parent.
        for a in 0..w.areas.len() {
            w.op_scandir(a);
            let names: Vec<String> = w.areas[a].names.keys().cloned().collect();
            for name in names {
                if let Some(Ent::File(_)) = w.ent(a, &name) {
                    w.verify_file("final-read", a, &name);
                }
            }
        }
    }
    fs::write(&model_path, w.model_json().to_string()).expect("write the model");
    let result = json!({
        "worker": index,
        "ops": w.ops,
        "errors": w.errors,
        "mismatches": w.mismatches,
        "details": w.details,
        "counts": w.counts,
        "kinds": w.kinds,
    });
    fs::write(&result_path, result.to_string()).expect("write the result");
    println!("STRESS-RESULT {result}");
}

impl Worker {
    fn setup(&mut self, dir: PathBuf, remote_area: Option<PathBuf>) {
        self.count("mkdir");
        if let Err(e) = fs::create_dir(&dir) {
            self.error("mkdir-own-dir", &dir, "ok", &e);
            return;
        }
        self.areas.push(Area {
            dir,
            names: BTreeMap::new(),
            pool: (0..POOL).map(pool_name).collect(),
        });
        if let Some(dir) = remote_area {
            let mut names = BTreeMap::new();
            let mut pool: Vec<String> = (0..POOL / 2).map(pool_name).collect();
            for j in 0..REMOTE_FILES {
                let o = self.new_obj(remote_content(self.index, j));
                let obj = self.objs.get_mut(&o).unwrap();
                obj.remote = true;
                obj.links = 1;
                names.insert(remote_name(j), Ent::File(o));
                pool.push(remote_name(j));
            }
            for k in 0..REMOTE_DIRS {
                names.insert(format!("rd{k}"), Ent::Dir);
                pool.push(format!("rd{k}"));
            }
            for k in 0..REMOTE_LINKS {
                names.insert(format!("rl{k}"), Ent::Link(remote_name(k)));
                pool.push(format!("rl{k}"));
            }
            self.remote_total = REMOTE_FILES;
            self.areas.push(Area { dir, names, pool });
        }
    }

    fn step(&mut self) {
        let total: u32 = OPS.iter().map(|(_, w)| w).sum();
        let mut r = self.rng.below(total as usize) as u32;
        let mut op = OPS[0].0;
        for (name, weight) in OPS {
            if r < *weight {
                op = name;
                break;
            }
            r -= weight;
        }
        let a = self.pick_area();
        match op {
            "write" => self.op_write(a),
            "replace" => self.op_replace(a),
            "read" => self.op_read(a, false),
            "append" => self.op_append(a),
            "truncate" => self.op_truncate(a),
            "rename" => self.op_rename(a),
            "unlink" => self.op_unlink(a),
            "mkdir" => self.op_mkdir(a),
            "rmdir" => self.op_rmdir(a),
            "symlink" => self.op_symlink(a),
            "link" => self.op_link(a),
            "scandir" => self.op_scandir(a),
            "xattr" => self.op_xattr(a),
            "fixture" => self.op_fixture(),
            "scratch" => self.op_scratch(a),
            "stat" => self.op_stat(a),
            "mmap" => self.op_read(a, true),
            other => unreachable!("op {other}"),
        }
    }

    // ---- bookkeeping ----

    fn count(&mut self, op: &'static str) {
        self.ops += 1;
        *self.counts.entry(op).or_default() += 1;
    }

    fn detail(&mut self, kind: &str, op: &str, path: &Path, expected: &str, got: &str) {
        let key = (op.to_owned(), path.display().to_string(), got.to_owned());
        if self.details.len() < DETAILS && self.described.insert(key) {
            let on_disk = self
                .backing
                .as_ref()
                .map(|b| b.of(path))
                .unwrap_or_default();
            self.details.push(json!({
                "kind": kind,
                "op": op,
                "path": path.display().to_string(),
                "expected": expected,
                "got": got,
                "at_ms": self.start.elapsed().as_millis() as u64,
                "on_disk": on_disk,
            }));
        }
    }

    /// A call that should have worked failed.
    fn error(&mut self, op: &str, path: &Path, expected: &str, e: &io::Error) {
        self.errors += 1;
        *self.kinds.entry(format!("error {op}: {e}")).or_default() += 1;
        self.detail("error", op, path, expected, &e.to_string());
    }

    /// A result other than the model's.
    fn mismatch(&mut self, op: &str, path: &Path, expected: &str, got: &str) {
        self.mismatches += 1;
        *self.kinds.entry(format!("mismatch {op}")).or_default() += 1;
        self.detail("mismatch", op, path, expected, got);
    }

    fn new_obj(&mut self, data: Vec<u8>) -> u64 {
        let o = self.next_obj;
        self.next_obj += 1;
        self.objs.insert(
            o,
            Obj {
                data,
                links: 0,
                xattr: None,
                remote: false,
            },
        );
        o
    }

    fn ent(&self, a: usize, name: &str) -> Option<Ent> {
        self.areas[a].names.get(name).cloned()
    }

    fn path(&self, a: usize, name: &str) -> PathBuf {
        self.areas[a].dir.join(name)
    }

    /// Removes a name from the model (the object goes with its last link).
    fn drop_name(&mut self, a: usize, name: &str) {
        self.tainted.remove(&(a, name.to_owned()));
        if let Some(Ent::File(o)) = self.areas[a].names.remove(name) {
            let obj = self.objs.get_mut(&o).unwrap();
            obj.links -= 1;
            if obj.links == 0 {
                self.objs.remove(&o);
            }
        }
    }

    /// Puts `ent` under `name`, replacing what was there.
    fn put(&mut self, a: usize, name: &str, ent: Ent) {
        self.drop_name(a, name);
        if let Ent::File(o) = ent {
            self.objs.get_mut(&o).unwrap().links += 1;
        }
        self.areas[a].names.insert(name.to_owned(), ent);
    }

    /// After a failure: takes what the view shows for `name` as the model, so one failure
    /// is not reported again by every later operation on the name. The name stays tainted
    /// until an operation sets it again.
    fn resync(&mut self, a: usize, name: &str) {
        self.resync_model(a, name);
        self.tainted.insert((a, name.to_owned()));
    }

    fn resync_model(&mut self, a: usize, name: &str) {
        let path = self.path(a, name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_file() => {
                let data = fs::read(&path).unwrap_or_default();
                let xattr = xattr_get(&path, XATTR).ok();
                // Another name of the same file in the model (a link the model missed)?
                let mut shared = None;
                if m.nlink() > 1 {
                    'find: for (b, area) in self.areas.iter().enumerate() {
                        for (n, e) in &area.names {
                            let Ent::File(o) = e else { continue };
                            if (b, n.as_str()) != (a, name)
                                && fs::symlink_metadata(area.dir.join(n))
                                    .is_ok_and(|x| x.ino() == m.ino())
                            {
                                shared = Some(*o);
                                break 'find;
                            }
                        }
                    }
                }
                let current = match self.ent(a, name) {
                    Some(Ent::File(o)) => Some(o),
                    _ => None,
                };
                let o = match (shared, current) {
                    (Some(o), _) => o,
                    (None, Some(o)) if self.objs[&o].links == 1 => o,
                    (None, _) => self.new_obj(Vec::new()),
                };
                let obj = self.objs.get_mut(&o).unwrap();
                obj.data = data;
                obj.xattr = xattr;
                obj.remote = false;
                if current != Some(o) {
                    self.put(a, name, Ent::File(o));
                }
            }
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(&path)
                    .map(|t| t.to_string_lossy().into_owned())
                    .unwrap_or_default();
                self.put(a, name, Ent::Link(target));
            }
            Ok(m) if m.file_type().is_dir() => self.put(a, name, Ent::Dir),
            _ => self.drop_name(a, name),
        }
    }

    /// Copy-ups are spread over the run: an untouched remote file may be changed only while
    /// fewer than the elapsed share of them have been.
    fn may_touch_remote(&self) -> bool {
        if self.remote_total == 0 {
            return true;
        }
        let untouched = self.objs.values().filter(|o| o.remote).count();
        let used = (self.remote_total - untouched) as f64;
        let share = self.start.elapsed().as_secs_f64() / self.duration.as_secs_f64().max(0.001);
        used <= share * self.remote_total as f64 + 1.0
    }

    fn is_untouched_remote(&self, ent: Option<&Ent>) -> bool {
        matches!(ent, Some(Ent::File(o)) if self.objs[o].remote)
    }

    fn pick_area(&mut self) -> usize {
        if self.areas.len() > 1 && self.rng.chance(45) {
            1
        } else {
            0
        }
    }

    /// A name in area `a` whose model entry satisfies `want` (`None`: absent). `changes`:
    /// the operation changes the object (an untouched remote file must be allowed to be).
    fn pick(
        &mut self,
        a: usize,
        changes: bool,
        want: impl Fn(Option<&Ent>) -> bool,
    ) -> Option<String> {
        let touch_ok = !changes || self.may_touch_remote();
        for _ in 0..32 {
            let area = &self.areas[a];
            let existing = area.names.len();
            let name = if existing > 0 && self.rng.next() % 2 == 0 {
                let i = self.rng.below(existing);
                self.areas[a].names.keys().nth(i).unwrap().clone()
            } else {
                let i = self.rng.below(area.pool.len());
                self.areas[a].pool[i].clone()
            };
            let ent = self.areas[a].names.get(&name);
            if !want(ent) {
                continue;
            }
            if changes && !touch_ok && self.is_untouched_remote(ent) {
                continue;
            }
            return Some(name);
        }
        None
    }

    fn is_file(e: Option<&Ent>) -> bool {
        matches!(e, Some(Ent::File(_)))
    }

    fn content(&mut self, len: usize) -> Vec<u8> {
        self.seq += 1;
        let mut v = format!("<w{} #{}>", self.index, self.seq).into_bytes();
        self.rng.fill(&mut v, len);
        v
    }

    fn random_size(&mut self) -> usize {
        match self.rng.below(100) {
            0..=49 => 10,
            50..=84 => 4096,
            _ => 70 * 1024,
        }
    }

    /// Reads `name` back (a file in the model) and compares it with the model.
    fn verify_file(&mut self, op: &str, a: usize, name: &str) -> bool {
        let Some(Ent::File(o)) = self.ent(a, name) else {
            return true;
        };
        let path = self.path(a, name);
        match fs::read(&path) {
            Err(e) => {
                self.error(op, &path, "the file reads", &e);
                self.resync(a, name);
                false
            }
            Ok(got) if got != self.objs[&o].data => {
                let expected = describe(&self.objs[&o].data);
                self.mismatch(op, &path, &expected, &describe(&got));
                self.resync(a, name);
                false
            }
            Ok(_) => true,
        }
    }

    /// `name` must be gone.
    fn verify_absent(&mut self, op: &str, a: usize, name: &str) {
        let path = self.path(a, name);
        match fs::symlink_metadata(&path) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => self.error(op, &path, "ENOENT", &e),
            Ok(m) => {
                self.mismatch(op, &path, "ENOENT", &format!("exists: {:?}", m.file_type()));
                self.resync(a, name);
            }
        }
    }

    /// `lstat` of `name` agrees with the model (kind; size and link count of files; size of
    /// symlinks).
    fn verify_stat(&mut self, op: &str, a: usize, name: &str) {
        let Some(ent) = self.ent(a, name) else {
            return self.verify_absent(op, a, name);
        };
        let path = self.path(a, name);
        let m = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                self.error(op, &path, &format!("{ent:?}"), &e);
                return self.resync(a, name);
            }
        };
        let ft = m.file_type();
        let wrong = match &ent {
            Ent::File(o) => {
                let obj = &self.objs[o];
                (!ft.is_file() || m.len() != obj.data.len() as u64 || m.nlink() != obj.links as u64)
                    .then(|| format!("file of {} bytes, {} links", obj.data.len(), obj.links))
            }
            Ent::Link(t) => {
                (!ft.is_symlink() || m.len() != t.len() as u64).then(|| format!("symlink to {t:?}"))
            }
            Ent::Dir => (!ft.is_dir()).then(|| "directory".to_owned()),
        };
        if let Some(expected) = wrong {
            let got = format!(
                "{ft:?} size {} nlink {} ino {}",
                m.len(),
                m.nlink(),
                m.ino()
            );
            self.mismatch(op, &path, &expected, &got);
            self.resync(a, name);
        }
    }

    fn verify_link(&mut self, op: &str, a: usize, name: &str) {
        let Some(Ent::Link(target)) = self.ent(a, name) else {
            return;
        };
        let path = self.path(a, name);
        match fs::read_link(&path) {
            Err(e) => {
                self.error(op, &path, &format!("readlink {target:?}"), &e);
                self.resync(a, name);
            }
            Ok(t) if t.as_os_str() != target.as_str() => {
                self.mismatch(op, &path, &target, &t.to_string_lossy());
                self.resync(a, name);
            }
            Ok(_) => {}
        }
    }

    // ---- operations ----

    /// Write a file in place (`O_CREAT|O_TRUNC`): a new file, or every link of an old one.
    fn op_write(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| e.is_none() || Self::is_file(e)) else {
            return;
        };
        self.count("write");
        let path = self.path(a, &name);
        let len = self.random_size();
        let data = self.content(len);
        let r = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)
            .and_then(|mut f| f.write_all(&data));
        if let Err(e) = r {
            self.error("write", &path, "ok", &e);
            return self.resync(a, &name);
        }
        match self.ent(a, &name) {
            Some(Ent::File(o)) => {
                let obj = self.objs.get_mut(&o).unwrap();
                obj.data = data;
                obj.remote = false;
            }
            _ => {
                let o = self.new_obj(data);
                self.put(a, &name, Ent::File(o));
            }
        }
        self.verify_file("write/read-back", a, &name);
    }

    /// Write a temporary file and rename it over a name (file, symlink or nothing).
    fn op_replace(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| !matches!(e, Some(Ent::Dir))) else {
            return;
        };
        self.count("replace");
        self.seq += 1;
        let tmp = format!(".tmp{}", self.seq);
        let (tmp_path, path) = (self.path(a, &tmp), self.path(a, &name));
        let len = self.random_size();
        let data = self.content(len);
        if let Err(e) = fs::write(&tmp_path, &data) {
            self.error("replace/write-temp", &tmp_path, "ok", &e);
            let _ = fs::remove_file(&tmp_path);
            return;
        }
        if let Err(e) = fs::rename(&tmp_path, &path) {
            self.error("replace/rename", &path, "ok", &e);
            let _ = fs::remove_file(&tmp_path);
            return self.resync(a, &name);
        }
        let o = self.new_obj(data);
        self.put(a, &name, Ent::File(o));
        self.verify_file("replace/read-back", a, &name);
        self.verify_absent("replace/temp-gone", a, &tmp);
    }

    /// Read a file back whole, a range of it, or through `mmap`; a symlink: readlink.
    fn op_read(&mut self, a: usize, mmap: bool) {
        let Some(name) = self.pick(a, false, |e| {
            Self::is_file(e) || (!mmap && matches!(e, Some(Ent::Link(_))))
        }) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            self.count("readlink");
            return self.verify_link("readlink", a, &name);
        };
        let path = self.path(a, &name);
        if mmap {
            self.count("mmap");
            let expected = &self.objs[&o].data;
            match mmap_read(&path) {
                Err(e) => {
                    self.error("mmap", &path, "ok", &e);
                    self.resync(a, &name);
                }
                Ok(got) if &got != expected => {
                    let expected = describe(expected);
                    self.mismatch("mmap", &path, &expected, &describe(&got));
                    self.resync(a, &name);
                }
                Ok(_) => {}
            }
        } else if self.rng.chance(25) && !self.objs[&o].data.is_empty() {
            self.count("pread");
            let len = self.objs[&o].data.len();
            let off = self.rng.below(len);
            let n = 1 + self.rng.below(len - off);
            let mut buf = vec![0u8; n];
            let r = fs::File::open(&path).and_then(|f| f.read_exact_at(&mut buf, off as u64));
            let expected = &self.objs[&o].data[off..off + n];
            match r {
                Err(e) => {
                    self.error("pread", &path, &format!("{n} bytes at {off}"), &e);
                    self.resync(a, &name);
                }
                Ok(()) if buf != expected => {
                    let expected = format!("at {off}: {}", describe(expected));
                    self.mismatch("pread", &path, &expected, &describe(&buf));
                    self.resync(a, &name);
                }
                Ok(()) => {}
            }
        } else {
            self.count("read");
            self.verify_file("read", a, &name);
        }
    }

    fn op_append(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        self.count("append");
        let path = self.path(a, &name);
        let len = 1 + self.rng.below(5000);
        let extra = self.content(len);
        let r = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(&extra));
        if let Err(e) = r {
            self.error("append", &path, "ok", &e);
            return self.resync(a, &name);
        }
        let obj = self.objs.get_mut(&o).unwrap();
        obj.data.extend_from_slice(&extra);
        obj.remote = false;
        self.verify_file("append/read-back", a, &name);
    }

    fn op_truncate(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        self.count("truncate");
        let path = self.path(a, &name);
        let len = self.rng.below(self.objs[&o].data.len() + 5000);
        let r = if self.rng.chance(50) {
            fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(len as u64))
        } else {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            if unsafe { libc::truncate(c.as_ptr(), len as libc::off_t) } == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        if let Err(e) = r {
            self.error("truncate", &path, &format!("length {len}"), &e);
            return self.resync(a, &name);
        }
        let obj = self.objs.get_mut(&o).unwrap();
        obj.data.resize(len, 0);
        obj.remote = false;
        self.verify_stat("truncate/stat", a, &name);
        self.verify_file("truncate/read-back", a, &name);
    }

    /// Rename a file or symlink over another name (of either kind, or none), possibly into
    /// the other directory; or (in the new directory only) a directory over nothing or an
    /// empty directory.
    fn op_rename(&mut self, a: usize) {
        let dirs = a == 0 && self.rng.chance(15);
        let Some(src) = self.pick(a, true, |e| match e {
            Some(Ent::Dir) => dirs,
            Some(_) => !dirs,
            None => false,
        }) else {
            return;
        };
        let b = if dirs { a } else { self.pick_area() };
        let Some(dst) = self.pick(b, true, |e| match e {
            Some(Ent::Dir) | None => dirs || e.is_none(),
            Some(_) => !dirs,
        }) else {
            return;
        };
        if a == b && src == dst {
            return;
        }
        self.count("rename");
        let (from, to) = (self.path(a, &src), self.path(b, &dst));
        if let Err(e) = fs::rename(&from, &to) {
            self.error("rename", &from, &format!("renamed to {}", to.display()), &e);
            self.resync(a, &src);
            return self.resync(b, &dst);
        }
        let s = self.ent(a, &src).unwrap();
        let same = matches!((&s, self.ent(b, &dst)), (Ent::File(x), Some(Ent::File(y))) if *x == y);
        if same {
            // Two links of one file: rename does nothing.
            self.verify_file("rename/same-file-src", a, &src);
            self.verify_file("rename/same-file-dst", b, &dst);
            return;
        }
        self.put(b, &dst, s);
        self.drop_name(a, &src);
        self.verify_absent("rename/source-gone", a, &src);
        self.verify_stat("rename/stat", b, &dst);
        self.verify_file("rename/read-back", b, &dst);
        self.verify_link("rename/readlink", b, &dst);
    }

    fn op_unlink(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| matches!(e, Some(Ent::File(_) | Ent::Link(_))))
        else {
            return;
        };
        self.count("unlink");
        let path = self.path(a, &name);
        if let Err(e) = fs::remove_file(&path) {
            self.error("unlink", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.drop_name(a, &name);
        self.verify_absent("unlink/gone", a, &name);
    }

    /// mkdir, then (mostly) rmdir at once.
    fn op_mkdir(&mut self, a: usize) {
        let Some(name) = self.pick(a, false, |e| e.is_none()) else {
            return;
        };
        self.count("mkdir");
        let path = self.path(a, &name);
        if let Err(e) = fs::create_dir(&path) {
            self.error("mkdir", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.put(a, &name, Ent::Dir);
        self.verify_stat("mkdir/stat", a, &name);
        if self.rng.chance(60) {
            self.rmdir(a, &name);
        }
    }

    fn op_rmdir(&mut self, a: usize) {
        if let Some(name) = self.pick(a, false, |e| matches!(e, Some(Ent::Dir))) {
            self.rmdir(a, &name);
        }
    }

    fn rmdir(&mut self, a: usize, name: &str) {
        self.count("rmdir");
        let path = self.path(a, name);
        if let Err(e) = fs::remove_dir(&path) {
            self.error("rmdir", &path, "ok", &e);
            return self.resync(a, name);
        }
        self.drop_name(a, name);
        self.verify_absent("rmdir/gone", a, name);
    }

    /// Unlink a name if it is there, make it a symlink, read the link back.
    fn op_symlink(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| !matches!(e, Some(Ent::Dir))) else {
            return;
        };
        self.count("symlink");
        let path = self.path(a, &name);
        if self.ent(a, &name).is_some() {
            if let Err(e) = fs::remove_file(&path) {
                self.error("symlink/unlink", &path, "ok", &e);
                return self.resync(a, &name);
            }
            self.drop_name(a, &name);
        }
        self.seq += 1;
        let len = 1 + self.rng.below(60);
        let mut target = format!("target-w{}-{}-", self.index, self.seq);
        while target.len() < len + 16 {
            target.push((b'a' + self.rng.below(26) as u8) as char);
        }
        if let Err(e) = std::os::unix::fs::symlink(&target, &path) {
            self.error("symlink", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.put(a, &name, Ent::Link(target));
        self.verify_link("symlink/readlink", a, &name);
        if self.rng.chance(30) {
            self.verify_stat("symlink/stat", a, &name);
        }
    }

    /// A hard link of a file under a new name (maybe in the other directory): both names
    /// read the same, `lstat` shows one inode with the model's link count.
    fn op_link(&mut self, a: usize) {
        let Some(src) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let b = self.pick_area();
        let Some(dst) = self.pick(b, false, |e| e.is_none()) else {
            return;
        };
        self.count("link");
        let (from, to) = (self.path(a, &src), self.path(b, &dst));
        if let Err(e) = fs::hard_link(&from, &to) {
            self.error("link", &to, &format!("a link of {}", from.display()), &e);
            self.resync(a, &src);
            return self.resync(b, &dst);
        }
        let s = self.ent(a, &src).unwrap();
        if let Ent::File(o) = s {
            self.objs.get_mut(&o).unwrap().remote = false;
        }
        self.put(b, &dst, s);
        self.verify_file("link/read-new", b, &dst);
        self.verify_file("link/read-old", a, &src);
        match (fs::symlink_metadata(&from), fs::symlink_metadata(&to)) {
            (Ok(x), Ok(y)) => {
                let links = match self.ent(b, &dst) {
                    Some(Ent::File(o)) => self.objs[&o].links as u64,
                    _ => 0,
                };
                if x.ino() != y.ino() || y.nlink() != links || x.nlink() != links {
                    let got = format!(
                        "ino {} nlink {} / ino {} nlink {}",
                        x.ino(),
                        x.nlink(),
                        y.ino(),
                        y.nlink()
                    );
                    self.mismatch("link/stat", &to, &format!("one inode, {links} links"), &got);
                    self.resync(a, &src);
                    self.resync(b, &dst);
                }
            }
            (Err(e), _) => self.error("link/stat-old", &from, "ok", &e),
            (_, Err(e)) => self.error("link/stat-new", &to, "ok", &e),
        }
    }

    /// List a directory: exactly the model's names, each of which `lstat`s fine, with the
    /// model's kind (in `d_type` and in `lstat`).
    fn op_scandir(&mut self, a: usize) {
        self.count("scandir");
        let dir = self.areas[a].dir.clone();
        let entries = match fs::read_dir(&dir).and_then(|it| it.collect::<io::Result<Vec<_>>>()) {
            Ok(v) => v,
            Err(e) => return self.error("scandir", &dir, "a listing", &e),
        };
        let mut listed = BTreeSet::new();
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            listed.insert(name.clone());
            let dtype = e.file_type().ok();
            match fs::symlink_metadata(&path) {
                Err(err) => {
                    self.error("scandir/lstat", &path, "a listed name lstats", &err);
                    self.resync(a, &name);
                    continue;
                }
                Ok(m) => {
                    let ft = m.file_type();
                    let kind = kind_of(&ft);
                    let want = match self.ent(a, &name) {
                        Some(Ent::File(_)) => "file",
                        Some(Ent::Link(_)) => "symlink",
                        Some(Ent::Dir) => "dir",
                        None => "absent",
                    };
                    let dkind = dtype.as_ref().map(kind_of).unwrap_or("?");
                    if kind != want || dkind != want {
                        let got = format!("lstat {kind}, d_type {dkind}");
                        self.mismatch("scandir/kind", &path, want, &got);
                        self.resync(a, &name);
                    }
                }
            }
        }
        let model: BTreeSet<String> = self.areas[a].names.keys().cloned().collect();
        let missing: Vec<String> = model.difference(&listed).cloned().collect();
        for name in missing {
            let path = self.path(a, &name);
            self.mismatch("scandir/missing", &path, "listed", "not listed");
            self.resync(a, &name);
        }
    }

    fn op_xattr(&mut self, a: usize) {
        let set = self.rng.chance(50);
        let Some(name) = self.pick(a, set, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        let path = self.path(a, &name);
        if set {
            self.count("setxattr");
            let len = 1 + self.rng.below(64);
            let value = self.content(len);
            if let Err(e) = xattr_set(&path, XATTR, &value) {
                self.error("setxattr", &path, "ok", &e);
                return self.resync(a, &name);
            }
            let obj = self.objs.get_mut(&o).unwrap();
            obj.xattr = Some(value);
            obj.remote = false;
        }
        self.count("getxattr");
        let expected = self.objs[&o].xattr.clone();
        match (xattr_get(&path, XATTR), expected) {
            (Ok(got), Some(want)) if got == want => {}
            (Err(e), None) if e.raw_os_error() == Some(libc::ENODATA) => {}
            (Err(e), want) => {
                let want = want.map_or("ENODATA".to_owned(), |w| hex(&w));
                self.error("getxattr", &path, &want, &e);
                self.resync(a, &name);
            }
            (Ok(got), want) => {
                let want = want.map_or("ENODATA".to_owned(), |w| hex(&w));
                self.mismatch("getxattr", &path, &want, &hex(&got));
                self.resync(a, &name);
            }
        }
    }

    /// Read one of L1's fixture files through the view.
    fn op_fixture(&mut self) {
        self.count("fixture");
        let i = self.rng.below(self.fixtures.len());
        let (path, want) = &self.fixtures[i];
        let (path, want) = (path.clone(), describe(want));
        match fs::read(&path) {
            Err(e) => self.error("fixture", &path, &want, &e),
            Ok(got) if describe(&got) != want => {
                self.mismatch("fixture", &path, &want, &describe(&got))
            }
            Ok(_) => {}
        }
    }

    /// Create a file, write it, unlink it while open, then read it through the open fd.
    fn op_scratch(&mut self, a: usize) {
        self.count("scratch");
        self.seq += 1;
        let name = format!(".scratch{}", self.seq);
        let path = self.path(a, &name);
        let len = self.random_size();
        let data = self.content(len);
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path);
        let mut f = match f {
            Ok(f) => f,
            Err(e) => return self.error("scratch/create", &path, "ok", &e),
        };
        if let Err(e) = f.write_all(&data) {
            self.error("scratch/write", &path, "ok", &e);
        }
        if let Err(e) = fs::remove_file(&path) {
            self.error("scratch/unlink", &path, "ok", &e);
            return;
        }
        self.verify_absent("scratch/gone", a, &name);
        let mut got = vec![0u8; data.len()];
        match f.read_exact_at(&mut got, 0) {
            Err(e) => self.error("scratch/read-unlinked", &path, "ok", &e),
            Ok(()) if got != data => self.mismatch(
                "scratch/read-unlinked",
                &path,
                &describe(&data),
                &describe(&got),
            ),
            Ok(()) => {}
        }
    }

    fn op_stat(&mut self, a: usize) {
        let Some(name) = self.pick(a, false, |e| e.is_some()) else {
            return;
        };
        self.count("stat");
        self.verify_stat("stat", a, &name);
    }

    // ---- the final model ----

    fn model_json(&self) -> Value {
        let areas: Vec<Value> = self
            .areas
            .iter()
            .enumerate()
            .map(|(a, area)| {
                let mut entries: serde_json::Map<String, Value> = area
                    .names
                    .iter()
                    .map(|(name, ent)| {
                        let v = match ent {
                            Ent::File(o) => {
                                let obj = &self.objs[o];
                                json!({
                                    "kind": "file",
                                    "obj": o,
                                    "links": obj.links,
                                    "len": obj.data.len(),
                                    "sha256": sha(&obj.data),
                                    "xattr": obj.xattr.as_deref().map(hex),
                                })
                            }
                            Ent::Link(t) => json!({"kind": "symlink", "target": t}),
                            Ent::Dir => json!({"kind": "dir"}),
                        };
                        (name.clone(), v)
                    })
                    .collect();
                for (_, name) in self.tainted.iter().filter(|(b, _)| *b == a) {
                    entries.insert(name.clone(), json!({"kind": "unknown"}));
                }
                json!({"dir": area.dir.display().to_string(), "entries": entries})
            })
            .collect();
        json!({ "areas": areas })
    }
}

fn kind_of(ft: &fs::FileType) -> &'static str {
    if ft.is_file() {
        "file"
    } else if ft.is_dir() {
        "dir"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_char_device() {
        "chardev"
    } else {
        "other"
    }
}

/// Reopens `path` and reads it whole through a shared read-only mapping.
fn mmap_read(path: &Path) -> io::Result<Vec<u8>> {
    let f = fs::File::open(path)?;
    let len = f.metadata()?.len() as usize;
    if len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: a fresh read-only mapping of `len` bytes of an open file, copied out and
    // unmapped before returning; nobody else writes this file meanwhile.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let data = std::slice::from_raw_parts(p as *const u8, len).to_vec();
        libc::munmap(p, len);
        Ok(data)
    }
}

// ---- The parent -------------------------------------------------------------------------

/// The scenarios run one at a time (each already loads the machine fully).
static SERIAL: Mutex<()> = Mutex::new(());

/// The running workers; any still running when this is dropped (the parent panicked) are
/// killed and reaped.
struct Workers(Vec<(usize, Child)>);

impl Drop for Workers {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn options() -> Options {
    Options {
        opts: std::env::var("LAYERFS_STRESS_OPTS").unwrap_or_default(),
        ..Options::default()
    }
}

/// The shared scenario's remote directory of worker `i`, relative to a layer's `diff/`.
fn remote_area_rel(i: usize) -> String {
    format!("stress-remote/w{i}")
}

/// Puts every worker's remote directory into L1's diff in the remote copy.
fn prepare_remote(remote: &Path, procs: usize) {
    fill_remote_areas(
        &remote.join("overlay/RO").join(id("L1")).join("diff"),
        procs,
    );
}

/// Every worker's remote directory under `diff`.
fn fill_remote_areas(diff: &Path, procs: usize) {
    for i in 0..procs {
        let dir = diff.join(remote_area_rel(i));
        fs::create_dir_all(&dir).unwrap();
        for j in 0..REMOTE_FILES {
            fs::write(dir.join(remote_name(j)), remote_content(i, j)).unwrap();
        }
        for k in 0..REMOTE_DIRS {
            fs::create_dir(dir.join(format!("rd{k}"))).unwrap();
        }
        for k in 0..REMOTE_LINKS {
            std::os::unix::fs::symlink(remote_name(k), dir.join(format!("rl{k}"))).unwrap();
        }
    }
}

struct Outcome {
    ops: u64,
    errors: u64,
    mismatches: u64,
    details: Vec<String>,
}

fn run_scenario(name: &str, shared: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let procs = env_num("LAYERFS_STRESS_PROCS", DEFAULT_PROCS as u64) as usize;
    let secs = env_num("LAYERFS_STRESS_SECS", DEFAULT_SECS);
    let seed = env_num("LAYERFS_STRESS_SEED", now_ms());
    let options = options();
    let plain = std::env::var_os("LAYERFS_STRESS_PLAIN").is_some();
    println!(
        "stress {name}: {procs} workers for {secs} s, seed {seed}, options {:?}{}",
        options.opts,
        if plain {
            ", in plain directories (not the view)"
        } else {
            ""
        }
    );
    let mut m = Mount::with(options.clone(), |remote| {
        if shared {
            prepare_remote(remote, procs)
        }
    });
    let out = m.dir.path().join("stress-out");
    fs::create_dir(&out).unwrap();
    let exe = std::env::current_exe().expect("the test binary");
    let duration_ms = secs * 1000;
    let deadline_ms = now_ms() + duration_ms;
    let kill_at = Instant::now() + Duration::from_millis(duration_ms) + GRACE;

    // Where the workers work: the view, or (to check the test itself) plain directories.
    let (root, diff, fixture) = if plain {
        let p = m.dir.path().join("plain");
        fs::create_dir_all(p.join("root")).unwrap();
        fs::create_dir_all(p.join("diff")).unwrap();
        if shared {
            fill_remote_areas(&p.join("diff"), procs);
        }
        let fixture = repo()
            .join("fixtures/remote/overlay/RO")
            .join(id("L1"))
            .join("diff");
        (p.join("root"), p.join("diff"), fixture)
    } else {
        (m.mnt.clone(), m.diff("L1"), m.diff("L1"))
    };

    let backing = (!plain).then(|| Backing::of_mount(&m));
    let mut workers = Workers(Vec::new());
    for i in 0..procs {
        let own = if shared {
            diff.join(format!("stress-w{i}"))
        } else {
            root.join(format!("stress-w{i}"))
        };
        let log = fs::File::create(out.join(format!("w{i}.log"))).unwrap();
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--ignored",
            "--exact",
            "stress_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_WORKER, &own)
        .env(ENV_INDEX, i.to_string())
        .env(
            ENV_SEED,
            (seed ^ (i as u64 + 1).wrapping_mul(0x1000_0000_01b3)).to_string(),
        )
        .env(ENV_DEADLINE, deadline_ms.to_string())
        .env(ENV_DURATION, duration_ms.to_string())
        .env(ENV_RESULT, out.join(format!("w{i}.result.json")))
        .env(ENV_MODEL, out.join(format!("w{i}.model.json")))
        .env(ENV_FIXTURE, &fixture)
        .env_remove(ENV_MNT)
        .env_remove(ENV_LOCAL)
        .env_remove(ENV_REMOTE)
        .env_remove(ENV_REMOTE_AREA)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
        if shared {
            cmd.env(ENV_REMOTE_AREA, diff.join(remote_area_rel(i)));
        }
        if !plain {
            cmd.env(ENV_MNT, &m.mnt)
                .env(ENV_LOCAL, &m.local)
                .env(ENV_REMOTE, &m.remote);
        }
        workers.0.push((i, cmd.spawn().expect("spawn a worker")));
    }

    // Wait for all, killing any that overstay.
    let mut failures: Vec<String> = Vec::new();
    let mut running: Vec<usize> = (0..procs).collect();
    while !running.is_empty() {
        running.retain(|&k| {
            let (i, child) = &mut workers.0[k];
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        failures.push(format!("worker {i} exited with {status}"));
                    }
                    false
                }
                Ok(None) if Instant::now() > kill_at => {
                    let _ = child.kill();
                    let _ = child.wait();
                    failures.push(format!(
                        "worker {i} still running {} s after its deadline: killed",
                        GRACE.as_secs()
                    ));
                    false
                }
                Ok(None) => true,
                Err(e) => {
                    failures.push(format!("worker {i}: wait failed: {e}"));
                    false
                }
            }
        });
        std::thread::sleep(Duration::from_millis(100));
    }

    // Collect the results.
    let mut total = Outcome {
        ops: 0,
        errors: 0,
        mismatches: 0,
        details: Vec::new(),
    };
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    let mut models = Vec::new();
    for i in 0..procs {
        let result = fs::read_to_string(out.join(format!("w{i}.result.json")))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok());
        let Some(r) = result else {
            let log = fs::read_to_string(out.join(format!("w{i}.log"))).unwrap_or_default();
            let tail: String = log
                .chars()
                .rev()
                .take(2000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            failures.push(format!(
                "worker {i} left no result; its output ends:\n{tail}"
            ));
            continue;
        };
        let (ops, errors, mismatches) = (
            r["ops"].as_u64().unwrap_or(0),
            r["errors"].as_u64().unwrap_or(0),
            r["mismatches"].as_u64().unwrap_or(0),
        );
        println!("  worker {i:2}: {ops:7} ops, {errors} errors, {mismatches} mismatches");
        total.ops += ops;
        total.errors += errors;
        total.mismatches += mismatches;
        for (into, key) in [(&mut counts, "counts"), (&mut kinds, "kinds")] {
            for (k, n) in r[key].as_object().into_iter().flatten() {
                *into.entry(k.clone()).or_default() += n.as_u64().unwrap_or(0);
            }
        }
        for d in r["details"].as_array().into_iter().flatten() {
            let line = format!(
                "w{i} +{}ms {} {} {}: expected {}, got {}{}",
                d["at_ms"],
                d["kind"].as_str().unwrap_or("?"),
                d["op"].as_str().unwrap_or("?"),
                d["path"].as_str().unwrap_or("?"),
                d["expected"].as_str().unwrap_or("?"),
                d["got"].as_str().unwrap_or("?"),
                d["on_disk"].as_str().unwrap_or(""),
            );
            println!("    {line}");
            total.details.push(line);
        }
        match fs::read_to_string(out.join(format!("w{i}.model.json")))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            Some(model) => models.push(model),
            None => failures.push(format!("worker {i} left no model")),
        }
    }
    println!(
        "stress {name}: {} operations in {secs} s ({:.0}/s), {} errors, {} mismatches",
        total.ops,
        total.ops as f64 / secs.max(1) as f64,
        total.errors,
        total.mismatches
    );
    let per_op: Vec<String> = counts.iter().map(|(op, n)| format!("{op} {n}")).collect();
    println!("  per operation: {}", per_op.join(", "));
    if !kinds.is_empty() {
        let mut by_count: Vec<(&String, &u64)> = kinds.iter().collect();
        by_count.sort_by(|x, y| y.1.cmp(x.1).then(x.0.cmp(y.0)));
        println!("  failures by kind:");
        for (kind, n) in by_count {
            println!("    {n:6}  {kind}");
        }
    }

    // The final state, through the view: as left, without the kernel's caches, and after
    // a remount.
    let mut final_failures = Vec::new();
    for stage in ["as left", "after drop_caches", "after remount"] {
        match stage {
            "after drop_caches" => drop_caches(),
            "after remount" => m.remount(&options),
            _ => {}
        }
        let before = final_failures.len();
        for model in &models {
            verify_model(model, stage, backing.as_ref(), &mut final_failures);
        }
        println!(
            "  final state {stage}: {} failures",
            final_failures.len() - before
        );
    }
    for f in final_failures.iter().take(DETAILS) {
        println!("    {f}");
    }
    drop(workers);

    let summary = format!(
        "{name}: {} errors, {} mismatches in {} operations; {} worker failures; \
         {} failures in the final state",
        total.errors,
        total.mismatches,
        total.ops,
        failures.len(),
        final_failures.len()
    );
    let mut report: Vec<String> = failures.clone();
    report.extend(total.details.iter().take(DETAILS).cloned());
    report.extend(final_failures.iter().take(DETAILS).cloned());
    assert!(
        total.errors == 0
            && total.mismatches == 0
            && failures.is_empty()
            && final_failures.is_empty()
            && total.ops > 0,
        "{summary}\n{}",
        report.join("\n")
    );
}

/// Compares one worker's final model with what the view shows.
fn verify_model(model: &Value, stage: &str, backing: Option<&Backing>, out: &mut Vec<String>) {
    let mut fail = |path: &Path, what: String| {
        let on_disk = backing.map(|b| b.of(path)).unwrap_or_default();
        out.push(format!("{stage}: {}: {what}{on_disk}", path.display()));
    };
    // One inode per object, across both directories.
    let mut inos: HashMap<u64, (u64, String)> = HashMap::new();
    for area in model["areas"].as_array().into_iter().flatten() {
        let dir = PathBuf::from(area["dir"].as_str().unwrap());
        let entries = area["entries"].as_object().unwrap();
        let unknown = |n: &str| entries.get(n).is_some_and(|e| e["kind"] == "unknown");
        let want: BTreeSet<&str> = entries
            .keys()
            .map(|k| k.as_str())
            .filter(|k| !unknown(k))
            .collect();
        let listed = match fs::read_dir(&dir).and_then(|it| it.collect::<io::Result<Vec<_>>>()) {
            Ok(v) => v,
            Err(e) => {
                fail(&dir, format!("cannot list: {e}"));
                continue;
            }
        };
        let listed: BTreeSet<String> = listed
            .iter()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let listed_ref: BTreeSet<&str> = listed
            .iter()
            .map(|s| s.as_str())
            .filter(|k| !unknown(k))
            .collect();
        for n in want.difference(&listed_ref) {
            fail(&dir.join(n), "in the model, not listed".to_owned());
        }
        for n in listed_ref.difference(&want) {
            let path = dir.join(n);
            let lstat = match fs::symlink_metadata(&path) {
                Ok(m) => kind_of(&m.file_type()).to_owned(),
                Err(e) => e.to_string(),
            };
            fail(&path, format!("listed, not in the model (lstat: {lstat})"));
        }
        for (name, e) in entries.iter().filter(|(n, _)| !unknown(n)) {
            let path = dir.join(name);
            let m = match fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(err) => {
                    fail(&path, format!("lstat: {err}"));
                    continue;
                }
            };
            let kind = kind_of(&m.file_type());
            let want_kind = e["kind"].as_str().unwrap();
            if kind != want_kind {
                fail(&path, format!("a {kind}, not a {want_kind}"));
                continue;
            }
            match want_kind {
                "file" => {
                    match fs::read(&path) {
                        Ok(data) if sha(&data) == e["sha256"].as_str().unwrap() => {}
                        Ok(data) => fail(
                            &path,
                            format!(
                                "holds {}, not {} bytes sha256 {}…",
                                describe(&data),
                                e["len"],
                                &e["sha256"].as_str().unwrap()[..12]
                            ),
                        ),
                        Err(err) => fail(&path, format!("read: {err}")),
                    }
                    let want_x = e["xattr"].as_str();
                    match (xattr_get(&path, XATTR), want_x) {
                        (Ok(v), Some(w)) if hex(&v) == w => {}
                        (Err(err), None) if err.raw_os_error() == Some(libc::ENODATA) => {}
                        (got, w) => fail(
                            &path,
                            format!(
                                "xattr {XATTR}: expected {}, got {:?}",
                                w.unwrap_or("ENODATA"),
                                got.map(|v| hex(&v))
                            ),
                        ),
                    }
                    let links = e["links"].as_u64().unwrap();
                    if m.nlink() != links {
                        fail(&path, format!("{} links, not {links}", m.nlink()));
                    }
                    let obj = e["obj"].as_u64().unwrap();
                    match inos.get(&obj) {
                        Some((ino, other)) if *ino != m.ino() => fail(
                            &path,
                            format!("ino {}, its hard link {other} ino {ino}", m.ino()),
                        ),
                        Some(_) => {}
                        None => {
                            inos.insert(obj, (m.ino(), path.display().to_string()));
                        }
                    }
                }
                "symlink" => match fs::read_link(&path) {
                    Ok(t) if t.as_os_str() == e["target"].as_str().unwrap() => {}
                    got => fail(
                        &path,
                        format!("readlink: expected {}, got {got:?}", e["target"]),
                    ),
                },
                _ => {}
            }
        }
    }
}

/// Where a view path is on disk, to describe it in a report.
struct Backing {
    mnt: PathBuf,
    local: PathBuf,
    remote: PathBuf,
}

impl Backing {
    fn from_env() -> Option<Backing> {
        let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
        Some(Backing {
            mnt: var(ENV_MNT)?,
            local: var(ENV_LOCAL)?,
            remote: var(ENV_REMOTE)?,
        })
    }

    fn of_mount(m: &Mount) -> Backing {
        Backing {
            mnt: m.mnt.clone(),
            local: m.local.clone(),
            remote: m.remote.clone(),
        }
    }

    /// ` [local: …; remote: …]` for a path in the view.
    fn of(&self, path: &Path) -> String {
        let Ok(rel) = path.strip_prefix(&self.mnt) else {
            return String::new();
        };
        format!(
            " [local: {}; remote: {}]",
            on_disk(&self.local.join(rel)),
            on_disk(&self.remote.join(rel))
        )
    }
}

fn on_disk(path: &Path) -> String {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => "absent".to_owned(),
        Err(e) => e.to_string(),
        Ok(_) if is_whiteout(path) => "whiteout".to_owned(),
        Ok(m) if m.file_type().is_file() => format!(
            "file ino {} nlink {}, {}",
            m.ino(),
            m.nlink(),
            fs::read(path).map_or_else(|e| e.to_string(), |d| describe(&d))
        ),
        Ok(m) if m.file_type().is_symlink() => format!(
            "symlink ino {} to {:?}",
            m.ino(),
            fs::read_link(path).unwrap_or_default()
        ),
        Ok(m) => format!("{} ino {}", kind_of(&m.file_type()), m.ino()),
    }
}

#[test]
fn local_only_area() {
    run_scenario("local_only_area", false);
}

#[test]
fn shared_area_with_copy_ups() {
    run_scenario("shared_area_with_copy_ups", true);
}
