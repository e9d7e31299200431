//! The shared test kit. A suite mounts the shipped fixture remote with [`Mount`] (a copy in a
//! temp dir, an empty local, unmounted on drop even when the test panics, the remote checked
//! byte for byte afterwards) or trees of its own with [`RawMount`], reads what the view shows
//! with the tree and file helpers, and waits with [`eventually`] rather than sleeping. Suites
//! that play the writer host build its tree with [`isulad`], named and written as iSulad does.
//!
//! `use common::*` brings everything but the parts with a vocabulary of their own, which a
//! suite names when it needs them: [`isulad`] (the writer host's model), [`scenario`] (rounds
//! on demand and what the view must show of that model) and [`sys`] (raw system calls).

#![allow(dead_code)]

mod files;
mod fixture;
pub mod isulad;
mod kernel;
mod mount;
mod poll;
mod process;
pub mod scenario;
pub mod sys;
mod watchdog;

// Each suite uses a part of the kit; what one leaves unused is not dead.
#[allow(unused_imports)]
pub use self::{
    files::*,
    fixture::*,
    isulad::{image_json, tar_split_gz, write_atomic, write_base_layer, write_image},
    kernel::*,
    mount::*,
    poll::*,
    process::*,
    watchdog::*,
};
