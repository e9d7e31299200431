//! Publishing into a shared remote tree from a writer host (DESIGN §14).

pub mod watch;
