//! Publication into a shared remote tree from a writer host: [`image`] copies one image from
//! the host's own iSulad storage into the remote, atomically and crash-safe.

pub mod image;

mod chain;
mod copy;
mod error;
mod place;
mod remote;
mod source;

pub use error::PublishError;
