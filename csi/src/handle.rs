//! The `bi://` snapshot handle: encode and decode.
//!
//! A handle is `bi://backing?` followed by a URL query with the keys `backingImage`,
//! `backingImageDataSourceType` (`export-from-volume` | `download`), optionally
//! `backingImageChecksum`, and the data-source parameters (`export-type` + `volume-name`, or
//! `url`). Decoding follows URL-query rules: percent-decoding, `+` is a space, the first value
//! of a key wins, key order does not matter, and the host and path are ignored. An unescaped
//! `url=https://host/path` parses too, as Longhorn's tests write it. Encoding writes the keys in
//! a fixed order with every value escaped.

use std::collections::BTreeMap;

use url::form_urlencoded;

use super::error::{CsiError, Result};

pub const SCHEME: &str = "bi";
pub const KEY_IMAGE: &str = "backingImage";
pub const KEY_SOURCE_TYPE: &str = "backingImageDataSourceType";
pub const KEY_CHECKSUM: &str = "backingImageChecksum";
pub const KEY_URL: &str = "url";
pub const KEY_EXPORT_TYPE: &str = "export-type";
pub const KEY_VOLUME_NAME: &str = "volume-name";

pub const SOURCE_EXPORT: &str = "export-from-volume";
pub const SOURCE_DOWNLOAD: &str = "download";

/// A decoded `bi://` handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BiHandle {
    /// `backingImage`: the BackingImage's name as written in the handle.
    pub image: String,
    /// `backingImageDataSourceType`.
    pub source_type: String,
    /// `backingImageChecksum`, when given and non-empty.
    pub checksum: Option<String>,
    /// Every other key: the data-source parameters.
    pub params: BTreeMap<String, String>,
}

impl BiHandle {
    /// The handle of an image exported from `volume` as `export_type`.
    pub fn export(image: &str, export_type: &str, volume: &str) -> BiHandle {
        let mut params = BTreeMap::new();
        params.insert(KEY_EXPORT_TYPE.to_owned(), export_type.to_owned());
        params.insert(KEY_VOLUME_NAME.to_owned(), volume.to_owned());
        BiHandle {
            image: image.to_owned(),
            source_type: SOURCE_EXPORT.to_owned(),
            checksum: None,
            params,
        }
    }

    /// Encodes the handle: `backingImage`, `backingImageDataSourceType`, `export-type`,
    /// `volume-name`, then `url`, the checksum and any other parameter in name order.
    pub fn encode(&self) -> String {
        let mut query = form_urlencoded::Serializer::new(String::new());
        query.append_pair(KEY_IMAGE, &self.image);
        query.append_pair(KEY_SOURCE_TYPE, &self.source_type);
        for key in [KEY_EXPORT_TYPE, KEY_VOLUME_NAME, KEY_URL] {
            if let Some(value) = self.params.get(key) {
                query.append_pair(key, value);
            }
        }
        if let Some(sum) = &self.checksum {
            query.append_pair(KEY_CHECKSUM, sum);
        }
        for (key, value) in &self.params {
            if ![KEY_EXPORT_TYPE, KEY_VOLUME_NAME, KEY_URL].contains(&key.as_str()) {
                query.append_pair(key, value);
            }
        }
        format!("{SCHEME}://backing?{}", query.finish())
    }

    /// Decodes a snapshot id. An id that is no `<type>://…` at all is `NOT_FOUND` (it names
    /// nothing this driver knows); another type than `bi`, or a `bi://` handle without
    /// `backingImage` or `backingImageDataSourceType`, is `INVALID_ARGUMENT`.
    pub fn decode(id: &str) -> Result<BiHandle> {
        let Some((kind, rest)) = id.split_once("://") else {
            return Err(CsiError::NotFound(format!(
                "snapshot id {id:?} is not a layerfs bi:// handle"
            )));
        };
        match kind {
            SCHEME => {}
            "snap" | "bak" | "bs" => {
                return Err(CsiError::InvalidArgument(format!(
                    "snapshot id {id:?} is a Longhorn {kind}:// id; layerfs serves only bi:// \
                     (BackingImage) snapshots"
                )))
            }
            _ => {
                return Err(CsiError::InvalidArgument(format!(
                    "invalid snapshot type {kind:?} in {id:?}; layerfs serves only bi:// handles"
                )))
            }
        }
        let query = rest.split_once('?').map(|(_, q)| q).unwrap_or("");
        let query = query.split_once('#').map(|(q, _)| q).unwrap_or(query);
        let mut values: BTreeMap<String, String> = BTreeMap::new();
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            values
                .entry(key.into_owned())
                .or_insert_with(|| value.into_owned());
        }
        let image = values.remove(KEY_IMAGE).unwrap_or_default();
        let source_type = values.remove(KEY_SOURCE_TYPE).unwrap_or_default();
        let checksum = values.remove(KEY_CHECKSUM).filter(|s| !s.is_empty());
        if image.is_empty() || source_type.is_empty() {
            return Err(CsiError::InvalidArgument(format!(
                "invalid bi:// snapshot handle {id:?}: it needs both {KEY_IMAGE} and {KEY_SOURCE_TYPE}"
            )));
        }
        Ok(BiHandle {
            image,
            source_type,
            checksum,
            params: values,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_handle_round_trips_in_order() {
        let h = BiHandle::export("snap-1", "raw", "pvc-1");
        let s = h.encode();
        assert_eq!(
            s,
            "bi://backing?backingImage=snap-1&backingImageDataSourceType=export-from-volume\
             &export-type=raw&volume-name=pvc-1"
        );
        assert_eq!(BiHandle::decode(&s).unwrap(), h);
    }

    #[test]
    fn decodes_unescaped_and_escaped_urls_any_order_first_wins() {
        let raw = "bi://backing?backingImageDataSourceType=download&backingImage=bi-test\
                   &url=https://host:8080/dir/img.raw&backingImageChecksum=ab&url=http://other";
        let h = BiHandle::decode(raw).unwrap();
        assert_eq!(h.image, "bi-test");
        assert_eq!(h.source_type, "download");
        assert_eq!(h.params[KEY_URL], "https://host:8080/dir/img.raw");
        assert_eq!(h.checksum.as_deref(), Some("ab"));
        let esc = "bi://x/y?url=https%3A%2F%2Fhost%2Fa%20b%2Bc&backingImage=a+b\
                   &backingImageDataSourceType=download";
        let h = BiHandle::decode(esc).unwrap();
        assert_eq!(h.params[KEY_URL], "https://host/a b+c");
        assert_eq!(h.image, "a b");
        let mut again = h.clone();
        again = BiHandle::decode(&again.encode()).unwrap();
        assert_eq!(again, h);
    }

    #[test]
    fn rejects_what_is_not_ours() {
        assert!(matches!(
            BiHandle::decode("garbage"),
            Err(CsiError::NotFound(_))
        ));
        assert!(matches!(
            BiHandle::decode("snap://vol/snap"),
            Err(CsiError::InvalidArgument(_))
        ));
        assert!(matches!(
            BiHandle::decode("bi://backing?backingImage=x"),
            Err(CsiError::InvalidArgument(_))
        ));
        assert!(matches!(
            BiHandle::decode("bi://backing"),
            Err(CsiError::InvalidArgument(_))
        ));
    }
}
