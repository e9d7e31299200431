//! `mount.layerfs`: lets `mount -t layerfs REMOTE MOUNTPOINT -o local=DIR,...` and
//! `/etc/fstab` lines mount layerfs. It parses the options with layerfs's own parser, so an
//! option means the same here as in `layerfs mount`, then mounts through the same code.
//! mount(8) expects 0 once the filesystem is mounted and 32 when mounting failed, with the
//! reason on stderr. `-o remount,…` changes a running mount's options (those that can change
//! live) over its control socket.

mod args;

use std::process::ExitCode;

use layerfs::MountConfig;

/// mount(8)'s "mount failure" status.
const MOUNT_FAILURE: u8 = 32;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match run(&argv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mount.layerfs: {e}");
            ExitCode::from(MOUNT_FAILURE)
        }
    }
}

fn run(argv: &[String]) -> Result<(), String> {
    let args = match args::parse_call(argv)? {
        args::Call::Mount(args) => args,
        args::Call::Help => {
            println!("{}", args::help());
            return Ok(());
        }
        args::Call::Version => {
            println!("mount.layerfs {}", env!("CARGO_PKG_VERSION"));
            return Ok(());
        }
    };
    if let Some(ns) = &args.namespace {
        enter_mount_namespace(ns)?;
    }
    if args.options.iter().any(|o| o == "remount") {
        return remount(&args);
    }
    let mut config = MountConfig {
        remote: args.source.clone(),
        mountpoint: args.mountpoint.clone(),
        ..MountConfig::default()
    };
    for option in &args.options {
        match config.apply_option(option) {
            Ok(()) => {}
            Err(layerfs::Error::UnknownOption(o)) if args.sloppy => {
                eprintln!("mount.layerfs: ignoring unknown option '{o}' (-s)");
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    if args.verbose {
        eprintln!(
            "mount.layerfs: remote {} local {} on {} ({})",
            config.remote.display(),
            config.local.display(),
            config.mountpoint.display(),
            args.options.join(",")
        );
    }
    if args.fake {
        return config.validate().map_err(|e| e.to_string());
    }
    layerfs::launch::mount(config, MOUNT_FAILURE.into()).map_err(|e| e.to_string())
}

/// `-o remount,…`: the running mount changes what it can change live, or refuses, naming
/// the options it cannot.
fn remount(args: &args::Args) -> Result<(), String> {
    if args.fake {
        return Ok(());
    }
    let done = layerfs::control::Client::new(&args.mountpoint)
        .reconfigure(&args.options)
        .map_err(|e| e.to_string())?;
    if args.verbose {
        let changed = if done.changed.is_empty() {
            "nothing changed".to_owned()
        } else {
            format!("changed {}", done.changed.join(","))
        };
        eprintln!(
            "mount.layerfs: remounted {}: {changed}",
            args.mountpoint.display()
        );
    }
    Ok(())
}

/// `-N`: mount inside another mount namespace, given as a path or a process id.
fn enter_mount_namespace(ns: &str) -> Result<(), String> {
    let path = if ns.bytes().all(|b| b.is_ascii_digit()) {
        format!("/proc/{ns}/ns/mnt")
    } else {
        ns.to_owned()
    };
    let file = std::fs::File::open(&path).map_err(|e| format!("namespace {path}: {e}"))?;
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("entering namespace {path}: {e}"))
}
