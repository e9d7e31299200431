//! `layerfs-snapshotter`: a containerd proxy snapshotter on a layerfs mount (DESIGN §12).
//!
//! containerd talks to it over a unix socket with its `Snapshots` API ([`service`]); the
//! snapshots themselves ([`snapshots`]) are directories ([`dirs`]: in the view for a
//! snapshot with a quota, on the local disk directly otherwise), mounted by containerd as
//! kernel overlays ([`mounts`]), recorded in one table ([`meta`]). Two things make it more
//! than containerd's overlay snapshotter:
//!
//! - **Shared layers** ([`shared`]): a layer the shared tree already holds, found by its
//!   content whatever its directory is called, is adopted
//!   through containerd's remote-snapshot protocol instead of being fetched and unpacked,
//!   and a layer unpacked anyway is replaced by the shared copy when it is committed.
//! - **Quotas** ([`quota`]): an active snapshot becomes a layerfs quota root when its
//!   labels ask for one, decided by layerfs's own quota core.
//!
//! [`config`] reads the command line and the configuration file; [`metrics`] counts the
//! calls for the Prometheus endpoint.
//!
//! This crate holds the gRPC stack; the FUSE daemon (`layerfs`) links none of it.

pub mod api;
pub mod config;
pub mod dirs;
pub mod error;
pub mod filter;
pub mod meta;
pub mod metrics;
pub mod mounts;
pub mod quota;
pub mod service;
pub mod shared;
pub mod snapshots;
pub mod tree;

pub use error::Error;
pub use snapshots::{Config, Snapshots};
