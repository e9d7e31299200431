//! The shared test kit. A suite mounts the shipped fixture remote with [`Mount`] (a copy in a
//! temp dir, an empty local, unmounted on drop even when the test panics, the remote checked
//! byte for byte afterwards) or trees of its own with [`RawMount`], reads what the view shows
//! with the tree and file helpers, and waits with [`eventually`] rather than sleeping. Suites
//! that need iSulad's objects in the remote write them with [`isulad`].

#![allow(dead_code)]

mod files;
mod fixture;
pub mod isulad;
mod kernel;
mod mount;
mod poll;
mod process;

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
};
