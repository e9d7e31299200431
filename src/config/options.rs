//! The `-o` options: one table from which the parser, `--help` and the README's option
//! table are all made, so that none of them can describe an option the others don't know.

use std::path::PathBuf;

use super::{bad, parse_driver, parse_duration, parse_secs, MountConfig, RingUse};
use crate::error::{Error, Result};
use crate::store::atime::Atime;
use crate::view::LinkStyle;

/// One row of the table: an option, or a pair of options that undo each other.
pub struct MountOption {
    /// How `-o` spells it: `local=DIR`, `ro | rw`.
    pub usage: &'static str,
    /// The `layerfs mount` flag with the same effect, if there is one.
    pub flag: Option<&'static str>,
    pub meaning: &'static str,
    pub default: &'static str,
    /// The keys this row parses.
    keys: &'static [&'static str],
    /// Whether its keys take a value (`key=value`) or stand alone.
    takes_value: bool,
    apply: fn(&mut MountConfig, &Given<'_>) -> Result<()>,
}

/// An option as given: the whole `key=value` (for messages), its key and its value.
pub struct Given<'a> {
    opt: &'a str,
    key: &'a str,
    value: &'a str,
}

impl Given<'_> {
    fn bad(&self, reason: &str) -> Error {
        bad(self.opt, reason)
    }
}

/// Every option, in the order `--help` and the README list them.
pub const OPTIONS: &[MountOption] = &[
    MountOption {
        usage: "remote=DIR",
        flag: Some("--remote DIR"),
        meaning: "the shared read-only tree (an iSulad storage root); the mount helper takes \
                  it as SOURCE",
        default: "required",
        keys: &["remote"],
        takes_value: true,
        apply: |c, g| {
            c.remote = PathBuf::from(g.value);
            Ok(())
        },
    },
    MountOption {
        usage: "local=DIR",
        flag: Some("--local DIR"),
        meaning: "this host's read-write directory",
        default: "required",
        keys: &["local"],
        takes_value: true,
        apply: |c, g| {
            c.local = PathBuf::from(g.value);
            Ok(())
        },
    },
    MountOption {
        usage: "driver=NAME",
        flag: Some("--driver NAME"),
        meaning: "graph driver whose layout is synthesized",
        default: "overlay",
        keys: &["driver"],
        takes_value: true,
        apply: |c, g| {
            c.driver = parse_driver(g.opt, g.value)?;
            Ok(())
        },
    },
    MountOption {
        usage: "link_style=absolute|relative",
        flag: Some("--link-style STYLE"),
        meaning: "how `<driver>/<id>` links point at `RO/<id>`",
        default: "absolute (as iSulad writes them)",
        keys: &["link_style"],
        takes_value: true,
        apply: |c, g| {
            c.link_style = match g.value {
                "absolute" => LinkStyle::Absolute,
                "relative" => LinkStyle::Relative,
                _ => return Err(g.bad("must be 'absolute' or 'relative'")),
            };
            Ok(())
        },
    },
    MountOption {
        usage: "allow_other",
        flag: None,
        meaning: "let every user use the mount (containers need it)",
        default: "off",
        keys: &["allow_other"],
        takes_value: false,
        apply: |c, _| {
            c.allow_other = true;
            Ok(())
        },
    },
    MountOption {
        usage: "allow_root",
        flag: None,
        meaning: "let root use the mount too",
        default: "off",
        keys: &["allow_root"],
        takes_value: false,
        apply: |c, _| {
            c.allow_root = true;
            Ok(())
        },
    },
    MountOption {
        usage: "ro | rw",
        flag: None,
        meaning: "mount read-only or read-write",
        default: "rw",
        keys: &["ro", "rw"],
        takes_value: false,
        apply: |c, g| {
            c.read_only = g.key == "ro";
            Ok(())
        },
    },
    MountOption {
        usage: "suid | nosuid",
        flag: None,
        meaning: "honour set-user-ID and set-group-ID bits in the view",
        default: "nosuid",
        keys: &["suid", "nosuid"],
        takes_value: false,
        apply: |c, g| {
            c.suid = g.key == "suid";
            Ok(())
        },
    },
    MountOption {
        usage: "dev | nodev",
        flag: None,
        meaning: "honour device nodes in the view",
        default: "nodev",
        keys: &["dev", "nodev"],
        takes_value: false,
        apply: |c, g| {
            c.dev = g.key == "dev";
            Ok(())
        },
    },
    MountOption {
        usage: "noatime | relatime | strictatime",
        flag: None,
        meaning: "when a read moves a file's access time: never, when it is not after the \
                  modification or change time or is a day old, or always (exec included)",
        default: "relatime",
        keys: &["noatime", "relatime", "strictatime"],
        takes_value: false,
        apply: |c, g| {
            c.atime.files = match g.key {
                "noatime" => Atime::NoAtime,
                "strictatime" => Atime::StrictAtime,
                _ => Atime::RelAtime,
            };
            Ok(())
        },
    },
    MountOption {
        usage: "diratime | nodiratime",
        flag: None,
        meaning: "whether listing a directory moves its access time (as files' do)",
        default: "diratime",
        keys: &["diratime", "nodiratime"],
        takes_value: false,
        apply: |c, g| {
            c.atime.dirs = g.key == "diratime";
            Ok(())
        },
    },
    MountOption {
        usage: "refresh=SECS",
        flag: Some("--refresh SECS"),
        meaning: "seconds between refresh rounds of the remote; 0 = only on demand \
                  (`layerfs refresh`, SIGUSR1); a suffix s or ms is accepted",
        default: "5",
        keys: &["refresh"],
        takes_value: true,
        apply: |c, g| {
            c.refresh = parse_duration(g.opt, g.value)?;
            Ok(())
        },
    },
    MountOption {
        usage: "scan_timeout=SECS",
        flag: None,
        meaning: "how long a scan of the remote may take before the remote counts as not \
                  answering",
        default: "30",
        keys: &["scan_timeout"],
        takes_value: true,
        apply: |c, g| {
            c.scan_timeout = parse_duration(g.opt, g.value)?;
            if c.scan_timeout.is_zero() {
                return Err(g.bad("must be more than 0 seconds"));
            }
            Ok(())
        },
    },
    MountOption {
        usage: "hide_unhealthy",
        flag: None,
        meaning: "hide remote layers and images while the remote does not answer",
        default: "off: keep serving what was last seen",
        keys: &["hide_unhealthy"],
        takes_value: false,
        apply: |c, _| {
            c.hide_unhealthy = true;
            Ok(())
        },
    },
    MountOption {
        usage: "inotify | noinotify",
        flag: None,
        meaning: "watch the remote with inotify (only when it is a local filesystem and \
                  refresh is not 0)",
        default: "inotify",
        keys: &["inotify", "noinotify"],
        takes_value: false,
        apply: |c, g| {
            c.inotify = g.key == "inotify";
            Ok(())
        },
    },
    MountOption {
        usage: "journal | nojournal",
        flag: None,
        meaning: "follow the remote's publication journal (`layerfs publish --watch` on writer \
                  hosts): new images show within a poll, and rounds between records are \
                  light scans whose cost does not grow with the tree; without a live \
                  journal, every round is a full scan",
        default: "journal",
        keys: &["journal", "nojournal"],
        takes_value: false,
        apply: |c, g| {
            c.journal = g.key == "journal";
            Ok(())
        },
    },
    MountOption {
        usage: "journal_poll=MS",
        flag: None,
        meaning: "time between two reads of the journal's bell (one remote request each); \
                  a suffix s or ms is accepted, plain numbers are milliseconds",
        default: "200ms",
        keys: &["journal_poll"],
        takes_value: true,
        apply: |c, g| {
            let poll = if g.value.bytes().all(|b| b.is_ascii_digit()) {
                parse_duration(g.opt, &format!("{}ms", g.value))?
            } else {
                parse_duration(g.opt, g.value)?
            };
            if poll < std::time::Duration::from_millis(10) {
                return Err(g.bad("must be at least 10 ms"));
            }
            c.journal_poll = poll;
            Ok(())
        },
    },
    MountOption {
        usage: "threads=N",
        flag: None,
        meaning: "threads reading and serving requests (fsync and requests that may wait on \
                  the remote run on pools of their own)",
        default: "one per CPU, at least 2",
        keys: &["threads"],
        takes_value: true,
        apply: |c, g| {
            c.threads = match g.value.parse::<usize>() {
                Ok(n) if (1..=256).contains(&n) => n,
                _ => return Err(g.bad("must be a number from 1 to 256")),
            };
            Ok(())
        },
    },
    MountOption {
        usage: "remote_threads=N",
        flag: None,
        meaning: "threads serving the requests that need the remote, which wait for it as on \
                  an NFS hard mount while the others go on",
        default: "32",
        keys: &["remote_threads"],
        takes_value: true,
        apply: |c, g| {
            c.remote_threads = match g.value.parse::<usize>() {
                Ok(n) if (1..=1024).contains(&n) => n,
                _ => return Err(g.bad("must be a number from 1 to 1024")),
            };
            Ok(())
        },
    },
    MountOption {
        usage: "passthrough | nopassthrough",
        flag: None,
        meaning: "let the kernel do file I/O directly where it can (FUSE passthrough)",
        default: "passthrough",
        keys: &["passthrough", "nopassthrough"],
        takes_value: false,
        apply: |c, g| {
            c.passthrough = g.key == "passthrough";
            Ok(())
        },
    },
    MountOption {
        usage: "io_uring | noio_uring",
        flag: None,
        meaning: "take requests through FUSE over io_uring where the kernel offers it (the \
                  fuse module's parameter enable_uring), through /dev/fuse otherwise; \
                  noio_uring: always through /dev/fuse",
        default: "io_uring where the kernel offers it, unless a keeper holds the mount",
        keys: &["io_uring", "noio_uring"],
        takes_value: false,
        apply: |c, g| {
            c.io_uring = match g.key {
                "io_uring" => RingUse::Always,
                _ => RingUse::Never,
            };
            Ok(())
        },
    },
    MountOption {
        usage: "keeper | nokeeper",
        flag: None,
        meaning: "a keeper process holds the FUSE connection and restarts a daemon that \
                  dies, so the mount and the containers on it outlive it (root only; \
                  requests go through /dev/fuse)",
        default: "keeper when root mounts in the background without -o io_uring",
        keys: &["keeper", "nokeeper"],
        takes_value: false,
        apply: |c, g| {
            c.keeper = Some(g.key == "keeper");
            Ok(())
        },
    },
    MountOption {
        usage: "entry_timeout=SECS",
        flag: None,
        meaning: "how long the kernel caches names",
        default: "3600",
        keys: &["entry_timeout"],
        takes_value: true,
        apply: |c, g| {
            c.entry_timeout = parse_secs(g.opt, g.value)?;
            Ok(())
        },
    },
    MountOption {
        usage: "attr_timeout=SECS",
        flag: None,
        meaning: "how long the kernel caches attributes",
        default: "3600",
        keys: &["attr_timeout"],
        takes_value: true,
        apply: |c, g| {
            c.attr_timeout = parse_secs(g.opt, g.value)?;
            Ok(())
        },
    },
    MountOption {
        usage: "log_file=PATH",
        flag: None,
        meaning: "where a detached daemon logs (`layerfs status` says where it does)",
        default: "the journal, else /var/log/layerfs/<mountpoint>.log",
        keys: &["log_file"],
        takes_value: true,
        apply: |c, g| {
            c.log_file = Some(PathBuf::from(g.value));
            Ok(())
        },
    },
    MountOption {
        usage: "log=LEVEL",
        flag: None,
        meaning: "error, warn, info, debug, trace, or a RUST_LOG-style filter (RUST_LOG, when \
                  set, wins)",
        default: "info",
        keys: &["log"],
        takes_value: true,
        apply: |c, g| {
            if tracing_subscriber::EnvFilter::try_new(g.value).is_err() {
                return Err(
                    g.bad("must be a log level (error, warn, info, debug, trace) or a filter")
                );
            }
            c.log_level = Some(g.value.to_owned());
            Ok(())
        },
    },
    MountOption {
        usage: "fsname=NAME",
        flag: None,
        meaning: "the source shown in /proc/mounts",
        default: "the remote path",
        keys: &["fsname"],
        takes_value: true,
        apply: |c, g| {
            c.fsname = Some(g.value.to_owned());
            Ok(())
        },
    },
    MountOption {
        usage: "quota_backend=auto|fuse|btrfs",
        flag: None,
        meaning: "who enforces new quota roots: btrfs (a subvolume with a qgroup limit; files \
                  keep passthrough; EDQUOT at the limit), or the daemon (fuse; any filesystem, \
                  inode limits); auto is btrfs where local is on btrfs and no inode limit is \
                  asked",
        default: "auto",
        keys: &["quota_backend", "quota-backend"],
        takes_value: true,
        apply: |c, g| {
            c.quota_backend = crate::quota::Choice::parse(g.value)
                .ok_or_else(|| g.bad("must be 'auto', 'fuse' or 'btrfs'"))?;
            Ok(())
        },
    },
    MountOption {
        usage: "quota_errno=enospc|edquot",
        flag: None,
        meaning: "what a write over a quota enforced by the daemon (quota_backend=fuse) fails \
                  with; btrfs quotas fail with EDQUOT",
        default: "enospc",
        keys: &["quota_errno", "quota-errno"],
        takes_value: true,
        apply: |c, g| {
            c.quota_errno = match g.value.to_ascii_lowercase().as_str() {
                "enospc" => nix::errno::Errno::ENOSPC,
                "edquot" => nix::errno::Errno::EDQUOT,
                _ => return Err(g.bad("must be 'enospc' or 'edquot'")),
            };
            Ok(())
        },
    },
    MountOption {
        usage: "metrics=ADDR:PORT",
        flag: None,
        meaning: "serve Prometheus metrics over HTTP at http://ADDR:PORT/metrics; port 0 picks \
                  a free port (`layerfs status` shows it)",
        default: "off",
        keys: &["metrics"],
        takes_value: true,
        apply: |c, g| {
            c.metrics = Some(g.value.parse().map_err(|_| {
                g.bad("must be IP:PORT, e.g. 127.0.0.1:9100 or [::]:9100 (port 0: any free port)")
            })?);
            Ok(())
        },
    },
    MountOption {
        usage: "expose_into=ROOT",
        flag: Some("--expose-into ROOT"),
        meaning: "bind-mount the view's `<driver>/`, `<driver>-layers/` and `<driver>-images/` \
                  into ROOT, a directory on a regular filesystem, for runtimes that refuse a \
                  FUSE storage root (iSulad); absolute `<driver>/<id>` links then point into \
                  ROOT. Needs root",
        default: "off",
        keys: &["expose_into", "expose-into"],
        takes_value: true,
        apply: |c, g| {
            c.expose_into = Some(PathBuf::from(g.value));
            Ok(())
        },
    },
    MountOption {
        usage: "default_permissions",
        flag: None,
        meaning: "accepted; always on (the kernel checks permissions)",
        default: "on",
        keys: &["default_permissions"],
        takes_value: false,
        apply: |_, _| Ok(()),
    },
];

/// Applies one option (`key` or `key=value`) to `config`.
pub fn apply(config: &mut MountConfig, opt: &str) -> Result<()> {
    let (key, value) = match opt.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (opt, None),
    };
    let row = OPTIONS
        .iter()
        .find(|row| row.keys.contains(&key))
        .ok_or_else(|| Error::UnknownOption(opt.to_owned()))?;
    let value = match (row.takes_value, value) {
        (true, Some(v)) if !v.is_empty() => v,
        (true, _) => return Err(bad(opt, "needs a value")),
        (false, Some(_)) => return Err(bad(opt, "takes no value")),
        (false, None) => "",
    };
    (row.apply)(config, &Given { opt, key, value })
}

/// The option list of `layerfs mount --help`.
pub fn help() -> String {
    const WIDTH: usize = 92;
    const COLUMN: usize = 23;
    let mut out = String::from("mount options (-o a,b=c,...):\n");
    for row in OPTIONS {
        let text = format!("{} [{}]", row.meaning.replace('`', ""), row.default);
        let mut line = format!("  {:<width$}", row.usage, width = COLUMN - 3);
        if line.len() >= COLUMN {
            out.push_str(line.trim_end());
            out.push('\n');
            line = " ".repeat(COLUMN - 1);
        }
        let mut used = line.len();
        for word in text.split(' ') {
            if used + 1 + word.len() > WIDTH && used > COLUMN {
                out.push_str(line.trim_end());
                out.push('\n');
                line = " ".repeat(COLUMN - 1);
                used = line.len();
            }
            line.push(' ');
            line.push_str(word);
            used += 1 + word.len();
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The option table of the README, as Markdown.
pub fn readme_table() -> String {
    let mut out = String::from("| option | meaning | default |\n|---|---|---|\n");
    for row in OPTIONS {
        let usage = format!("`-o {}`", row.usage.replace('|', "\\|"));
        let option = match row.flag {
            Some(flag) => format!("`{flag}` / {usage}"),
            None => usage,
        };
        out.push_str(&format!(
            "| {option} | {} | {} |\n",
            row.meaning, row.default
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_in_one_row_only() {
        let mut keys: Vec<&str> = OPTIONS
            .iter()
            .flat_map(|r| r.keys.iter().copied())
            .collect();
        let all = keys.len();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), all);
    }

    #[test]
    fn help_lists_every_key_and_fits_a_terminal() {
        let text = help();
        for row in OPTIONS {
            for key in row.keys.iter().filter(|k| !k.contains('-')) {
                assert!(text.contains(key), "{key} missing from --help");
            }
        }
        for line in text.lines() {
            assert!(line.len() <= 92, "too long: {line:?}");
        }
    }

    #[test]
    fn the_readme_table_is_the_one_made_from_this_table() {
        const BEGIN: &str = "<!-- options: made from src/config/options.rs; a test checks it -->\n";
        const END: &str = "<!-- end of options -->";
        let readme = include_str!("../../README.md");
        let start = readme
            .find(BEGIN)
            .expect("the README marks its option table")
            + BEGIN.len();
        let end = start
            + readme[start..]
                .find(END)
                .expect("the table's end is marked");
        assert_eq!(
            &readme[start..end],
            readme_table(),
            "the README's option table differs from src/config/options.rs; paste \
             config::options::readme_table() between the markers"
        );
    }
}
