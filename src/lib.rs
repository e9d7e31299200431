//! layerfs: a FUSE filesystem that lets many container hosts share one read-only tree of
//! image layers while each keeps its own read-write data locally.
//!
//! The data path: [`fs`] (FUSE glue) → [`view`] (union of local over remote, and the
//! synthesized iSulad remote-RO layout) → [`store`] (safe access to the trees on disk).
//! [`layout`] scans the remote tree into the index of ready layers and images the view
//! shows. [`config`] holds a mount's options, [`mount`] serves one, [`daemon`] detaches.
//! [`control`] answers `layerfs status`, `refresh`, `layers` and `images` over a mount's
//! socket. [`metrics`] serves Prometheus metrics with `-o metrics=ADDR:PORT`.

pub mod cli;
pub mod config;
pub mod control;
pub mod daemon;
pub mod error;
pub mod fs;
pub mod launch;
pub mod layout;
pub mod local_lock;
pub mod logging;
pub mod metrics;
pub mod mount;
pub mod quota;
pub mod refresh;
pub mod report;
pub mod store;
pub mod view;

pub use config::MountConfig;
pub use error::{Error, Result};
