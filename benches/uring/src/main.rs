//! uring-probe: a minimal FUSE server speaking the kernel protocol directly, over either the
//! classic /dev/fuse read/write loop or FUSE-over-io_uring, plus a driver that measures both.
//! It exists to decide whether the io_uring transport is worth adopting; see README.md.

mod bench;
mod fs;
mod proto;
mod ring;
mod served;
mod server;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use server::{Config, Server, Transport, UringParam};

const USAGE: &str = "\
usage:
  uring-probe bench [--rounds N] [--stat-n N] [--files N] [--timeout SECS]
                    [--transports LIST] [--depth N] [--defer-taskrun] [--forget-pause SECS]
      Mounts the server in a temporary directory for each transport and round (interleaved),
      runs the round-trip and metadata workloads, unmounts, and prints a Markdown report.
      LIST is comma-separated from dev1, dev2 (classic loop with 1 or 2 threads) and uring;
      default dev1,dev2,uring.
  uring-probe serve MOUNTPOINT [--transport dev|uring] [--threads N] [--depth N] [--stats FILE]
                    [--defer-taskrun] [--forget-pause SECS] [--timeout SECS]
      Serves an empty flat directory at MOUNTPOINT until unmounted or signalled. With
      --stats, FILE holds the requests served so far (JSON), rewritten every 20 ms.

defaults: --rounds 3 --stat-n 200000 --files 10000 --timeout 1 (entry and attribute
lifetime, as layerfs) --depth 8 (ring entries per CPU queue) --threads 1 --forget-pause 0.001
(over io_uring, the /dev/fuse thread's pause after a FORGET, so that the next ones come
together, as layerfs's readers pause; 0 reads each as it comes).
Needs root. io_uring modes switch the fuse module parameter enable_uring on and restore it.";

struct Args(Vec<String>);

impl Args {
    fn flag(&mut self, name: &str) -> bool {
        let before = self.0.len();
        self.0.retain(|a| a != name);
        self.0.len() != before
    }
    fn value<T: std::str::FromStr>(&mut self, name: &str, default: T) -> Result<T, String> {
        let Some(i) = self.0.iter().position(|a| a == name) else {
            return Ok(default);
        };
        if i + 1 >= self.0.len() {
            return Err(format!("{name} needs a value"));
        }
        let v = self.0.remove(i + 1);
        self.0.remove(i);
        v.parse().map_err(|_| format!("{name}: bad value {v:?}"))
    }
}

fn secs(s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("bad duration {s}"))
}

fn run() -> Result<(), String> {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.is_empty() || argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    let cmd = argv.remove(0);
    let mut a = Args(argv);
    let depth: usize = a.value("--depth", 8)?;
    let defer_taskrun = a.flag("--defer-taskrun");
    let ttl = secs(a.value("--timeout", 1.0)?)?;
    let forget_pause = secs(a.value("--forget-pause", 0.001)?)?;
    let uring = Transport::Uring {
        depth: depth.max(1),
        defer_taskrun,
        forget_pause,
    };
    match cmd.as_str() {
        "bench" => {
            let rounds: usize = a.value("--rounds", 3)?;
            let stat_n: usize = a.value("--stat-n", 200_000)?;
            let files: usize = a.value("--files", 10_000)?;
            let list: String = a.value("--transports", "dev1,dev2,uring".to_string())?;
            let transports = list
                .split(',')
                .map(|t| match t {
                    "dev1" => Ok(Transport::Dev { threads: 1 }),
                    "dev2" => Ok(Transport::Dev { threads: 2 }),
                    "uring" => Ok(uring),
                    _ => Err(format!("unknown transport {t:?}")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(extra) = a.0.first() {
                return Err(format!("unexpected argument {extra:?}"));
            }
            let needs_uring = transports.contains(&uring);
            let param = if needs_uring {
                Some(UringParam::enable().map_err(|e| e.to_string())?)
            } else {
                None
            };
            if let Some(p) = &param {
                eprintln!(
                    "fuse enable_uring: was {}, set to 1 for the run",
                    p.previous()
                );
            }
            let opts = bench::Options {
                rounds: rounds.max(1),
                stat_n: stat_n.max(1),
                files: files.max(1),
                ttl,
                transports,
            };
            let r = bench::run(&opts).map_err(|e| e.to_string());
            drop(param);
            r
        }
        "serve" => {
            if a.0.is_empty() {
                return Err("serve needs a MOUNTPOINT".into());
            }
            let mountpoint = PathBuf::from(a.0.remove(0));
            let transport: String = a.value("--transport", "dev".to_string())?;
            let threads: usize = a.value("--threads", 1)?;
            let stats_file: String = a.value("--stats", String::new())?;
            let transport = match transport.as_str() {
                "dev" => Transport::Dev {
                    threads: threads.max(1),
                },
                "uring" => uring,
                t => return Err(format!("unknown transport {t:?}")),
            };
            if let Some(extra) = a.0.first() {
                return Err(format!("unexpected argument {extra:?}"));
            }
            let _param = match transport {
                Transport::Uring { .. } => Some(UringParam::enable().map_err(|e| e.to_string())?),
                Transport::Dev { .. } => None,
            };
            let cfg = Config {
                transport,
                entry_ttl: ttl,
                attr_ttl: ttl,
            };
            let server = Server::start(&mountpoint, cfg).map_err(|e| e.to_string())?;
            eprintln!("serving {} over {transport}", mountpoint.display());
            // Runs until someone unmounts it (then the threads end) or a signal arrives (the
            // signal thread unmounts and exits).
            while server.running() {
                std::thread::sleep(Duration::from_millis(20));
                if !stats_file.is_empty() {
                    write_stats(&stats_file, &server.stats)?;
                }
            }
            server.stop()
        }
        _ => Err(format!("unknown command {cmd:?}\n{USAGE}")),
    }
}

/// Writes the requests served so far to `path` as JSON (`{"requests": N, "forgets": N}`),
/// replacing it whole, so that a reader between two workloads never sees half a file.
fn write_stats(path: &str, stats: &server::Stats) -> Result<(), String> {
    use std::sync::atomic::Ordering;
    let text = format!(
        "{{\"requests\": {}, \"forgets\": {}}}\n",
        stats.requests(),
        stats.forgets.load(Ordering::Relaxed)
    );
    let temp = format!("{path}.new");
    std::fs::write(&temp, text)
        .and_then(|()| std::fs::rename(&temp, path))
        .map_err(|e| format!("stats file {path}: {e}"))
}

fn main() -> ExitCode {
    server::install_cleanup_handlers();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("uring-probe: {e}");
            ExitCode::FAILURE
        }
    }
}
