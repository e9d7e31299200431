//! The image to publish, as the host's own iSulad storage holds it.
//!
//! An image is found by its id, a unique prefix of it, or one of its names. Its layers are
//! the chain from `images.json`'s `layer` down the `parent` fields of each `layer.json`. A
//! writer host keeps a layer either in `<driver>/RO/<id>/` (the remote layer store, reached
//! through a `<driver>/<id>` symlink) or in a real `<driver>/<id>/`; both are accepted, the
//! symlink followed because the host's runtime made it. The image is then judged by the
//! readiness rules a reader applies (DESIGN §4.3): a source that a reader would not take as
//! ready is refused, with the reason.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::chain::chain_id;
use super::error::{io_at, PublishError, Result};
use crate::layout::{is_object_id, LayoutIndex, ObjectDirs, MAX_LOWER_DEPTH};

/// JSON metadata larger than this is not iSulad's.
pub(crate) const JSON_CAP: u64 = 16 << 20;

/// One layer of the image, as the source holds it.
#[derive(Debug, Clone)]
pub(crate) struct SourceLayer {
    pub id: String,
    pub parent: Option<String>,
    /// The OCI chain ID; `None` when this layer or one below it has no `diff-digest`.
    pub chain: Option<String>,
    /// The content of `link`.
    pub short: String,
    pub overlay_dir: PathBuf,
    pub meta_dir: PathBuf,
    /// `layer.json` as read, and parsed.
    pub json_bytes: Vec<u8>,
    pub json: Value,
}

/// The image to publish, judged ready, with its layers base first.
#[derive(Debug, Clone)]
pub(crate) struct SourceImage {
    pub id: String,
    pub names: Vec<String>,
    pub dir: PathBuf,
    pub json_bytes: Vec<u8>,
    pub json: Value,
    pub layers: Vec<SourceLayer>,
}

/// Finds `image` in the storage root `root` and reads it with its layer chain.
pub(crate) fn open(root: &Path, driver: &str, image: &str) -> Result<SourceImage> {
    let images = root.join(format!("{driver}-images"));
    let id = resolve(root, &images, image)?;
    let dir = images.join(&id);
    let (json_bytes, json) = read_json(&dir.join("images.json"))?;
    let names = names_of(&json);
    let top = json
        .get("layer")
        .and_then(Value::as_str)
        .filter(|l| is_object_id(l))
        .map(str::to_owned);

    // Walk the chain top down, gathering where each layer's directories are.
    let mut dirs = ObjectDirs::default();
    dirs.images.insert(id.clone(), dir.clone());
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    let mut next = top;
    while let Some(layer) = next.take() {
        if !seen.insert(layer.clone()) || found.len() > MAX_LOWER_DEPTH {
            break; // the judge below names the loop or the depth
        }
        let overlay = object_dir(&root.join(driver), &layer)?;
        let meta = object_dir(&root.join(format!("{driver}-layers")), &layer)?;
        if let Some(o) = &overlay {
            dirs.overlay.insert(layer.clone(), o.clone());
        }
        let Some(meta) = meta else { break };
        dirs.layers.insert(layer.clone(), meta.clone());
        let Ok((json_bytes, json)) = read_json(&meta.join("layer.json")) else {
            break;
        };
        let parent = json
            .get("parent")
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty())
            .map(str::to_owned);
        next.clone_from(&parent);
        found.push((layer, parent, overlay, meta, json_bytes, json));
    }

    let index = LayoutIndex::judge(&dirs, driver);
    if index.image(&id).is_none() {
        let reason = index
            .not_ready()
            .iter()
            .find(|nr| nr.name == id)
            .map(|nr| nr.reason.clone())
            .unwrap_or_else(|| "not ready".to_owned());
        return Err(PublishError::SourceNotReady {
            id,
            root: root.to_owned(),
            reason,
        });
    }

    let mut layers: Vec<SourceLayer> = Vec::with_capacity(found.len());
    for (id, parent, overlay, meta, json_bytes, json) in found.into_iter().rev() {
        // Ready layers have both directories and a link; the judge said so.
        let (Some(overlay_dir), Some(ready)) = (overlay, index.layer(&id)) else {
            return Err(PublishError::BadSource {
                path: meta,
                reason: format!("layer {id} vanished while being read"),
            });
        };
        let below = layers.last().map(|l| l.chain.clone());
        let diff = json.get("diff-digest").and_then(Value::as_str);
        let chain = match (below, diff) {
            (None, Some(diff)) => chain_id(None, diff),
            (Some(Some(below)), Some(diff)) => chain_id(Some(&below), diff),
            _ => None,
        };
        layers.push(SourceLayer {
            short: ready.short.clone(),
            id,
            parent,
            chain,
            overlay_dir,
            meta_dir: meta,
            json_bytes,
            json,
        });
    }
    Ok(SourceImage {
        id,
        names,
        dir,
        json_bytes,
        json,
        layers,
    })
}

/// The image id `image` stands for: a full id, then a name, then a unique id prefix, then a
/// name written without its registry or `:latest`.
fn resolve(root: &Path, images: &Path, image: &str) -> Result<String> {
    let unknown = || PublishError::UnknownImage {
        image: image.to_owned(),
        root: root.to_owned(),
    };
    let entries = match fs::read_dir(images) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(unknown()),
        Err(e) => return Err(io_at(images)(e)),
    };
    let mut ids = BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(io_at(images))?;
        if let Some(name) = entry.file_name().to_str().filter(|n| is_object_id(n)) {
            ids.insert(name.to_owned());
        }
    }
    let wanted = image.strip_prefix("sha256:").unwrap_or(image);
    if ids.contains(wanted) {
        return Ok(wanted.to_owned());
    }
    let named: Vec<(String, Vec<String>)> = ids
        .iter()
        .map(|id| {
            let names = read_json(&images.join(id).join("images.json"))
                .map(|(_, json)| names_of(&json))
                .unwrap_or_default();
            (id.clone(), names)
        })
        .collect();
    let pick = |matches: Vec<&String>| -> Result<Option<String>> {
        match matches.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some((*one).clone())),
            many => Err(PublishError::Ambiguous {
                image: image.to_owned(),
                root: root.to_owned(),
                candidates: many.iter().map(|s| s.to_string()).collect(),
            }),
        }
    };
    let exact = named
        .iter()
        .filter(|(_, names)| names.iter().any(|n| n == image))
        .map(|(id, _)| id)
        .collect();
    if let Some(id) = pick(exact)? {
        return Ok(id);
    }
    if !wanted.is_empty()
        && wanted
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        let prefixed = ids.iter().filter(|id| id.starts_with(wanted)).collect();
        if let Some(id) = pick(prefixed)? {
            return Ok(id);
        }
    }
    let short = named
        .iter()
        .filter(|(_, names)| names.iter().any(|n| short_name_matches(n, image)))
        .map(|(id, _)| id)
        .collect();
    pick(short)?.ok_or_else(unknown)
}

/// Whether `name` (a full reference) is what a user means by `short`: the same reference
/// without its registry and path prefix, or without `:latest`.
fn short_name_matches(name: &str, short: &str) -> bool {
    let tagged = short.contains('@') || short.rsplit('/').next().is_some_and(|l| l.contains(':'));
    let with_tag = if tagged {
        short.to_owned()
    } else {
        format!("{short}:latest")
    };
    name == with_tag || name.ends_with(&format!("/{with_tag}"))
}

fn names_of(json: &Value) -> Vec<String> {
    json.get("names")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Where the object `id` of the layer area `area` is: `RO/<id>/` when it is a real
/// directory there, else `<id>`, followed if it is the symlink iSulad keeps; `None` if
/// neither exists (a dangling symlink included).
fn object_dir(area: &Path, id: &str) -> Result<Option<PathBuf>> {
    let ro = area.join("RO").join(id);
    if fs::symlink_metadata(&ro).is_ok_and(|m| m.is_dir()) {
        return Ok(Some(ro));
    }
    let direct = area.join(id);
    match fs::metadata(&direct) {
        Ok(m) if m.is_dir() => Ok(Some(direct)),
        Ok(_) => Err(PublishError::BadSource {
            path: direct,
            reason: "not a directory".to_owned(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(PublishError::BadSource {
            path: direct,
            reason: "symlink loop".to_owned(),
        }),
        Err(e) => Err(io_at(&direct)(e)),
    }
}

/// Reads a JSON object file of at most [`JSON_CAP`] bytes: its bytes and its value.
pub(crate) fn read_json(path: &Path) -> Result<(Vec<u8>, Value)> {
    let file = fs::File::open(path).map_err(io_at(path))?;
    let mut bytes = Vec::new();
    file.take(JSON_CAP + 1)
        .read_to_end(&mut bytes)
        .map_err(io_at(path))?;
    if bytes.len() as u64 > JSON_CAP {
        return Err(PublishError::BadSource {
            path: path.to_owned(),
            reason: format!("larger than {} MiB", JSON_CAP >> 20),
        });
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(value @ Value::Object(_)) => Ok((bytes, value)),
        Ok(_) => Err(PublishError::BadSource {
            path: path.to_owned(),
            reason: "malformed JSON (not an object)".to_owned(),
        }),
        Err(e) => Err(PublishError::BadSource {
            path: path.to_owned(),
            reason: format!("malformed JSON ({e})"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names() {
        let full = "registry.example.com/layerfs/app:2.0";
        assert!(short_name_matches(full, "app:2.0"));
        assert!(short_name_matches(full, "layerfs/app:2.0"));
        assert!(!short_name_matches(full, "app"));
        assert!(!short_name_matches(full, "pp:2.0"));
        assert!(short_name_matches(
            "docker.io/library/busybox:latest",
            "busybox"
        ));
        assert!(short_name_matches("busybox:latest", "busybox"));
    }
}
