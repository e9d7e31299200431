//! Cheap identities of an object's on-disk state.
//!
//! Each ready object keeps the stat stamp of its directories and metadata files, plus a hash of
//! the JSON (and `link`/`lower`) contents. Comparing two fingerprints tells a later scan whether
//! an object changed without re-reading anything: a re-tag on the writer rewrites `images.json`
//! through a rename, which changes its inode, ctime and usually its size and hash.

use std::hash::{DefaultHasher, Hasher};

/// A tar-split of a layer with hundreds of thousands of files stays far below this; the cap
/// bounds the time a gzip bomb can cost.
pub(super) const TAR_SPLIT_DECODED_CAP: u64 = 1 << 30;

/// Why a tar-split stream, read to its end, cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, thiserror::Error)]
pub enum TarSplitFault {
    #[error("truncated gzip stream")]
    Truncated,
    #[error("not a valid gzip stream")]
    Corrupt,
    #[error("decompresses to more than {} MiB", TAR_SPLIT_DECODED_CAP >> 20)]
    TooLarge,
}

/// Which part of an object a stamp describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    /// `<driver>/RO/<id>/`
    OverlayDir,
    /// `<driver>/RO/<id>/link`
    Link,
    /// `<driver>/RO/<id>/lower`
    Lower,
    /// `<driver>-layers/RO/<id>/`
    LayerDir,
    /// `<driver>-layers/RO/<id>/layer.json`
    LayerJson,
    /// `<driver>-layers/RO/<id>/<id>.tar-split.gz`
    TarSplit,
    /// The same file, found unusable for this reason: the layer is not ready, and the same
    /// stream is not decoded again while its stamp stays.
    BadTarSplit(TarSplitFault),
    /// `<driver>-images/<id>/`
    ImageDir,
    /// `<driver>-images/<id>/images.json`
    ImagesJson,
    /// `<driver>-images/<id>/manifest`
    Manifest,
    /// `<driver>-images/<id>/=<base64 of sha256:<id>>`
    Config,
}

impl Part {
    /// Directories change whenever a writer drops a temporary file next to the metadata, so
    /// they say "look again", not "the object changed".
    pub fn is_dir(self) -> bool {
        matches!(self, Part::OverlayDir | Part::LayerDir | Part::ImageDir)
    }
}

/// The state of one file or directory when it was scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stamp {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
    /// Hash of the content for small files that were read whole; `None` for directories and
    /// for files that were only streamed (the tar-split).
    pub content_hash: Option<u64>,
}

/// The stamps of every part of one object, in a fixed order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    parts: Vec<(Part, Stamp)>,
}

impl Fingerprint {
    pub(crate) fn push(&mut self, part: Part, stamp: Stamp) {
        self.parts.push((part, stamp));
        self.parts.sort_by_key(|(p, _)| *p);
    }

    pub(crate) fn extend(&mut self, other: Fingerprint) {
        for (part, stamp) in other.parts {
            self.push(part, stamp);
        }
    }

    /// The stamp of one part, if the object has that part.
    pub fn get(&self, part: Part) -> Option<&Stamp> {
        self.parts.iter().find(|(p, _)| *p == part).map(|(_, s)| s)
    }

    /// Every recorded part with its stamp.
    pub fn parts(&self) -> impl Iterator<Item = (Part, &Stamp)> {
        self.parts.iter().map(|(p, s)| (*p, s))
    }

    /// Whether the metadata files differ: the "changed" of a refresh. Directory stamps are
    /// left out (see [`Part::is_dir`]).
    pub fn files_differ(&self, other: &Fingerprint) -> bool {
        !self
            .parts
            .iter()
            .filter(|(p, _)| !p.is_dir())
            .eq(other.parts.iter().filter(|(p, _)| !p.is_dir()))
    }
}

/// A hash of file contents. Only compared within one process, so the std hasher's lack of a
/// cross-version guarantee does not matter.
pub(crate) fn content_hash(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    hasher.write(bytes);
    hasher.finish()
}
