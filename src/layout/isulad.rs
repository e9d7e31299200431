//! iSulad's on-disk vocabulary: the JSON records it writes and the shapes of its names.
//!
//! Only the fields the readiness rules need are declared; everything else in the files is
//! ignored, so a writer that adds fields (or a containers-storage writer with its own extras)
//! does not make objects unreadable. Optional fields are `Option` so that an explicit `null`
//! reads the same as an absent key.

use std::collections::HashMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use serde::Deserialize;

/// Length of a layer or image id: the hex of a sha256 digest.
const ID_LEN: usize = 64;

/// Length of a short link id, whether iSulad (hex) or containers-storage (base32) wrote it.
const SHORT_LEN: usize = 26;

/// `<driver>-layers/RO/<id>/layer.json`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct LayerJson {
    pub id: Option<String>,
    pub parent: Option<String>,
    #[serde(rename = "diff-digest")]
    pub diff_digest: Option<String>,
    /// iSulad's spelling: set before the diff is applied, cleared after.
    pub incompelte: Option<bool>,
    pub incomplete: Option<bool>,
    /// containers-storage keeps free-form flags; `incomplete` is the one that matters here.
    pub flags: Option<HashMap<String, serde_json::Value>>,
}

impl LayerJson {
    /// The parent id, treating an empty string like an absent key (a base layer).
    pub fn parent(&self) -> Option<&str> {
        self.parent.as_deref().filter(|p| !p.is_empty())
    }

    /// Whether the layer carries a diff and therefore needs its tar-split file.
    pub fn has_diff_digest(&self) -> bool {
        self.diff_digest.as_deref().is_some_and(|d| !d.is_empty())
    }

    /// Whether any of the spellings writers use marks the layer as still being written.
    pub fn is_incomplete(&self) -> bool {
        let flagged = self
            .flags
            .as_ref()
            .and_then(|flags| flags.get("incomplete"))
            .is_some_and(|v| v.as_bool() == Some(true));
        self.incompelte == Some(true) || self.incomplete == Some(true) || flagged
    }
}

/// `<driver>-images/<id>/images.json`: one image object despite the plural name.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct ImageJson {
    pub id: Option<String>,
    pub names: Option<Vec<String>>,
    /// The top layer: the only link from an image to its layers.
    pub layer: Option<String>,
}

/// A layer or image id: exactly 64 lowercase hex digits, as both iSulad and
/// containers-storage name their object directories.
pub(crate) fn is_object_id(name: &str) -> bool {
    name.len() == ID_LEN && name.bytes().all(is_lower_hex)
}

/// A short link id: 26 lowercase hex (iSulad) or 26 uppercase base32 (containers-storage).
/// Mixing the two alphabets is neither writer's output, so it is rejected.
pub(crate) fn is_short_id(s: &str) -> bool {
    s.len() == SHORT_LEN
        && (s.bytes().all(is_lower_hex)
            || s.bytes().all(|b| matches!(b, b'A'..=b'Z' | b'2'..=b'7')))
}

fn is_lower_hex(b: u8) -> bool {
    matches!(b, b'0'..=b'9' | b'a'..=b'f')
}

/// Strips the single trailing newline that hand-written or test trees often carry.
pub(crate) fn strip_one_newline(s: &str) -> &str {
    s.strip_suffix('\n').unwrap_or(s)
}

/// Splits a `lower` file (`l/<a>:l/<b>:…`) into its short ids.
///
/// Every entry must be `l/` followed by a well-formed short id: anything else would make the
/// kernel stack a directory the metadata knows nothing about.
pub(crate) fn parse_lower(content: &str) -> Result<Vec<String>, String> {
    let content = strip_one_newline(content);
    if content.is_empty() {
        return Err("empty".to_owned());
    }
    content
        .split(':')
        .enumerate()
        .map(|(i, entry)| match entry.strip_prefix("l/") {
            Some(short) if is_short_id(short) => Ok(short.to_owned()),
            _ => Err(format!("entry {} is not of the form l/<short id>", i + 1)),
        })
        .collect()
}

/// The file holding an image's config: big-data key `sha256:<id>`, which is not plain
/// `[a-z0-9.]`, so it is stored as `=` followed by the standard base64 of the key.
pub(crate) fn config_file_name(image_id: &str) -> String {
    format!("={}", STANDARD.encode(format!("sha256:{image_id}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_of_both_writers() {
        assert!(is_short_id("c3343428f60aab9c86d24293f6"));
        assert!(is_short_id("ABCDEFGHIJKLMNOPQRSTUVWXY2"));
        assert!(!is_short_id("c3343428f60aab9c86d24293f")); // 25
        assert!(!is_short_id("C3343428F60AAB9C86D24293F6")); // upper hex: 0/1/8/9 not base32
        assert!(!is_short_id("abcdefghijklmnopqrstuvwxy2")); // lower base32
        assert!(!is_short_id("ABCDEFGHIJKLMNOPQRSTUVWXYa")); // mixed alphabets
    }

    #[test]
    fn config_name_matches_isulad_fixture() {
        let id = "39891ff67da98ab8540d71320915f33d2eb80ab42908e398472cab3c1ce7ac10";
        let name = config_file_name(id);
        assert!(name.starts_with("=c2hhMjU2OjM5ODkx"), "{name}");
        assert!(name.ends_with("MTA="), "{name}");
    }

    #[test]
    fn incomplete_spellings() {
        let parse = |s: &str| serde_json::from_str::<LayerJson>(s).map(|l| l.is_incomplete());
        assert!(matches!(parse(r#"{"incompelte":true}"#), Ok(true)));
        assert!(matches!(parse(r#"{"incomplete":true}"#), Ok(true)));
        assert!(matches!(
            parse(r#"{"flags":{"incomplete":true}}"#),
            Ok(true)
        ));
        assert!(matches!(
            parse(r#"{"incompelte":false,"flags":{"x":1}}"#),
            Ok(false)
        ));
        assert!(matches!(parse(r#"{"parent":null,"id":null}"#), Ok(false)));
    }

    #[test]
    fn lower_entries() {
        let a = "c3343428f60aab9c86d24293f6";
        let b = "ABCDEFGHIJKLMNOPQRSTUVWXY2";
        let parsed = parse_lower(&format!("l/{a}:l/{b}\n"));
        assert_eq!(parsed, Ok(vec![a.to_owned(), b.to_owned()]));
        assert!(parse_lower("").is_err());
        assert!(parse_lower(&format!("l/{a}::l/{b}")).is_err());
        assert!(parse_lower(a).is_err());
        assert!(parse_lower(&format!("l/{a}\n\n")).is_err());
    }
}
