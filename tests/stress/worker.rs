//! One worker: this test binary run again as a process of its own, alone in its
//! directories, drawing operations by weight from a seeded generator until its deadline.
//! Its counts, its first failures and its model go to files outside the mount for the
//! parent. Content it writes starts with a tag naming the worker and the write, so that a
//! report can tell whose bytes a file holds.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{id, repo};
use crate::model::{pool_name, Area, Ent, Obj, POOL};
use crate::protocol::{
    env_num, now_ms, remote_content, remote_name, DETAILS, ENV_DEADLINE, ENV_DURATION, ENV_FIXTURE,
    ENV_INDEX, ENV_MODEL, ENV_REMOTE_AREA, ENV_RESULT, ENV_SEED, ENV_WORKER, REMOTE_DIRS,
    REMOTE_FILES, REMOTE_LINKS,
};
use crate::verify::Backing;

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

/// xorshift64*, seeded.
pub struct Rng(u64);

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

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn fill(&mut self, out: &mut Vec<u8>, len: usize) {
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
    }
}

/// A worker's state: its model, its generator, and what it has counted and seen go wrong.
pub struct Worker {
    pub index: usize,
    pub rng: Rng,
    pub areas: Vec<Area>,
    pub objs: HashMap<u64, Obj>,
    pub next_obj: u64,
    pub seq: u64,
    pub fixtures: Vec<(PathBuf, Vec<u8>)>,
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
    pub tainted: BTreeSet<(usize, String)>,
    backing: Option<Backing>,
}

/// One worker's run, from the orders in its environment to its model and result on disk;
/// without [`ENV_WORKER`] (a plain `cargo test -- --ignored`) it does nothing.
pub fn run() {
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

    pub fn count(&mut self, op: &'static str) {
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
    pub fn error(&mut self, op: &str, path: &Path, expected: &str, e: &io::Error) {
        self.errors += 1;
        *self.kinds.entry(format!("error {op}: {e}")).or_default() += 1;
        self.detail("error", op, path, expected, &e.to_string());
    }

    /// A result other than the model's.
    pub fn mismatch(&mut self, op: &str, path: &Path, expected: &str, got: &str) {
        self.mismatches += 1;
        *self.kinds.entry(format!("mismatch {op}")).or_default() += 1;
        self.detail("mismatch", op, path, expected, got);
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

    pub fn pick_area(&mut self) -> usize {
        if self.areas.len() > 1 && self.rng.chance(45) {
            1
        } else {
            0
        }
    }

    /// A name in area `a` whose model entry satisfies `want` (`None`: absent). `changes`:
    /// the operation changes the object (an untouched remote file must be allowed to be).
    pub fn pick(
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

    pub fn is_file(e: Option<&Ent>) -> bool {
        matches!(e, Some(Ent::File(_)))
    }

    pub fn content(&mut self, len: usize) -> Vec<u8> {
        self.seq += 1;
        let mut v = format!("<w{} #{}>", self.index, self.seq).into_bytes();
        self.rng.fill(&mut v, len);
        v
    }

    pub fn random_size(&mut self) -> usize {
        match self.rng.below(100) {
            0..=49 => 10,
            50..=84 => 4096,
            _ => 70 * 1024,
        }
    }
}
