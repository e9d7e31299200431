//! The `layerfs` command line.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{MountConfig, OPTIONS};
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
    /// Serve the CSI driver (volumes and BackingImage snapshots) on a unix socket.
    Csi(CsiArgs),
    /// Show a running mount's state: remote health, the last refresh round, and why each
    /// object that is not shown is not ready.
    Status(ControlArgs),
    /// Run a refresh round on a running mount now, and show what it changed.
    Refresh(ControlArgs),
    /// List a running mount's ready layers.
    Layers(ControlArgs),
    /// List a running mount's ready images.
    Images(ControlArgs),
    /// Unmount a layerfs mount and wait until its daemon has finished.
    Umount(UmountArgs),
}

#[derive(Debug, Args)]
pub struct UmountArgs {
    /// Seconds to wait for the daemon to finish after the unmount.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub wait: u64,
    /// The mount to stop.
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

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LinkStyleArg {
    Absolute,
    Relative,
}

#[derive(Debug, Args)]
#[command(after_help = OPTIONS)]
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

#[derive(Debug, Args)]
pub struct CsiArgs {
    /// The gRPC endpoint: a unix socket, `unix:///path/csi.sock`.
    #[arg(
        long,
        value_name = "ENDPOINT",
        default_value = "unix:///run/layerfs/csi.sock"
    )]
    pub endpoint: String,
    /// This node's name (Kubernetes passes the node name).
    #[arg(long, value_name = "NAME")]
    pub node_id: String,
    /// The local store: volumes live in `<DIR>/volumes`.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/layerfs/csi")]
    pub store: PathBuf,
    /// Where BackingImages live; a directory every node shares makes them visible to all.
    /// Default: `<store>/backing-images`.
    #[arg(long, value_name = "DIR")]
    pub backing_images: Option<PathBuf>,
    /// The driver name reported to Kubernetes.
    #[arg(long, value_name = "NAME", default_value = crate::csi::DRIVER_NAME)]
    pub driver_name: String,
    /// Seconds CreateVolume waits for a BackingImage being prepared before it answers ABORTED
    /// (and the caller retries).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub image_wait: u64,
    /// Allow `file://` download URLs, for regular files below DIR only. Without it they are
    /// refused: the driver runs as root and would read any host file.
    #[arg(long, value_name = "DIR")]
    pub file_root: Option<PathBuf>,
    /// Refuse http(s) download URLs whose host is a loopback, link-local or private address.
    #[arg(long)]
    pub deny_private_urls: bool,
    /// The largest image a download may produce, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = crate::csi::download::DEFAULT_MAX_SIZE)]
    pub max_image_size: u64,
    /// Seconds a download may receive nothing before it fails.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub download_idle_timeout: u64,
}

impl CsiArgs {
    pub fn into_config(self) -> crate::csi::Config {
        let backing_images = self
            .backing_images
            .unwrap_or_else(|| self.store.join("backing-images"));
        crate::csi::Config {
            endpoint: self.endpoint,
            node_id: self.node_id,
            driver_name: self.driver_name,
            store: self.store,
            backing_images,
            image_wait: std::time::Duration::from_secs(self.image_wait),
            file_root: self.file_root,
            deny_private_urls: self.deny_private_urls,
            max_image_size: self.max_image_size,
            download_idle_timeout: std::time::Duration::from_secs(self.download_idle_timeout),
        }
    }
}
