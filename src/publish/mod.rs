//! Publishing into a shared remote tree from a writer host (DESIGN §14): [`watch`] journals
//! what the host's runtime makes ready, so readers see it at once; [`image`] copies one image
//! from the host's own iSulad storage into the remote, atomically and crash-safe.

pub mod image;
pub mod watch;

mod chain;
mod copy;
mod error;
mod place;
mod remote;
mod source;

pub use error::PublishError;
