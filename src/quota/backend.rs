//! Who enforces a quota root (see `kernel`): the values configuration, the registry and
//! reports name.

use serde::{Deserialize, Serialize};

/// Which backend new quota roots get (`quota_backend=`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Choice {
    /// btrfs where local is on btrfs and the limit is one btrfs can express, else FUSE.
    #[default]
    Auto,
    Fuse,
    Btrfs,
}

impl Choice {
    pub fn parse(text: &str) -> Option<Choice> {
        match text.to_ascii_lowercase().as_str() {
            "auto" => Some(Choice::Auto),
            "fuse" => Some(Choice::Fuse),
            "btrfs" => Some(Choice::Btrfs),
            _ => None,
        }
    }
}

/// Who enforces a root's limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The daemon, on every call that allocates; files in the root lose passthrough.
    #[default]
    Fuse,
    /// The btrfs qgroup of the subvolume the root is.
    Btrfs,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Fuse => "fuse",
            Backend::Btrfs => "btrfs",
        }
    }
}
