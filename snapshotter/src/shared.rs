//! Layers the shared tree already holds, found by the OCI chain ID containerd names them by.
//!
//! The view shows a remote layer only once it is complete (DESIGN §4.3), as
//! `<driver>-layers/RO/<id>/layer.json` (its metadata) and `<driver>/RO/<id>/diff` (its
//! files). The directory name says nothing dependable about the content: iSulad names a
//! base layer by its diff ID and every further layer `sha256(parentID + "+" + diffIDhex)`,
//! containers/image does the same, other writers use random ids. So a layer's chain ID is
//! computed from what its `layer.json` records, its `diff-digest` (the OCI diff ID) and
//! its `parent`, down the parent chain.
//!
//! An [`Index`] from chain ID to layer id makes that a lookup. It is rebuilt from the view
//! when a chain ID is not in it (one listing; only new or changed `layer.json` files are
//! read), so a layer published after start is found without a restart, and a removed one
//! drops out. Every answer is checked against the view before it is given: the layer's
//! parent chain is read again and must hash to the chain ID asked for, so an index that
//! lags behind the view never hands out a layer that no longer holds that chain.
//!
//! **Locks.** `index` is held only to clone or swap an `Arc`; the view is read without it,
//! so a stalled remote holds up only the requests that need the view. Two scans may run at
//! once; the one that started last is kept.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The deepest parent chain walked; iSulad's own limit is 128 layers.
const MAX_DEPTH: usize = 1024;

/// The shared layers of a view.
#[derive(Debug)]
pub struct SharedLayers {
    view: PathBuf,
    driver: String,
    index: Mutex<Arc<Index>>,
}

/// A shared layer that holds a chain ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLayer {
    pub id: String,
    /// The chain ID of the layers below it; `None` for a base layer.
    pub parent_chain: Option<String>,
    /// Its files, in the view.
    pub diff: PathBuf,
    /// The size of its files as the writer recorded it (`diff-size`), if it did.
    pub diff_size: Option<u64>,
}

#[derive(Deserialize)]
struct LayerJson {
    id: String,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default, rename = "diff-digest")]
    diff_digest: Option<String>,
    #[serde(default, rename = "diff-size")]
    diff_size: Option<u64>,
}

/// What the view held at one scan.
#[derive(Debug, Default)]
struct Index {
    /// When the scan began: a slower scan that began earlier never replaces it.
    began: Option<Instant>,
    layers: HashMap<String, Entry>,
    /// Chain ID → layer id. Two layers with the same chain are the same content; the
    /// smallest id is kept, so that answers do not change with listing order.
    by_chain: HashMap<String, String>,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Tells whether `layer.json` changed since it was read: (inode, mtime ns, size).
    stamp: (u64, i128, u64),
    parent: Option<String>,
    /// The diff ID's hex; `None` for a layer without one (not an image layer).
    diff: Option<String>,
}

impl SharedLayers {
    pub fn new(view: &Path, driver: &str) -> SharedLayers {
        SharedLayers {
            view: view.to_owned(),
            driver: driver.to_owned(),
            index: Mutex::new(Arc::default()),
        }
    }

    pub fn view(&self) -> &Path {
        &self.view
    }

    /// The shared layer whose chain ID is `chain` (`sha256:<hex>`), if the view has one.
    pub fn find(&self, chain: &str) -> Option<SharedLayer> {
        digest_hex(chain)?;
        let known = self.index.lock().by_chain.get(chain).cloned();
        if let Some(id) = known {
            match self.verified(&id, chain) {
                Some(layer) => return Some(layer),
                // Changed within the timestamp granularity of the view: read it again.
                None => self.forget(&id),
            }
        }
        let id = self.rescan().by_chain.get(chain).cloned()?;
        self.verified(&id, chain)
    }

    /// Reads the view again: the layers it lists now, each `layer.json` read only when new
    /// or changed since the last scan. Returns the new index.
    fn rescan(&self) -> Arc<Index> {
        let began = Instant::now();
        let old = self.index.lock().clone();
        let dir = self.metadata_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot list the shared layers");
                }
                return old;
            }
        };
        let mut layers = HashMap::new();
        for entry in entries.flatten() {
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let path = dir.join(&id).join("layer.json");
            let Ok(st) = fs::metadata(&path) else {
                continue;
            };
            let stamp = (
                st.ino(),
                i128::from(st.mtime()) * 1_000_000_000 + i128::from(st.mtime_nsec()),
                st.size(),
            );
            let entry = match old.layers.get(&id) {
                Some(known) if known.stamp == stamp => known.clone(),
                _ => match self.layer_json(&id) {
                    Some(json) => Entry {
                        stamp,
                        parent: json.parent.filter(|p| !p.is_empty()),
                        diff: json
                            .diff_digest
                            .as_deref()
                            .and_then(digest_hex)
                            .map(str::to_owned),
                    },
                    None => continue,
                },
            };
            layers.insert(id, entry);
        }
        let index = Arc::new(Index {
            began: Some(began),
            by_chain: chains_of(&layers),
            layers,
        });
        let mut current = self.index.lock();
        if current.began.is_none_or(|b| b <= began) {
            *current = index.clone();
        }
        tracing::debug!(
            layers = index.layers.len(),
            chains = index.by_chain.len(),
            "scanned the shared layers"
        );
        index
    }

    /// Drops what the index knows of the layer `id`, so that the next scan reads it again.
    fn forget(&self, id: &str) {
        let mut current = self.index.lock();
        if let Some(known) = current.layers.get(id) {
            let mut index = Index {
                began: current.began,
                layers: current.layers.clone(),
                by_chain: current.by_chain.clone(),
            };
            let stale = Entry {
                stamp: (0, 0, 0),
                ..known.clone()
            };
            index.layers.insert(id.to_owned(), stale);
            *current = Arc::new(index);
        }
    }

    /// The layer `id` as the view holds it now, if its parent chain hashes to `chain` and
    /// its files are there.
    fn verified(&self, id: &str, chain: &str) -> Option<SharedLayer> {
        // Top first: the layer, then its parents.
        let mut diffs = Vec::new();
        let mut top = None;
        let mut next = Some(id.to_owned());
        while let Some(layer) = next {
            if diffs.len() == MAX_DEPTH {
                tracing::warn!(chain, "a shared layer's parent chain is too deep to adopt");
                return None;
            }
            let json = self.layer_json(&layer)?;
            diffs.push(digest_hex(json.diff_digest.as_deref()?)?.to_owned());
            top.get_or_insert(json.diff_size);
            next = json.parent.filter(|p| !p.is_empty());
        }
        let mut chains = chain_ids(diffs.iter().rev().map(String::as_str));
        if chains.pop()? != chain {
            tracing::debug!(
                chain,
                layer = id,
                "a shared layer no longer holds this chain"
            );
            return None;
        }
        let diff = self
            .view
            .join(&self.driver)
            .join("RO")
            .join(id)
            .join("diff");
        if !diff.is_dir() {
            return None;
        }
        Some(SharedLayer {
            id: id.to_owned(),
            parent_chain: chains.pop(),
            diff,
            diff_size: top.flatten(),
        })
    }

    fn metadata_dir(&self) -> PathBuf {
        self.view.join(format!("{}-layers", self.driver)).join("RO")
    }

    fn layer_json(&self, id: &str) -> Option<LayerJson> {
        // Ids come from the view's listing or an index built from it, and are checked
        // against the file, so none names a path outside the layer directories.
        if id.is_empty() || id.contains('/') || id == "." || id == ".." {
            return None;
        }
        let path = self.metadata_dir().join(id).join("layer.json");
        let json: LayerJson = serde_json::from_slice(&fs::read(&path).ok()?)
            .inspect_err(
                |e| tracing::warn!(path = %path.display(), error = %e, "unreadable layer.json"),
            )
            .ok()?;
        (json.id == id).then_some(json)
    }
}

/// The chain ID of every layer of `layers` whose parent chain is complete, computed without
/// recursion (a chain may be as deep as the remote makes it) and ending at cycles.
fn chains_of(layers: &HashMap<String, Entry>) -> HashMap<String, String> {
    let mut chain_of: HashMap<&str, Option<String>> = HashMap::new();
    for start in layers.keys() {
        // Walk down to a layer whose chain is known (or a base), then fill in upwards.
        let mut path: Vec<&str> = Vec::new();
        let mut at = Some(start.as_str());
        let mut below: Option<String> = None;
        while let Some(id) = at {
            if let Some(known) = chain_of.get(id) {
                below = known.clone();
                break;
            }
            if path.len() == MAX_DEPTH || path.contains(&id) {
                // Too deep or a cycle: nothing on this path has a chain.
                below = None;
                at = None;
                path.iter().for_each(|p| {
                    chain_of.insert(*p, None);
                });
                path.clear();
                continue;
            }
            path.push(id);
            match layers.get(id) {
                Some(Entry {
                    parent: Some(parent),
                    ..
                }) => {
                    at = layers
                        .get_key_value(parent.as_str())
                        .map(|(k, _)| k.as_str());
                    if at.is_none() {
                        // A parent the view does not list: no chain until it appears.
                        below = None;
                        path.iter().for_each(|p| {
                            chain_of.insert(*p, None);
                        });
                        path.clear();
                    }
                }
                _ => {
                    // A base layer: its chain is its own diff ID.
                    at = None;
                    below = Some(String::new());
                }
            }
        }
        for id in path.into_iter().rev() {
            let chain = below.as_ref().and_then(|below| {
                let diff = layers.get(id)?.diff.as_deref()?;
                Some(match below.is_empty() {
                    true => format!("sha256:{diff}"),
                    false => chain_step(below, diff),
                })
            });
            chain_of.insert(id, chain.clone());
            below = chain;
        }
    }
    let mut by_chain: HashMap<String, String> = HashMap::new();
    for (id, chain) in chain_of {
        if let Some(chain) = chain {
            let slot = by_chain.entry(chain).or_insert_with(|| id.to_owned());
            if id < slot.as_str() {
                *slot = id.to_owned();
            }
        }
    }
    by_chain
}

/// The chain IDs of a stack of layers given by their diff IDs (hex, base first), one per
/// layer: ChainID(L0) = DiffID(L0), ChainID(L0..n) = sha256 of "ChainID(L0..n-1) DiffID(Ln)".
pub fn chain_ids<'a>(diffs: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for diff in diffs {
        let id = match out.last() {
            None => format!("sha256:{diff}"),
            Some(below) => chain_step(below, diff),
        };
        out.push(id);
    }
    out
}

/// The chain ID of a layer with diff ID hex `diff` over the chain `below`.
fn chain_step(below: &str, diff: &str) -> String {
    let sum = Sha256::digest(format!("{below} sha256:{diff}").as_bytes());
    format!("sha256:{}", hex(&sum))
}

/// The hex of a `sha256:<64 lowercase hex>` digest; `None` for anything else, so that no
/// label or file can name a path outside the layer directories.
pub fn digest_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    let ok = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    ok.then_some(hex)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";
    const D3: &str = "3333333333333333333333333333333333333333333333333333333333333333";

    fn write_layer(view: &Path, id: &str, parent: Option<&str>, diff: &str) {
        let meta = view.join("overlay-layers/RO").join(id);
        fs::create_dir_all(&meta).unwrap();
        let parent = parent
            .map(|p| format!(",\"parent\":\"{p}\""))
            .unwrap_or_default();
        let json = format!(
            "{{\"id\":\"{id}\",\"diff-digest\":\"sha256:{diff}\",\"diff-size\":7{parent}}}"
        );
        fs::write(meta.join("layer.json"), json).unwrap();
        fs::create_dir_all(view.join("overlay/RO").join(id).join("diff")).unwrap();
    }

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let chains = chain_ids([D1, D2].into_iter());
        assert_eq!(chains[0], format!("sha256:{D1}"));
        let text = format!("sha256:{D1} sha256:{D2}");
        assert_eq!(chains[1], format!("sha256:{}", hex(&Sha256::digest(text))));
    }

    /// iSulad's name for a layer: the diff ID for a base layer, else
    /// `sha256(parentID + "+" + diffIDhex)`.
    fn isulad_id(parent: Option<&str>, diff: &str) -> String {
        match parent {
            None => diff.to_owned(),
            Some(p) => hex(&Sha256::digest(format!("{p}+{diff}"))),
        }
    }

    #[test]
    fn a_layer_is_found_by_its_content_whatever_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        let view = tmp.path();
        let chains = chain_ids([D1, D2, D3].into_iter());
        // iSulad's names, and a random one on top of a second image sharing the base.
        let base = isulad_id(None, D1);
        let mid = isulad_id(Some(&base), D2);
        let top = isulad_id(Some(&mid), D3);
        write_layer(view, &base, None, D1);
        write_layer(view, &mid, Some(&base), D2);
        write_layer(view, &top, Some(&mid), D3);
        let other = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        write_layer(view, other, Some(&base), D3);
        let shared = SharedLayers::new(view, "overlay");

        for (chain, id) in chains.iter().zip([&base, &mid, &top]) {
            let found = shared.find(chain).unwrap();
            assert_eq!(&found.id, id);
        }
        let found = shared.find(&chains[2]).unwrap();
        assert_eq!(found.parent_chain.as_deref(), Some(chains[1].as_str()));
        assert_eq!(found.diff, view.join("overlay/RO").join(&top).join("diff"));
        assert_eq!(found.diff_size, Some(7));
        let over_base = chain_ids([D1, D3].into_iter()).pop().unwrap();
        assert_eq!(shared.find(&over_base).unwrap().id, other);

        // Unknown, malformed, or a path in disguise: nothing.
        assert_eq!(shared.find(&format!("sha256:{D2}")), None);
        assert_eq!(shared.find("sha256:../../etc"), None);
        assert_eq!(shared.find(&top), None);
    }

    #[test]
    fn the_index_follows_the_view() {
        let tmp = tempfile::tempdir().unwrap();
        let view = tmp.path();
        let chains = chain_ids([D1, D2].into_iter());
        let base = isulad_id(None, D1);
        let top = isulad_id(Some(&base), D2);
        let shared = SharedLayers::new(view, "overlay");
        // Asked before the view has anything: a later layer is still found.
        assert_eq!(shared.find(&chains[1]), None);
        write_layer(view, &base, None, D1);
        write_layer(view, &top, Some(&base), D2);
        assert_eq!(shared.find(&chains[1]).unwrap().id, top);

        // A layer whose content changes stops holding its old chain.
        write_layer(view, &top, Some(&base), D1);
        assert_eq!(shared.find(&chains[1]), None);
        let changed = chain_ids([D1, D1].into_iter()).pop().unwrap();
        assert_eq!(shared.find(&changed).unwrap().id, top);

        // Nor is a layer found once its files or its metadata are gone.
        write_layer(view, &top, Some(&base), D2);
        fs::remove_dir(view.join("overlay/RO").join(&top).join("diff")).unwrap();
        assert_eq!(shared.find(&chains[1]), None);
        fs::remove_dir_all(view.join("overlay-layers/RO").join(&base)).unwrap();
        assert_eq!(shared.find(&chains[0]), None);
        assert!(
            shared.rescan().by_chain.is_empty(),
            "no chain without the base"
        );
    }

    #[test]
    fn a_parent_cycle_ends() {
        let tmp = tempfile::tempdir().unwrap();
        write_layer(tmp.path(), "a", Some("b"), D1);
        write_layer(tmp.path(), "b", Some("a"), D2);
        let shared = SharedLayers::new(tmp.path(), "overlay");
        assert_eq!(shared.find(&format!("sha256:{D1}")), None);
        assert!(shared.rescan().by_chain.is_empty());
    }

    #[test]
    fn a_deep_chain_is_indexed_without_recursion() {
        let tmp = tempfile::tempdir().unwrap();
        let depth = 300;
        let mut parent: Option<String> = None;
        for i in 0..depth {
            let id = format!("{i:064x}");
            write_layer(tmp.path(), &id, parent.as_deref(), D1);
            parent = Some(id);
        }
        let shared = SharedLayers::new(tmp.path(), "overlay");
        assert_eq!(shared.rescan().by_chain.len(), depth);
        let top = chain_ids(std::iter::repeat_n(D1, depth)).pop().unwrap();
        assert_eq!(shared.find(&top).unwrap().id, format!("{:064x}", depth - 1));
    }
}
