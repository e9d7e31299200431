//! The names layerfs keeps for its own bookkeeping in local: temporary files (copy-up,
//! atomic replaces), the quota registry, the file handle records, and the directory the
//! containerd snapshotter keeps unlimited snapshots in (they live on the local disk
//! directly, beside what the view serves, not in it). The view never shows them and
//! refuses to create them; the quota scan skips them.

use std::sync::OnceLock;

/// Prefix of the temporary names made in local; see [`temp_prefix`].
const TEMP_BASE: &[u8] = b".layerfs-tmp.";
static TEMP_PREFIX: OnceLock<Vec<u8>> = OnceLock::new();
/// The quota registry's name (see `quota::persist`).
pub const REGISTRY_NAME: &[u8] = b".layerfs-quota.json";
/// The file handle records' name (see `view::exports`).
pub const EXPORTS_NAME: &[u8] = b".layerfs-exports";
/// The snapshotter's own directory in local (see `layerfs-snapshotter`, DESIGN §12).
pub const SNAPSHOTTER_NAME: &[u8] = b".layerfs-snapshotter";

/// Tags the temporary names of this process's view with `tag` (its local root's inode
/// number): another layerfs whose local lies in this view then has temporary names of its
/// own, which this one neither hides nor refuses. Only the first call counts.
pub fn tag_temp_names(tag: u64) {
    let _ = TEMP_PREFIX.set([TEMP_BASE, format!("{tag:x}.").as_bytes()].concat());
}

/// `.layerfs-tmp.<tag>.`: the prefix of the view's temporary names in local.
pub fn temp_prefix() -> &'static [u8] {
    TEMP_PREFIX.get().map_or(TEMP_BASE, Vec::as_slice)
}

/// The view's own bookkeeping in local (temporary files, the quota registry, the file
/// handle records): never visible in the view, never creatable through it.
pub fn is_reserved_name(name: &[u8]) -> bool {
    name.starts_with(temp_prefix())
        || name == REGISTRY_NAME
        || name == EXPORTS_NAME
        || name == SNAPSHOTTER_NAME
}
