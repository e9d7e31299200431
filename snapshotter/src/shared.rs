//! Layers the shared tree already holds, found by the OCI chain ID containerd names them by.
//!
//! The view shows a remote layer only once it is complete (DESIGN §4.3), as
//! `<driver>-layers/RO/<id>/layer.json` (its metadata) and `<driver>/RO/<id>/diff` (its
//! files). iSulad names an image layer by its chain ID's hex, and records its `parent` and
//! its uncompressed digest (`diff-digest`, the OCI diff ID). A layer is taken for a chain
//! ID only when the diff IDs down its parent chain hash to exactly that chain ID, so a
//! layer whose name and content disagree is never adopted.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The deepest parent chain walked; iSulad's own limit is 128 layers.
const MAX_DEPTH: usize = 1024;

/// The shared layers of a view.
#[derive(Debug, Clone)]
pub struct SharedLayers {
    view: PathBuf,
    driver: String,
}

/// A shared layer that holds a chain ID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedLayer {
    pub id: String,
    /// The chain ID of the layers below it; `None` for a base layer.
    pub parent_chain: Option<String>,
    /// Its files, in the view.
    pub diff: PathBuf,
}

#[derive(Deserialize)]
struct LayerJson {
    id: String,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default, rename = "diff-digest")]
    diff_digest: Option<String>,
}

impl SharedLayers {
    pub fn new(view: &Path, driver: &str) -> SharedLayers {
        SharedLayers {
            view: view.to_owned(),
            driver: driver.to_owned(),
        }
    }

    pub fn view(&self) -> &Path {
        &self.view
    }

    /// The shared layer whose chain ID is `chain` (`sha256:<hex>`), if the view has one.
    pub fn find(&self, chain: &str) -> Option<SharedLayer> {
        let id = digest_hex(chain)?;
        // Top first: the requested layer, then its parents.
        let mut diffs = Vec::new();
        let mut next = Some(id.to_owned());
        while let Some(layer) = next {
            if diffs.len() == MAX_DEPTH {
                tracing::warn!(chain, "a shared layer's parent chain is too deep to adopt");
                return None;
            }
            let json = self.layer_json(&layer)?;
            diffs.push(digest_hex(json.diff_digest.as_deref()?)?.to_owned());
            next = json.parent.filter(|p| !p.is_empty());
        }
        let mut chains = chain_ids(diffs.iter().rev().map(String::as_str));
        let top = chains.pop()?;
        if top != chain {
            tracing::debug!(
                chain,
                layer = id,
                found = top,
                "a shared layer named by another chain"
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
        })
    }

    fn layer_json(&self, id: &str) -> Option<LayerJson> {
        let path = self
            .view
            .join(format!("{}-layers", self.driver))
            .join("RO")
            .join(id)
            .join("layer.json");
        let json: LayerJson = serde_json::from_slice(&fs::read(&path).ok()?)
            .inspect_err(
                |e| tracing::warn!(path = %path.display(), error = %e, "unreadable layer.json"),
            )
            .ok()?;
        (json.id == id).then_some(json)
    }
}

/// The chain IDs of a stack of layers given by their diff IDs (hex, base first), one per
/// layer: ChainID(L0) = DiffID(L0), ChainID(L0..n) = sha256 of "ChainID(L0..n-1) DiffID(Ln)".
pub fn chain_ids<'a>(diffs: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for diff in diffs {
        let id = match out.last() {
            None => format!("sha256:{diff}"),
            Some(below) => {
                let sum = Sha256::digest(format!("{below} sha256:{diff}").as_bytes());
                format!("sha256:{}", hex(&sum))
            }
        };
        out.push(id);
    }
    out
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

    fn write_layer(view: &Path, id: &str, parent: Option<&str>, diff: &str) {
        let meta = view.join("overlay-layers/RO").join(id);
        fs::create_dir_all(&meta).unwrap();
        let parent = parent
            .map(|p| format!(",\"parent\":\"{p}\""))
            .unwrap_or_default();
        let json = format!("{{\"id\":\"{id}\",\"diff-digest\":\"sha256:{diff}\"{parent}}}");
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

    #[test]
    fn a_layer_is_found_only_when_its_chain_matches() {
        let tmp = tempfile::tempdir().unwrap();
        let view = tmp.path();
        let chains = chain_ids([D1, D2].into_iter());
        let base = digest_hex(&chains[0]).unwrap();
        let top = digest_hex(&chains[1]).unwrap();
        write_layer(view, base, None, D1);
        write_layer(view, top, Some(base), D2);
        let shared = SharedLayers::new(view, "overlay");

        let found = shared.find(&chains[1]).unwrap();
        assert_eq!(found.id, top);
        assert_eq!(found.parent_chain.as_deref(), Some(chains[0].as_str()));
        assert_eq!(found.diff, view.join("overlay/RO").join(top).join("diff"));
        assert_eq!(shared.find(&chains[0]).unwrap().parent_chain, None);

        // Unknown, malformed, or a path in disguise: nothing.
        assert_eq!(shared.find(&format!("sha256:{D2}")), None);
        assert_eq!(shared.find("sha256:../../etc"), None);
        assert_eq!(shared.find(top), None);

        // A layer whose content hashes to another chain than its name says is not adopted.
        write_layer(view, top, Some(base), D1);
        assert_eq!(shared.find(&chains[1]), None);

        // Nor one whose files are missing.
        write_layer(view, top, Some(base), D2);
        fs::remove_dir(view.join("overlay/RO").join(top).join("diff")).unwrap();
        assert_eq!(shared.find(&chains[1]), None);
    }

    #[test]
    fn a_parent_cycle_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let a = digest_hex(&chain_ids([D1].into_iter())[0])
            .unwrap()
            .to_owned();
        write_layer(tmp.path(), &a, Some(&a), D1);
        assert_eq!(
            SharedLayers::new(tmp.path(), "overlay").find(&format!("sha256:{a}")),
            None
        );
    }
}
