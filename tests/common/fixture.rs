//! What every suite runs: the layerfs binary, and the shipped fixture remote
//! (`fixtures/remote`) with the labels `fixtures/expected.json` gives its objects, so that a
//! test names a layer `L1`, not a 64-digit id.

use std::fs;
use std::path::{Path, PathBuf};

/// The layerfs binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_layerfs");

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `fixtures/expected.json`.
pub fn expected() -> serde_json::Value {
    let text =
        fs::read_to_string(repo().join("fixtures/expected.json")).expect("fixtures/expected.json");
    serde_json::from_str(&text).expect("expected.json parses")
}

/// The id of a fixture object by its label (`L1`…`L5`, `imageA`…).
pub fn id(label: &str) -> String {
    expected()["labels"][label]
        .as_str()
        .unwrap_or_else(|| panic!("no fixture label {label}"))
        .to_owned()
}

pub fn short(label: &str) -> String {
    expected()["layer_shorts"][id(label)]
        .as_str()
        .unwrap_or_else(|| panic!("no short id for {label}"))
        .to_owned()
}

/// The `diff/` dir of a fixture layer in the tree at `root`, for `prepare` to seed.
pub fn diff_in(root: &Path, label: &str) -> PathBuf {
    root.join("overlay/RO").join(id(label)).join("diff")
}

/// From the remote copy `prepare` gets to the local dir of the same mount.
pub fn local_beside(remote: &Path) -> PathBuf {
    remote.parent().expect("remote has a parent").join("local")
}
