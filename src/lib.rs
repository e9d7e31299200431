//! layerfs: a FUSE filesystem that lets many container hosts share one read-only tree of
//! image layers while each keeps its own read-write data locally.
//!
//! The layers, each depending only on those before it (no module imports one after it):
//!
//! 1. [`store`]: syscalls on the two trees, no-follow and by handle; [`layout`]: the remote
//!    iSulad tree scanned into the index of ready layers and images.
//! 2. [`report`]: the plain facts a mount reports; [`quota`]: limits, accounting and the
//!    containerd-style storage decision; [`journal`]: the publication journal's files;
//!    [`publish`]: a writer host's side of publication (journaling what it makes ready,
//!    copying an image from its own storage into the remote tree). The view reaches quotas through one trait,
//!    [`quota::Accounting`], and is known to it only as [`quota::Object`]s, so the
//!    dependency runs one way.
//! 3. [`view`]: the union of local over remote and the synthesized remote-RO layout.
//! 4. [`notice`]: telling the kernel what to forget, for all that follows.
//! 5. [`fs`]: the FUSE glue, requests to view calls; [`refresh`]: rescans the remote, swaps
//!    the index and tells the kernel what to forget; [`metrics`]: counters and the
//!    Prometheus endpoint.
//! 6. The edge: [`config`] (options), [`mount`], [`keeper`], [`expose`], [`launch`], [`daemon`],
//!    [`inherited`], [`local_lock`], [`logging`] and [`error`] (starting and serving a mount), [`control`]
//!    (the control socket and the commands that use it), [`cli`].
//!
//! The core never depends on [`control`]: the control server calls the mount through
//! [`control::MountControl`] and carries [`report`] types as they are.

pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod error;
pub mod expose;
pub mod fs;
pub mod inherited;
pub mod journal;
pub mod keeper;
pub mod launch;
pub mod layout;
pub mod local_lock;
pub mod logging;
pub mod metrics;
pub mod mount;
pub mod notice;
pub mod publish;
pub mod quota;
pub mod refresh;
pub mod report;
pub mod store;
pub mod view;

pub use config::MountConfig;
pub use error::{Error, Result};
