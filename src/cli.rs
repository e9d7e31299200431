//! The `layerfs` command line.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{options, MountConfig};
use crate::view::LinkStyle;

#[derive(Debug, Parser)]
#[command(
    name = "layerfs",
    version,
    about = "Share read-only container layers across hosts; keep writes local."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mount the unified view of LOCAL over REMOTE at MOUNTPOINT.
    Mount(MountArgs),
    /// Show a running mount's state: remote health, the last refresh round, and why each
    /// object that is not shown is not ready.
    Status(ControlArgs),
    /// Run a refresh round on a running mount now, and show what it changed.
    Refresh(RefreshArgs),
    /// List a running mount's ready layers.
    Layers(ControlArgs),
    /// List a running mount's ready images.
    Images(ControlArgs),
    /// Unmount a layerfs mount and wait until its daemon has finished.
    Umount(UmountArgs),
    /// Hand a mount kept by a keeper (`-o keeper`) over to the layerfs binary now on disk,
    /// without unmounting: callers wait for the gap, nothing fails.
    Upgrade(UpgradeArgs),
    /// Set, show, list or clear quotas on directories of a running mount.
    Quota(QuotaArgs),
    /// Publish to a shared remote tree from a writer host: journal this host's writes
    /// (`--watch REMOTE`), or copy an image into it atomically (`image`).
    Publish(PublishArgs),
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_required = false)]
pub struct PublishArgs {
    /// Watch REMOTE for this host's writes and append a journal record for each layer or
    /// image that becomes ready, changes or goes, so readers see it at once.
    #[arg(long, value_name = "REMOTE")]
    pub watch: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<PublishCommand>,
}

#[derive(Debug, Subcommand)]
pub enum PublishCommand {
    /// Copy an image from this host's own iSulad storage into a shared remote, in iSulad's
    /// format and order, under temporary names renamed into place.
    Image(PublishImageArgs),
}

#[derive(Debug, Args)]
pub struct PublishImageArgs {
    /// The host's own iSulad storage root (e.g. /var/lib/isulad/storage).
    pub source: PathBuf,
    /// The image: its 64-hex id, a unique prefix of it, or one of its names.
    pub image: String,
    /// The shared remote tree to publish into.
    #[arg(long, value_name = "REMOTE")]
    pub remote: PathBuf,
    /// The storage driver whose areas are copied.
    #[arg(long, default_value = "overlay")]
    pub driver: String,
}

#[derive(Debug, Args)]
pub struct QuotaArgs {
    #[command(subcommand)]
    pub command: QuotaCommand,
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Limit the allocated space (and optionally the inodes) under a directory.
    Set(QuotaSetArgs),
    /// Show a quota root's limit and usage.
    Get(QuotaPathArgs),
    /// List a mount's quota roots with their limits and usage.
    List(ControlArgs),
    /// Remove a directory's quota; its files stay as they are.
    Clear(QuotaPathArgs),
}

#[derive(Debug, Args)]
#[command(after_help = SIZES)]
pub struct QuotaSetArgs {
    /// Also limit the number of inodes.
    #[arg(long, value_name = "N")]
    pub inodes: Option<u64>,
    /// A containerd label; `containerd.io/snapshot/max-size=BYTES` gives the limit when SIZE
    /// is empty or omitted.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Where quotas are not supported (not a layerfs mount), warn and go on without one
    /// instead of failing.
    #[arg(long)]
    pub ignore_failed: bool,
    /// Create PATH (which must not exist yet) and give it the quota; it is removed again if
    /// the quota cannot be set.
    #[arg(long)]
    pub create: bool,
    /// Print the quota as JSON.
    #[arg(long)]
    pub json: bool,
    /// The mount (or a directory inside it) PATH is relative to.
    pub mountpoint: PathBuf,
    /// The directory to limit: relative to MOUNTPOINT (`overlay/<id>`) or absolute.
    pub path: PathBuf,
    /// The limit; empty or omitted means no quota (unless a max-size label gives one).
    #[arg(default_value = "", hide_default_value = true)]
    pub size: String,
}

impl QuotaSetArgs {
    /// The `storage` request these arguments make.
    pub fn storage(&self) -> crate::quota::storage::Storage {
        crate::quota::storage::Storage {
            size: self.size.clone(),
            ignore_failed: self.ignore_failed,
        }
    }
}

/// What `quota set --help` says about sizes.
const SIZES: &str = "SIZE is bytes (1048576) or a whole number with K, M, G, T or P, optionally \
followed by i, iB or B; all units are 1024-based (10G = 10Gi = 10GiB = 10GB). 0 allows \
nothing to be allocated.";

#[derive(Debug, Args)]
pub struct QuotaPathArgs {
    /// Print the answer as JSON.
    #[arg(long)]
    pub json: bool,
    /// The mount to ask.
    pub mountpoint: PathBuf,
    /// The directory: relative to MOUNTPOINT (`overlay/<id>`) or absolute.
    pub path: PathBuf,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[derive(Debug, Args)]
pub struct UmountArgs {
    /// Seconds to wait for the daemon to finish after the unmount.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub wait: u64,
    /// The mount to stop.
    pub mountpoint: PathBuf,
}

#[derive(Debug, Args)]
pub struct UpgradeArgs {
    /// Seconds to wait for the new daemon to serve.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub wait: u64,
    /// The mount to hand over.
    pub mountpoint: PathBuf,
}

/// The arguments of the commands that ask a running mount over its control socket.
#[derive(Debug, Args)]
pub struct ControlArgs {
    /// Print the answer as JSON.
    #[arg(long)]
    pub json: bool,
    /// The mount to ask.
    pub mountpoint: PathBuf,
}

#[derive(Debug, Args)]
pub struct RefreshArgs {
    /// The remote was emptied on purpose: take a scan that finds no layers or images as
    /// the truth, instead of as a share that went away.
    #[arg(long)]
    pub accept_empty: bool,
    #[command(flatten)]
    pub control: ControlArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LinkStyleArg {
    Absolute,
    Relative,
}

#[derive(Debug, Args)]
#[command(after_help = options::help())]
pub struct MountArgs {
    /// The shared read-only tree: an iSulad storage root (e.g. on NFS).
    #[arg(long, value_name = "DIR")]
    pub remote: Option<PathBuf>,
    /// This host's read-write directory; it stays a valid overlayfs upper directory.
    #[arg(long, value_name = "DIR")]
    pub local: Option<PathBuf>,
    /// Graph driver whose layout is synthesized (`<driver>/`, `<driver>-layers/`, `<driver>-images/`).
    #[arg(long, value_name = "NAME")]
    pub driver: Option<String>,
    /// How `<driver>/<id>` links point at `RO/<id>`: absolute, as iSulad writes them, or relative.
    #[arg(long, value_enum)]
    pub link_style: Option<LinkStyleArg>,
    /// Seconds between refresh rounds of the remote; 0 = only on demand (same as `-o refresh=`).
    #[arg(long, value_name = "SECS")]
    pub refresh: Option<String>,
    /// Bind-mount the view's layout dirs into ROOT, a directory on a regular filesystem
    /// (same as `-o expose_into=`).
    #[arg(long, value_name = "ROOT")]
    pub expose_into: Option<PathBuf>,
    /// Mount options, comma-separated (see below).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Stay in the foreground and log to stderr.
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// Where to mount the view.
    pub mountpoint: PathBuf,
}

impl MountArgs {
    /// Builds the mount configuration: `-o` options first, explicit flags over them.
    pub fn into_config(self) -> crate::Result<MountConfig> {
        let mut config = MountConfig::default();
        for list in &self.options {
            config.apply_options(list)?;
        }
        if let Some(remote) = self.remote {
            config.remote = remote;
        }
        if let Some(local) = self.local {
            config.local = local;
        }
        if let Some(driver) = self.driver {
            config.apply_option(&format!("driver={driver}"))?;
        }
        if let Some(refresh) = self.refresh {
            config.apply_option(&format!("refresh={refresh}"))?;
        }
        if let Some(root) = self.expose_into {
            config.expose_into = Some(root);
        }
        if let Some(style) = self.link_style {
            config.link_style = match style {
                LinkStyleArg::Absolute => LinkStyle::Absolute,
                LinkStyleArg::Relative => LinkStyle::Relative,
            };
        }
        config.foreground = self.foreground;
        config.mountpoint = self.mountpoint;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("layerfs").chain(args.iter().copied()))
    }

    fn set(args: &[&str]) -> QuotaSetArgs {
        let mut all = vec!["quota", "set"];
        all.extend_from_slice(args);
        match parse(&all).unwrap().command {
            Command::Quota(QuotaArgs {
                command: QuotaCommand::Set(a),
            }) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn quota_set_takes_a_size_and_its_options() {
        let a = set(&["/mnt", "overlay/c1", "10G"]);
        assert_eq!(a.mountpoint, Path::new("/mnt"));
        assert_eq!(a.path, Path::new("overlay/c1"));
        assert_eq!(a.size, "10G");
        assert!(!a.ignore_failed && !a.create && !a.json);
        assert_eq!(a.inodes, None);
        let a = set(&[
            "--inodes",
            "1000",
            "--label",
            "containerd.io/snapshot/max-size=4096",
            "--label",
            "a=b=c",
            "--ignore-failed",
            "--create",
            "--json",
            "/mnt",
            "/mnt/overlay/c1",
        ]);
        assert_eq!(a.size, "");
        assert_eq!(a.inodes, Some(1000));
        assert_eq!(
            a.labels,
            [
                (
                    "containerd.io/snapshot/max-size".to_owned(),
                    "4096".to_owned()
                ),
                ("a".to_owned(), "b=c".to_owned())
            ]
        );
        assert!(a.ignore_failed && a.create && a.json);
        assert_eq!(a.storage().size, "");
        assert!(a.storage().ignore_failed);
        // An explicitly empty size is no quota, as an omitted one.
        assert_eq!(set(&["/mnt", "c", ""]).size, "");
    }

    #[test]
    fn quota_arguments_are_checked() {
        assert!(parse(&["quota", "set", "/mnt"]).is_err());
        assert!(parse(&["quota", "set", "/mnt", "c", "1G", "extra"]).is_err());
        assert!(parse(&["quota", "set", "--label", "novalue", "/mnt", "c"]).is_err());
        assert!(parse(&["quota", "set", "--label", "=v", "/mnt", "c"]).is_err());
        assert!(parse(&["quota", "set", "--inodes", "-1", "/mnt", "c"]).is_err());
        assert!(parse(&["quota", "get", "/mnt"]).is_err());
        assert!(parse(&["quota", "list", "/mnt", "c"]).is_err());
        assert!(parse(&["quota", "bogus", "/mnt"]).is_err());
    }

    #[test]
    fn quota_get_list_clear() {
        match parse(&["quota", "get", "--json", "/mnt", "overlay/c1"])
            .unwrap()
            .command
        {
            Command::Quota(QuotaArgs {
                command: QuotaCommand::Get(a),
            }) => {
                assert!(a.json);
                assert_eq!(a.path, Path::new("overlay/c1"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&["quota", "list", "/mnt"]).unwrap().command,
            Command::Quota(QuotaArgs {
                command: QuotaCommand::List(_)
            })
        ));
        assert!(matches!(
            parse(&["quota", "clear", "/mnt", "c"]).unwrap().command,
            Command::Quota(QuotaArgs {
                command: QuotaCommand::Clear(_)
            })
        ));
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
