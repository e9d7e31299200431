//! Reading the three shared areas into per-object facts.
//!
//! Each object directory is probed on its own: the files it must contain are read and checked
//! in isolation, and the result is either the facts the cross-object rules need or the reason
//! the object cannot be ready. Nothing here looks at another object; chains and image-to-layer
//! links are judged in `readiness`.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use flate2::read::MultiGzDecoder;
use nix::sys::stat::SFlag;
use serde::de::{DeserializeOwned, IgnoredAny};

use super::fingerprint::{
    content_hash, Fingerprint, Part, Stamp, TarSplitFault, TAR_SPLIT_DECODED_CAP,
};
use super::isulad::{self, ImageJson, LayerJson};
use super::nofollow::{self, DirHandle, EntryError};
use super::{ObjectDirs, MAX_LOWER_DEPTH};

/// JSON metadata is small in practice; anything larger is treated as hostile or broken.
const JSON_CAP: u64 = 16 << 20;

/// `link` holds 26 characters; `lower` at most 128 entries of `l/` plus 26 characters.
const LINK_CAP: u64 = 4 << 10;
const LOWER_CAP: u64 = 64 << 10;

/// What an object directory yielded: its facts, or why it cannot be ready.
pub(crate) type Probed<T> = Result<T, String>;

/// Checks one object directory. The fingerprint is the object's from an earlier scan, if it
/// was ready then: files whose stamps did not change need not be decoded again.
pub(crate) type Probe<T> = fn(&DirHandle, &str, Option<&Fingerprint>) -> Probed<T>;

/// The objects found in one area, keyed by id.
#[derive(Debug)]
pub(crate) struct Area<T> {
    /// The area's path relative to the remote root, as written in reasons.
    pub path: String,
    pub objects: BTreeMap<String, Probed<T>>,
    /// Set when the area exists but could not be listed.
    pub problem: Option<String>,
}

/// What `<driver>/RO/<id>/` says about a layer.
#[derive(Debug, Clone)]
pub(crate) struct OverlayFacts {
    pub short: String,
    /// Short ids named by `lower`, in order; `None` when there is no `lower` file.
    pub lower: Option<Vec<String>>,
    pub mtime: SystemTime,
    pub fingerprint: Fingerprint,
}

/// What `<driver>-layers/RO/<id>/` says about a layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerFacts {
    pub parent: Option<String>,
    pub fingerprint: Fingerprint,
    /// Why the layer cannot be ready as its files stand, where the fingerprint records the
    /// file at fault (see [`Part::BadTarSplit`]).
    pub broken: Option<String>,
}

/// What `<driver>-images/<id>/` says about an image.
#[derive(Debug, Clone)]
pub(crate) struct ImageFacts {
    pub names: Vec<String>,
    pub top_layer: String,
    pub mtime: SystemTime,
    pub fingerprint: Fingerprint,
}

/// Everything read from the remote root in one scan.
#[derive(Debug)]
pub(crate) struct Facts {
    pub overlay: Area<OverlayFacts>,
    pub layers: Area<LayerFacts>,
    pub images: Area<ImageFacts>,
}

/// Reads the three shared areas of `remote_root` for graph driver `driver`.
pub(crate) fn collect(remote_root: &Path, driver: &str) -> Facts {
    let root = DirHandle::open_root(remote_root).map_err(|e| format!("remote root: {e}"));
    let layers_dir = format!("{driver}-layers");
    let images_dir = format!("{driver}-images");
    Facts {
        overlay: scan_area(&root, &[driver, "RO"], probe_overlay),
        layers: scan_area(&root, &[&layers_dir, "RO"], probe_layer),
        images: scan_area(&root, &[&images_dir], probe_image),
    }
}

/// Probes the object directories `dirs` names, as the three areas of one tree.
pub(crate) fn collect_dirs(dirs: &ObjectDirs, driver: &str) -> Facts {
    Facts {
        overlay: probe_each(format!("{driver}/RO"), &dirs.overlay, probe_overlay),
        layers: probe_each(format!("{driver}-layers/RO"), &dirs.layers, probe_layer),
        images: probe_each(format!("{driver}-images"), &dirs.images, probe_image),
    }
}

/// Probes each directory of `dirs` under its id, as if listed in the area `path`. A missing
/// directory is an absent object; a name that is not an id is skipped, as in a listing.
fn probe_each<T>(path: String, dirs: &BTreeMap<String, PathBuf>, probe: Probe<T>) -> Area<T> {
    let mut objects = BTreeMap::new();
    for (id, dir) in dirs {
        if !isulad::is_object_id(id) {
            continue;
        }
        let probed = match DirHandle::open_root(dir) {
            Ok(object) => probe(&object, id, None),
            Err(EntryError::Missing) => continue,
            Err(e) => Err(format!("{path}/{id}: {e}")),
        };
        objects.insert(id.clone(), probed);
    }
    Area {
        path,
        objects,
        problem: None,
    }
}

/// Lists one area and probes every entry named like an id.
///
/// Entries that cannot be ids (temporary files, bad names, plain files) are garbage and
/// skipped at debug level. An id-named entry that is not a real directory is reported, since
/// on a healthy writer that never happens.
fn scan_area<T>(root: &Result<DirHandle, String>, components: &[&str], probe: Probe<T>) -> Area<T> {
    let path = components.join("/");
    let mut area = Area {
        path,
        objects: BTreeMap::new(),
        problem: None,
    };
    let dir = match open_area(root, components) {
        Ok(Some(dir)) => dir,
        Ok(None) => {
            tracing::debug!(area = %area.path, "remote area absent: nothing to serve from it");
            return area;
        }
        Err(problem) => {
            area.problem = Some(problem);
            return area;
        }
    };
    let names = match dir.names() {
        Ok(names) => names,
        Err(e) => {
            area.problem = Some(format!("cannot list: {e}"));
            return area;
        }
    };
    for name in names {
        if !isulad::is_object_id(&name) {
            tracing::debug!(area = %area.path, %name, "skipping entry that is not an id");
            continue;
        }
        let probed = match dir.subdir(&name) {
            Ok(object) => probe(&object, &name, None),
            Err(EntryError::NotDirectory) => {
                tracing::debug!(area = %area.path, %name, "skipping id-named non-directory");
                continue;
            }
            // Removed between listing and opening: it is simply gone.
            Err(EntryError::Missing) => continue,
            Err(e) => Err(format!("{}/{name}: {e}", area.path)),
        };
        area.objects.insert(name, probed);
    }
    area
}

/// Opens an area one component at a time, never through a symlink. `Ok(None)` means the area
/// does not exist, which is normal for a writer that has not pulled anything yet.
pub(crate) fn open_area(
    root: &Result<DirHandle, String>,
    components: &[&str],
) -> Result<Option<DirHandle>, String> {
    let root = root.as_ref().map_err(Clone::clone)?;
    let mut walked = String::new();
    let mut current: Option<DirHandle> = None;
    for component in components {
        if !walked.is_empty() {
            walked.push('/');
        }
        walked.push_str(component);
        let parent = current.as_ref().unwrap_or(root);
        current = match parent.subdir(component) {
            Ok(dir) => Some(dir),
            Err(EntryError::Missing) => return Ok(None),
            Err(e) => return Err(format!("{walked}: {e}")),
        };
    }
    Ok(current)
}

/// Checks `<driver>/RO/<id>/`: `link`, `diff/` and, when present, `lower`.
pub(crate) fn probe_overlay(
    dir: &DirHandle,
    _id: &str,
    _prev: Option<&Fingerprint>,
) -> Probed<OverlayFacts> {
    let mut fingerprint = Fingerprint::default();
    let st = dir.stat().map_err(|e| format!("overlay dir: {e}"))?;
    fingerprint.push(Part::OverlayDir, nofollow::stamp(&st, None));

    let (bytes, link_st) = dir
        .read_file("link", LINK_CAP)
        .map_err(|e| format!("link: {e}"))?;
    fingerprint.push(
        Part::Link,
        nofollow::stamp(&link_st, Some(content_hash(&bytes))),
    );
    let short = std::str::from_utf8(&bytes)
        .ok()
        .map(isulad::strip_one_newline)
        .filter(|s| isulad::is_short_id(s))
        .ok_or("link: not a short id (26 lowercase hex or 26 uppercase base32)")?
        .to_owned();

    match dir.kind_of("diff") {
        Ok(SFlag::S_IFDIR) => {}
        Ok(SFlag::S_IFLNK) => return Err(format!("diff: {}", EntryError::Symlink)),
        Ok(_) => return Err(format!("diff: {}", EntryError::NotDirectory)),
        Err(e) => return Err(format!("diff: {e}")),
    }

    let lower = match dir.read_file("lower", LOWER_CAP) {
        Ok((bytes, lower_st)) => {
            let hash = Some(content_hash(&bytes));
            fingerprint.push(Part::Lower, nofollow::stamp(&lower_st, hash));
            Some(parse_lower(&bytes)?)
        }
        Err(EntryError::Missing) => None,
        Err(e) => return Err(format!("lower: {e}")),
    };

    Ok(OverlayFacts {
        short,
        lower,
        mtime: nofollow::mtime(&st),
        fingerprint,
    })
}

fn parse_lower(bytes: &[u8]) -> Probed<Vec<String>> {
    let text = std::str::from_utf8(bytes).map_err(|_| "lower: not UTF-8 text")?;
    let shorts = isulad::parse_lower(text).map_err(|e| format!("lower: {e}"))?;
    if shorts.len() > MAX_LOWER_DEPTH {
        return Err(format!("lower: more than {MAX_LOWER_DEPTH} entries"));
    }
    Ok(shorts)
}

/// Checks `<driver>-layers/RO/<id>/`: `layer.json` and, for image layers, the tar-split.
pub(crate) fn probe_layer(
    dir: &DirHandle,
    id: &str,
    prev: Option<&Fingerprint>,
) -> Probed<LayerFacts> {
    let mut fingerprint = Fingerprint::default();
    let st = dir.stat().map_err(|e| format!("layer dir: {e}"))?;
    fingerprint.push(Part::LayerDir, nofollow::stamp(&st, None));

    let (json, json_st): (LayerJson, _) = read_json(dir, "layer.json", "layer.json")?;
    fingerprint.push(Part::LayerJson, json_st);
    if json.id.as_deref() != Some(id) {
        return Err("layer.json: id does not match the directory name".to_owned());
    }
    if json.is_incomplete() {
        return Err("layer.json: incomplete flag set (pull or import unfinished)".to_owned());
    }
    let parent = match json.parent() {
        Some(p) if !isulad::is_object_id(p) => {
            return Err("layer.json: parent is not a 64-hex layer id".to_owned())
        }
        p => p.map(str::to_owned),
    };
    let mut broken = None;
    if json.has_diff_digest() {
        match check_tar_split(dir, &format!("{id}.tar-split.gz"), prev) {
            Ok(stamp) => fingerprint.push(Part::TarSplit, stamp),
            // Recorded with its stamp rather than failing the probe, which would make every
            // scan decode it again.
            Err(TarSplitError::Unusable(stamp, fault)) => {
                fingerprint.push(Part::BadTarSplit(fault), stamp);
                broken = Some(format!("tar-split.gz: {fault}"));
            }
            Err(e) => return Err(format!("tar-split.gz: {e}")),
        }
    }
    Ok(LayerFacts {
        parent,
        fingerprint,
        broken,
    })
}

/// Why a tar-split file cannot be checked.
#[derive(Debug, thiserror::Error)]
enum TarSplitError {
    #[error("missing although layer.json sets diff-digest")]
    Missing,
    #[error("{0}")]
    Entry(EntryError),
    #[error("empty file")]
    Empty,
    #[error("{1}")]
    Unusable(Stamp, TarSplitFault),
}

/// iSulad writes the tar-split in place, not atomically, so a writer caught mid-way leaves a
/// truncated stream that only decoding to the end reveals.
///
/// `prev` is the fingerprint of an earlier scan: a file with the inode, size, mtime and ctime
/// it records is the same stream, found complete or unusable then, and is not decoded again
/// (the tar-split of a big layer takes far longer to decode than every other check
/// together, and a broken one would be decoded every scan).
fn check_tar_split(
    dir: &DirHandle,
    name: &str,
    prev: Option<&Fingerprint>,
) -> Result<Stamp, TarSplitError> {
    let (file, st) = dir.open_file(name).map_err(|e| match e {
        EntryError::Missing => TarSplitError::Missing,
        e => TarSplitError::Entry(e),
    })?;
    if st.st_size == 0 {
        return Err(TarSplitError::Empty);
    }
    let stamp = nofollow::stamp(&st, None);
    let seen = prev
        .into_iter()
        .flat_map(|f| f.parts())
        .find(|(part, was)| {
            matches!(part, Part::TarSplit | Part::BadTarSplit(_)) && **was == stamp
        });
    match seen {
        Some((Part::BadTarSplit(fault), _)) => return Err(TarSplitError::Unusable(stamp, fault)),
        Some(_) => return Ok(stamp),
        None => {}
    }
    let mut decoded = MultiGzDecoder::new(file).take(TAR_SPLIT_DECODED_CAP + 1);
    let fault = match io::copy(&mut decoded, &mut io::sink()) {
        Ok(n) if n > TAR_SPLIT_DECODED_CAP => TarSplitFault::TooLarge,
        Ok(_) => return Ok(stamp),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => TarSplitFault::Truncated,
        Err(_) => TarSplitFault::Corrupt,
    };
    Err(TarSplitError::Unusable(stamp, fault))
}

/// Checks `<driver>-images/<id>/`: `images.json`, `manifest` and the config big-data file.
pub(crate) fn probe_image(
    dir: &DirHandle,
    id: &str,
    _prev: Option<&Fingerprint>,
) -> Probed<ImageFacts> {
    let mut fingerprint = Fingerprint::default();
    let st = dir.stat().map_err(|e| format!("image dir: {e}"))?;
    fingerprint.push(Part::ImageDir, nofollow::stamp(&st, None));

    let (json, json_st): (ImageJson, _) = read_json(dir, "images.json", "images.json")?;
    fingerprint.push(Part::ImagesJson, json_st);
    if json.id.as_deref() != Some(id) {
        return Err("images.json: id does not match the directory name".to_owned());
    }
    let top_layer = match json.layer {
        Some(layer) if isulad::is_object_id(&layer) => layer,
        _ => return Err("images.json: `layer` (top layer) is missing or not a 64-hex id".into()),
    };

    let (_, manifest_st): (IgnoredAny, _) = read_json(dir, "manifest", "manifest")?;
    fingerprint.push(Part::Manifest, manifest_st);

    // iSulad deletes an image whose config does not parse, so a view must not offer one.
    let config = isulad::config_file_name(id);
    let (_, config_st): (IgnoredAny, _) = read_json(dir, &config, &format!("config {config}"))?;
    fingerprint.push(Part::Config, config_st);

    Ok(ImageFacts {
        names: json.names.unwrap_or_default(),
        top_layer,
        mtime: nofollow::mtime(&st),
        fingerprint,
    })
}

/// Reads and parses the JSON file `name`, returning its stamp with a content hash. `label`
/// names the file in reasons.
fn read_json<T: DeserializeOwned>(dir: &DirHandle, name: &str, label: &str) -> Probed<(T, Stamp)> {
    let (bytes, st) = dir
        .read_file(name, JSON_CAP)
        .map_err(|e| format!("{label}: {e}"))?;
    // Every record iSulad writes is an object; serde would also map an array onto a struct
    // positionally, which no writer produces.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(format!("{label}: malformed JSON (not an object)"));
    }
    let value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{label}: malformed JSON ({e})"))?;
    Ok((value, nofollow::stamp(&st, Some(content_hash(&bytes)))))
}
