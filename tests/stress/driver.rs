//! The parent: mounts the fixture (for the shared scenario, with every worker's remote
//! directory put into L1's diff first), starts the workers, kills any that overstay their
//! deadline, gathers their results and models, prints what they found, and checks the
//! final state through the view. One scenario runs at a time: each loads the machine fully.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{drop_caches, id, repo, Mount, Options};
use crate::protocol::{
    env_num, now_ms, remote_content, remote_name, DEFAULT_PROCS, DEFAULT_SECS, DETAILS,
    ENV_DEADLINE, ENV_DURATION, ENV_FIXTURE, ENV_INDEX, ENV_LOCAL, ENV_MNT, ENV_MODEL, ENV_REMOTE,
    ENV_REMOTE_AREA, ENV_RESULT, ENV_SEED, ENV_WORKER, GRACE, REMOTE_DIRS, REMOTE_FILES,
    REMOTE_LINKS,
};
use crate::verify::{verify_model, Backing};

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

pub fn run_scenario(name: &str, shared: bool) {
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
