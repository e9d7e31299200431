//! Layer identity by content: the OCI chain ID.
//!
//! A layer's directory name says nothing dependable about its content. iSulad names a base
//! layer by its diff ID and every further one `sha256(parentIDhex + "+" + diffIDhex)`;
//! containers-storage and the OCI tools use the chain ID
//! `sha256("<parent chain ID> <diff ID>")`; other writers use random ids. The chain ID, by
//! contrast, follows from what each `layer.json` records (`diff-digest`, the OCI diff ID)
//! down the `parent` chain, so two layers with the same chain ID hold the same files over
//! the same parents, whatever they are called.

use sha2::{Digest, Sha256};

/// The chain ID (`sha256:<hex>`) of a layer with diff ID `diff` (`sha256:<hex>`) over the
/// layers whose chain ID is `below`; `None` when `diff` is not a sha256 digest.
pub(crate) fn chain_id(below: Option<&str>, diff: &str) -> Option<String> {
    digest_hex(diff)?;
    Some(match below {
        None => diff.to_owned(),
        Some(below) => {
            let sum = Sha256::digest(format!("{below} {diff}").as_bytes());
            format!("sha256:{}", hex(&sum))
        }
    })
}

/// The hex of a `sha256:<64 lowercase hex>` digest; `None` for anything else.
pub(crate) fn digest_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    let ok = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    ok.then_some(hex)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:1493467ad4be5c54729bcacea19006078604b634f31405d7af3aa9d264bde610";
    const D2: &str = "sha256:b5b0a8c1d1f3f7d1e2e8f1a7c0b6a5d4c3b2a1f0e9d8c7b6a5f4e3d2c1b0a998";

    #[test]
    fn a_base_layer_is_its_diff_id() {
        assert_eq!(chain_id(None, D1).as_deref(), Some(D1));
    }

    #[test]
    fn a_child_follows_the_oci_definition() {
        let text = format!("{D1} {D2}");
        let want = format!("sha256:{}", hex(&Sha256::digest(text)));
        assert_eq!(chain_id(Some(D1), D2), Some(want));
    }

    #[test]
    fn only_sha256_digests_count() {
        assert_eq!(chain_id(None, "md5:abc"), None);
        assert_eq!(chain_id(None, "sha256:ABC"), None);
        assert_eq!(chain_id(Some(D1), ""), None);
    }
}
