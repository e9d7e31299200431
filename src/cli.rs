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
        }
    }
}
