//! The measurement driver: mounts the server in a temporary directory, runs the workloads from
//! this process, unmounts, and repeats per transport and round (interleaved).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::server::{Config, Server, Transport};

pub struct Options {
    pub rounds: usize,
    pub stat_n: usize,
    pub files: usize,
    pub ttl: Duration,
    pub transports: Vec<Transport>,
}

/// Requests per operation below which a row says nothing about the transport.
const MIN_REQUESTS_TO_DECIDE: f64 = 0.5;

/// One measured figure per (transport, row) per round.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Row {
    RoundTrip,
    StatCall,
    Create,
    Stat,
    Readdir,
    Unlink,
}

impl Row {
    const ALL: [Row; 6] = [
        Row::RoundTrip,
        Row::StatCall,
        Row::Create,
        Row::Stat,
        Row::Readdir,
        Row::Unlink,
    ];
    fn label(self) -> &'static str {
        match self {
            Row::RoundTrip => "request round trip (timeouts 0)",
            Row::StatCall => "stat() of one path (timeouts 0)",
            Row::Create => "create (open O_CREAT+O_EXCL, close)",
            Row::Stat => "cold stat (entries expired)",
            Row::Readdir => "readdir (uncached)",
            Row::Unlink => "unlink",
        }
    }
    fn unit(self) -> &'static str {
        match self {
            Row::RoundTrip => "µs/request",
            Row::StatCall => "µs/stat",
            Row::Readdir => "entries/s",
            _ => "ops/s",
        }
    }
    fn higher_is_better(self) -> bool {
        !matches!(self, Row::RoundTrip | Row::StatCall)
    }
    fn is_metadata(self) -> bool {
        matches!(self, Row::Create | Row::Stat | Row::Readdir | Row::Unlink)
    }
}

type Results = BTreeMap<(usize, Row), Vec<f64>>;
/// Requests per operation, by (transport, row), from the last round.
type Counts = BTreeMap<(usize, Row), f64>;

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("path without NUL")
}

/// A private directory under the system temp dir, removed on drop (it is empty by then: the
/// mount on it is gone).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> io::Result<TempDir> {
        let mut tmpl = std::env::temp_dir()
            .join("uring-probe.XXXXXX")
            .into_os_string()
            .into_encoded_bytes();
        tmpl.push(0);
        // SAFETY: mkdtemp rewrites the NUL-terminated template in place.
        let p = unsafe { libc::mkdtemp(tmpl.as_mut_ptr().cast()) };
        if p.is_null() {
            return Err(io::Error::last_os_error());
        }
        tmpl.pop();
        // SAFETY: the bytes came from an OsString and mkdtemp only replaced the X's with ASCII.
        let s = unsafe { std::ffi::OsString::from_encoded_bytes_unchecked(tmpl) };
        let dir = TempDir(PathBuf::from(s));
        crate::server::track_temp_dir(&cstr(&dir.0), true);
        Ok(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
        crate::server::track_temp_dir(&cstr(&self.0), false);
    }
}

fn stat_path(p: &CString) -> io::Result<()> {
    // SAFETY: stat into a zeroed local.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::stat(p.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn create_file(p: &CString) -> io::Result<()> {
    // SAFETY: open/close on a valid C string.
    let fd = unsafe {
        libc::open(
            p.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
            0o644,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    unsafe { libc::close(fd) };
    Ok(())
}

/// Fails if an io_uring server served anything but FORGETs through /dev/fuse: that would
/// mean the kernel never switched the connection to the ring, and the numbers would be
/// /dev/fuse numbers under the wrong name.
fn check_path(server: &Server, t: Transport) -> io::Result<()> {
    let dev = server.stats.dev_requests.load(Ordering::Relaxed);
    if matches!(t, Transport::Uring { .. }) && dev > 0 {
        return Err(io::Error::other(format!(
            "{dev} requests went through /dev/fuse on an io_uring mount: the ring is not in use"
        )));
    }
    Ok(())
}

fn stop(server: Server) -> io::Result<()> {
    server.stop().map_err(io::Error::other)
}

/// (a) Round-trip latency: `n` stat() calls of one path with entry/attr timeouts 0, so every
/// call goes to the server (GETATTR of the root for the permission check, LOOKUP to
/// revalidate the name, GETATTR for the attributes). Returns (µs per request, µs per stat,
/// requests per stat).
fn roundtrip(t: Transport, n: usize) -> io::Result<(f64, f64, f64)> {
    let dir = TempDir::new()?;
    let cfg = Config {
        transport: t,
        entry_ttl: Duration::ZERO,
        attr_ttl: Duration::ZERO,
    };
    let server = Server::start(&dir.0, cfg)?;
    let path = dir.0.join("f");
    let c = cstr(&path);
    let res = (|| -> io::Result<(f64, f64, f64)> {
        create_file(&c).map_err(|e| io::Error::new(e.kind(), format!("create: {e}")))?;
        for _ in 0..1000.min(n) {
            stat_path(&c)?;
        }
        let r0 = server.stats.requests();
        let t0 = Instant::now();
        for _ in 0..n {
            stat_path(&c).map_err(|e| io::Error::new(e.kind(), format!("stat: {e}")))?;
        }
        let dt = t0.elapsed().as_secs_f64();
        let reqs = (server.stats.requests() - r0).max(1) as f64;
        check_path(&server, t)?;
        Ok((dt * 1e6 / reqs, dt * 1e6 / n as f64, reqs / n as f64))
    })();
    let stopped = stop(server);
    let r = res?;
    stopped?;
    Ok(r)
}

/// (b) layerfs's metadata rows: create, cold stat, readdir, unlink of `files` files.
/// Returns (ops/s, requests per op) for each row.
fn metadata(t: Transport, files: usize, ttl: Duration) -> io::Result<Vec<(Row, f64, f64)>> {
    let dir = TempDir::new()?;
    let cfg = Config {
        transport: t,
        entry_ttl: ttl,
        attr_ttl: ttl,
    };
    let server = Server::start(&dir.0, cfg)?;
    let paths: Vec<CString> = (0..files)
        .map(|i| cstr(&dir.0.join(format!("f{i:06}"))))
        .collect();
    let res = (|| -> io::Result<Vec<(Row, f64, f64)>> {
        let mut out = Vec::new();
        let (v, r) = timed(&server, files, || {
            for p in &paths {
                create_file(p).map_err(|e| io::Error::new(e.kind(), format!("create: {e}")))?;
            }
            Ok(())
        })?;
        out.push((Row::Create, v, r));
        // "Cold": wait until every name and attribute the kernel cached has expired, so each
        // stat must ask the server again (one LOOKUP), without dropping the machine's caches.
        if !ttl.is_zero() {
            std::thread::sleep(ttl + Duration::from_millis(100));
        }
        let (v, r) = timed(&server, files, || {
            for p in &paths {
                stat_path(p).map_err(|e| io::Error::new(e.kind(), format!("stat: {e}")))?;
            }
            Ok(())
        })?;
        out.push((Row::Stat, v, r));
        // Whole-directory scans, at least 3 and at least 0.3 s (one scan takes milliseconds);
        // the entry type comes from d_type, never from a stat.
        let mut entries = 0usize;
        let mut passes = 0usize;
        let t0 = Instant::now();
        let r0 = server.stats.requests();
        while passes < 3 || t0.elapsed() < Duration::from_millis(300) {
            for e in std::fs::read_dir(&dir.0)? {
                if e?.file_type()?.is_file() {
                    entries += 1;
                }
            }
            passes += 1;
        }
        let dt = t0.elapsed().as_secs_f64();
        if entries != passes * files {
            return Err(io::Error::other(format!(
                "readdir saw {entries} files in {passes} passes, expected {files} each"
            )));
        }
        let reqs = (server.stats.requests() - r0) as f64;
        out.push((Row::Readdir, entries as f64 / dt, reqs / entries as f64));
        let (v, r) = timed(&server, files, || {
            for p in &paths {
                // SAFETY: unlink of a valid C string.
                if unsafe { libc::unlink(p.as_ptr()) } != 0 {
                    let e = io::Error::last_os_error();
                    return Err(io::Error::new(e.kind(), format!("unlink: {e}")));
                }
            }
            Ok(())
        })?;
        out.push((Row::Unlink, v, r));
        check_path(&server, t)?;
        Ok(out)
    })();
    let stopped = stop(server);
    let r = res?;
    stopped?;
    Ok(r)
}

/// Runs `f` (which does `ops` operations) and returns (ops/s, server requests per op).
fn timed(
    server: &Server,
    ops: usize,
    f: impl FnOnce() -> io::Result<()>,
) -> io::Result<(f64, f64)> {
    let r0 = server.stats.requests();
    let t0 = Instant::now();
    f()?;
    let dt = t0.elapsed().as_secs_f64();
    let reqs = (server.stats.requests() - r0) as f64;
    Ok((ops as f64 / dt, reqs / ops as f64))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn fmt_value(v: f64, row: Row) -> String {
    if row.higher_is_better() {
        if v >= 1e6 {
            format!("{:.2}M", v / 1e6)
        } else {
            format!("{:.1}k", v / 1e3)
        }
    } else {
        format!("{v:.2}")
    }
}

/// Speed-up of `a` over `b` (> 1: `a` is faster), whatever the row's unit.
fn speedup(a: f64, b: f64, row: Row) -> f64 {
    if row.higher_is_better() {
        a / b
    } else {
        b / a
    }
}

fn loadavg() -> String {
    let s = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

pub fn run(o: &Options) -> io::Result<()> {
    let load_before = loadavg();
    let mut results: Results = BTreeMap::new();
    let mut counts: Counts = BTreeMap::new();
    let nt = o.transports.len();
    for round in 0..o.rounds {
        // Rotate the order every round so no transport always runs first or last.
        for k in 0..nt {
            let ti = (k + round) % nt;
            let t = o.transports[ti];
            eprintln!("round {}/{}: {t}", round + 1, o.rounds);
            let (per_req, per_stat, reqs) = roundtrip(t, o.stat_n)
                .map_err(|e| io::Error::new(e.kind(), format!("{t}: round trip: {e}")))?;
            eprintln!(
                "  round trip: {per_req:.2} µs/request, {per_stat:.2} µs/stat ({reqs:.2} requests/stat)"
            );
            results
                .entry((ti, Row::RoundTrip))
                .or_default()
                .push(per_req);
            results
                .entry((ti, Row::StatCall))
                .or_default()
                .push(per_stat);
            counts.insert((ti, Row::StatCall), reqs);
            counts.insert((ti, Row::RoundTrip), 1.0);
            let rows = metadata(t, o.files, o.ttl)
                .map_err(|e| io::Error::new(e.kind(), format!("{t}: metadata: {e}")))?;
            for (row, v, reqs) in rows {
                eprintln!(
                    "  {:<40} {:>10.0} {} ({reqs:.3} requests/op)",
                    row.label(),
                    v,
                    row.unit()
                );
                results.entry((ti, row)).or_default().push(v);
                counts.insert((ti, row), reqs);
            }
        }
    }
    println!(
        "Linux {}, {} CPUs available to the run; load average {} before, {} after.\n",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before,
        loadavg()
    );
    print_report(o, &results, &counts);
    Ok(())
}

fn print_report(o: &Options, results: &Results, counts: &Counts) {
    let names: Vec<String> = o.transports.iter().map(|t| t.to_string()).collect();
    let uring = o
        .transports
        .iter()
        .position(|t| matches!(t, Transport::Uring { .. }));
    let devs: Vec<usize> = (0..o.transports.len())
        .filter(|&i| matches!(o.transports[i], Transport::Dev { .. }))
        .collect();
    println!(
        "Medians of {} rounds (min–max in parentheses); {} stat() calls per round-trip run, \
         {} files per metadata run, entry/attr timeout {} s in the metadata runs.\n",
        o.rounds,
        o.stat_n,
        o.files,
        o.ttl.as_secs_f64()
    );
    let mut head = "| row | unit |".to_string();
    let mut sep = "|---|---|".to_string();
    for n in &names {
        head += &format!(" {n} |");
        sep += "---:|";
    }
    if let Some(u) = uring {
        for &d in &devs {
            head += &format!(" {} vs {} |", names[u], names[d]);
            sep += "---:|";
        }
    }
    println!("{head}\n{sep}");
    for row in Row::ALL {
        let mut line = format!("| {} | {} |", row.label(), row.unit());
        for i in 0..names.len() {
            let v = results.get(&(i, row)).cloned().unwrap_or_default();
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            line += &format!(
                " {} ({}–{}) |",
                fmt_value(median(&v), row),
                fmt_value(lo, row),
                fmt_value(hi, row)
            );
        }
        if let Some(u) = uring {
            let mu = median(results.get(&(u, row)).map_or(&[][..], |v| v));
            for &d in &devs {
                let md = median(results.get(&(d, row)).map_or(&[][..], |v| v));
                line += &format!(" {:.2}x |", speedup(mu, md, row));
            }
        }
        println!("{line}");
    }
    println!("\nRequests per operation (server-side count, last round):\n");
    let mut head = "| row |".to_string();
    let mut sep = "|---|".to_string();
    for n in &names {
        head += &format!(" {n} |");
        sep += "---:|";
    }
    println!("{head}\n{sep}");
    for row in Row::ALL.into_iter().skip(1) {
        let mut line = format!("| {} |", row.label());
        for i in 0..names.len() {
            line += &format!(
                " {:.3} |",
                counts.get(&(i, row)).copied().unwrap_or(f64::NAN)
            );
        }
        println!("{line}");
    }
    if let (Some(u), false) = (uring, devs.is_empty()) {
        println!("\nVerdict (adopt only if io_uring makes metadata operations >= 1.3x faster):\n");
        let mut all = true;
        for row in Row::ALL.into_iter().filter(|r| r.is_metadata()) {
            let mu = median(results.get(&(u, row)).map_or(&[][..], |v| v));
            // Against the best classic configuration for that row.
            let (best, md) = devs
                .iter()
                .map(|&d| (d, median(results.get(&(d, row)).map_or(&[][..], |v| v))))
                .max_by(|a, b| {
                    let (x, y) = if row.higher_is_better() {
                        (a.1, b.1)
                    } else {
                        (b.1, a.1)
                    };
                    x.total_cmp(&y)
                })
                .expect("at least one dev transport");
            let s = speedup(mu, md, row);
            // A row whose operations hardly reach the server (one READDIR returns about a
            // thousand entries) measures the listing work, not the transport: it is shown but
            // does not decide.
            let requests = counts.get(&(u, row)).copied().unwrap_or(f64::NAN);
            let decides = requests >= MIN_REQUESTS_TO_DECIDE;
            if decides {
                all &= s >= 1.3;
            }
            println!(
                "- {}: {:.2}x vs the best classic setup ({}){}",
                row.label(),
                s,
                names[best],
                if decides {
                    String::new()
                } else {
                    format!("; not counted: {requests:.3} requests per operation")
                }
            );
        }
        let rt = Row::RoundTrip;
        let mu = median(results.get(&(u, rt)).map_or(&[][..], |v| v));
        for &d in &devs {
            let md = median(results.get(&(d, rt)).map_or(&[][..], |v| v));
            println!(
                "- request round trip: {:.2}x vs {}",
                speedup(mu, md, rt),
                names[d]
            );
        }
        println!(
            "\nio_uring >= 1.3x on every metadata row that reaches the server: {}",
            if all { "yes" } else { "no" }
        );
    }
}
