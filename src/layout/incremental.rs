//! Scanning the same remote tree again and again, reading only what changed.
//!
//! A [`Scanner`] remembers, per area and per object directory, the stamp it saw and what the
//! directory yielded. The next scan then costs one `fstat` per area and one `lstat` per
//! object directory when nothing changed:
//!
//! - an area whose directory stamp (inode, mtime, ctime) is unchanged is not listed again:
//!   adding, removing or renaming an object changes it;
//! - an object that was fine last time and whose directory stamp is unchanged is not probed
//!   again: iSulad writes every metadata file through a temporary file and `rename(2)`,
//!   which changes the directory's mtime and ctime;
//! - the one file written in place, the tar-split, is covered by the rotation below and by
//!   the tar-split stamp: a stream once found complete is not decoded again while its stamp
//!   holds;
//! - every `full_check_every` scans (in rotation, a slice of the objects each scan) the
//!   stamps of an object's metadata files are compared as well, so an in-place edit that
//!   leaves the directory alone is still noticed, just later;
//! - an object that was *not* fine last time is probed again on every scan: it is usually a
//!   pull in progress, and its readiness is what the next round must find out.
//!
//! Timestamps have a granularity: a directory changed twice within one tick of the clock
//! keeps its mtime. A stamp is therefore only trusted once it is [`RACY_MARGIN`] older than
//! the moment it was read; until then the directory is read again (as git does with its
//! "racily clean" index entries).
//!
//! The cross-object rules (chains, image to top layer) are cheap and in memory, so they are
//! recomputed in full every scan from the cached facts.
//!
//! A scan fails as a whole, instead of yielding an empty index, when the remote root cannot
//! be opened or an area fails with an error that says the remote itself is in trouble
//! (`EIO`, `ENOTCONN`, `ESTALE`, a network error): the caller keeps what it had.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::sys::stat::{FileStat, SFlag};

use super::fingerprint::{Fingerprint, Part, Stamp};
use super::isulad;
use super::nofollow::{self, DirHandle, EntryError};
use super::readiness;
use super::scan::{self, Area, Facts, Probe, Probed};
use super::{is_driver_name, LayoutIndex};

/// How much older than the moment it was read a stamp must be before it is trusted.
pub const RACY_MARGIN: Duration = Duration::from_secs(2);

/// Why a scan could not run at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ScanFailure(pub String);

/// How much one scan read, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Areas listed with `readdir` (at most 3).
    pub listed: usize,
    /// Object directories probed (their files opened and checked).
    pub probed: usize,
    /// Object directories whose earlier result was reused.
    pub reused: usize,
    /// Whether anything the readiness rules see differs from the previous scan: objects
    /// added, gone, or probed with a different outcome. A not-ready object probed again
    /// with the same reason does not count.
    pub dirty: bool,
}

/// One object directory as last seen.
#[derive(Debug, Clone)]
struct Seen<T> {
    stamp: Stamp,
    read_at: SystemTime,
    probed: Probed<T>,
}

/// One area as last seen.
#[derive(Debug)]
struct AreaCache<T> {
    stamp: Option<(Stamp, SystemTime)>,
    names: Vec<String>,
    objects: BTreeMap<String, Seen<T>>,
}

impl<T> Default for AreaCache<T> {
    fn default() -> Self {
        AreaCache {
            stamp: None,
            names: Vec::new(),
            objects: BTreeMap::new(),
        }
    }
}

/// Scans one remote root for one graph driver, incrementally (see the module docs).
#[derive(Debug)]
pub struct Scanner {
    root: PathBuf,
    driver: String,
    /// A full stamp check of every object happens once per this many scans (1 = always).
    pub full_check_every: u32,
    /// How old a stamp must be to be trusted; [`RACY_MARGIN`] unless a test says otherwise.
    pub racy_margin: Duration,
    scans: u64,
    overlay: AreaCache<scan::OverlayFacts>,
    layers: AreaCache<scan::LayerFacts>,
    images: AreaCache<scan::ImageFacts>,
    stats: ScanStats,
}

impl Scanner {
    pub fn new(root: &Path, driver: &str) -> Scanner {
        Scanner {
            root: root.to_owned(),
            driver: driver.to_owned(),
            full_check_every: 8,
            racy_margin: RACY_MARGIN,
            scans: 0,
            overlay: AreaCache::default(),
            layers: AreaCache::default(),
            images: AreaCache::default(),
            stats: ScanStats::default(),
        }
    }

    /// What the last scan read.
    pub fn stats(&self) -> ScanStats {
        self.stats
    }

    /// Like [`scan`](Self::scan), but `Ok(None)` when nothing differs from the previous
    /// scan, so the caller keeps the index it has and skips the readiness rules, the diff
    /// and the swap: what makes an idle round cost little more than one `lstat` per object.
    /// `force` asks for an index regardless (the caller no longer has the last one).
    pub fn scan_if_changed(&mut self, force: bool) -> Result<Option<LayoutIndex>, ScanFailure> {
        let first = self.scans == 0;
        let index = self.scan_facts()?;
        if !force && !first && !self.stats.dirty {
            return Ok(None);
        }
        Ok(Some(index.map_or_else(
            || LayoutIndex::invalid_driver(&self.driver),
            |facts| readiness::resolve(facts, &self.driver),
        )))
    }

    /// Scans the shared areas, reusing what has not changed since the previous scan.
    pub fn scan(&mut self) -> Result<LayoutIndex, ScanFailure> {
        Ok(match self.scan_facts()? {
            Some(facts) => readiness::resolve(facts, &self.driver),
            None => LayoutIndex::invalid_driver(&self.driver),
        })
    }

    /// Brings the caches up to date; `None` for a driver name that is not one.
    fn scan_facts(&mut self) -> Result<Option<Facts>, ScanFailure> {
        if !is_driver_name(&self.driver) {
            self.scans = self.scans.wrapping_add(1);
            return Ok(None);
        }
        self.stats = ScanStats::default();
        self.scans = self.scans.wrapping_add(1);
        let root = DirHandle::open_root(&self.root)
            .map_err(|e| ScanFailure(format!("remote root {}: {e}", self.root.display())))?;
        let layers_dir = format!("{}-layers", self.driver);
        let images_dir = format!("{}-images", self.driver);
        let driver = self.driver.clone();
        let slice = Slice {
            scan: self.scans,
            every: self.full_check_every.max(1),
            margin: self.racy_margin,
        };
        let stats = &mut self.stats;
        let overlay = refresh_area(
            &root,
            &[&driver, "RO"],
            &mut self.overlay,
            scan::probe_overlay,
            slice,
            stats,
        )?;
        let layers = refresh_area(
            &root,
            &[&layers_dir, "RO"],
            &mut self.layers,
            scan::probe_layer,
            slice,
            stats,
        )?;
        let images = refresh_area(
            &root,
            &[&images_dir],
            &mut self.images,
            scan::probe_image,
            slice,
            stats,
        )?;
        Ok(Some(Facts {
            overlay,
            layers,
            images,
        }))
    }
}

/// Which objects get a full stamp check in this scan.
#[derive(Debug, Clone, Copy)]
struct Slice {
    scan: u64,
    every: u32,
    /// Not about slices, but needed in the same places: see [`settled`].
    margin: Duration,
}

impl Slice {
    fn due(self, id: &str) -> bool {
        if self.every <= 1 {
            return true;
        }
        let mut h = DefaultHasher::new();
        id.hash(&mut h);
        h.finish() % u64::from(self.every) == self.scan % u64::from(self.every)
    }
}

/// Errors that say the remote itself is unwell, rather than something about one entry.
pub fn is_remote_failure(e: &EntryError) -> bool {
    let EntryError::Io(e) = e else {
        return false;
    };
    matches!(
        e.raw_os_error(),
        Some(
            libc::EIO
                | libc::ENOTCONN
                | libc::ESTALE
                | libc::ETIMEDOUT
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ENETDOWN
                | libc::ENETUNREACH
                | libc::ECONNREFUSED
                | libc::ECONNRESET
                | libc::ECONNABORTED
                | libc::ENOLINK
                | libc::EREMOTEIO
        )
    )
}

/// Whether a stamp read at `read_at` can be trusted to change with the next modification.
fn settled(stamp: &Stamp, read_at: SystemTime, margin: Duration) -> bool {
    let mtime = nanos_to_time(stamp.mtime_ns.max(stamp.ctime_ns));
    match read_at.duration_since(mtime) {
        Ok(age) => age >= margin,
        // A timestamp from the future (a skewed writer clock) is never trusted.
        Err(_) => margin.is_zero(),
    }
}

fn nanos_to_time(ns: i128) -> SystemTime {
    match u64::try_from(ns) {
        Ok(ns) => SystemTime::UNIX_EPOCH + Duration::from_nanos(ns),
        Err(_) => SystemTime::UNIX_EPOCH,
    }
}

fn stamp_of(st: &FileStat) -> Stamp {
    nofollow::stamp(st, None)
}

/// Whether two stamps of a file describe the same content, the content hash aside (the
/// cached one has it, a fresh `lstat` does not).
fn same_file(a: &Stamp, b: &Stamp) -> bool {
    a.ino == b.ino && a.size == b.size && a.mtime_ns == b.mtime_ns && a.ctime_ns == b.ctime_ns
}

/// Brings one area's cache up to date and returns its facts for the readiness rules.
fn refresh_area<T: Clone + HasFingerprint>(
    root: &DirHandle,
    components: &[&str],
    cache: &mut AreaCache<T>,
    probe: Probe<T>,
    slice: Slice,
    stats: &mut ScanStats,
) -> Result<Area<T>, ScanFailure> {
    let path = components.join("/");
    let mut area = Area {
        path: path.clone(),
        objects: BTreeMap::new(),
        problem: None,
    };
    let dir = match walk(root, components) {
        Ok(Some(dir)) => dir,
        Ok(None) => {
            stats.dirty |= cache.stamp.is_some();
            *cache = AreaCache::default();
            return Ok(area);
        }
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(e) => {
            *cache = AreaCache::default();
            stats.dirty = true;
            area.problem = Some(format!("{path}: {e}"));
            return Ok(area);
        }
    };
    let now = SystemTime::now();
    let dir_stamp = match dir.stat() {
        Ok(st) => stamp_of(&st),
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(e) => {
            stats.dirty = true;
            area.problem = Some(format!("cannot list: {e}"));
            return Ok(area);
        }
    };
    let listing_valid = cache
        .stamp
        .is_some_and(|(s, at)| s == dir_stamp && settled(&s, at, slice.margin));
    if !listing_valid {
        let names = match dir.names() {
            Ok(names) => names,
            Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
            Err(e) => {
                stats.dirty = true;
                area.problem = Some(format!("cannot list: {e}"));
                return Ok(area);
            }
        };
        stats.listed += 1;
        cache.names = names
            .into_iter()
            .filter(|n| isulad::is_object_id(n))
            .collect();
        cache.stamp = Some((dir_stamp, now));
        // Objects that left the listing leave the cache.
        let names = &cache.names;
        let before = cache.objects.len();
        cache
            .objects
            .retain(|id, _| names.binary_search(id).is_ok());
        stats.dirty |= cache.objects.len() != before;
    }

    for name in &cache.names {
        let st = match dir.lstat(name) {
            Ok(st) => st,
            Err(EntryError::Missing) => {
                stats.dirty |= cache.objects.remove(name).is_some();
                continue;
            }
            Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
            Err(e) => {
                stats.dirty = true;
                area.objects
                    .insert(name.clone(), Err(format!("{path}/{name}: {e}")));
                continue;
            }
        };
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind != SFlag::S_IFDIR && kind != SFlag::S_IFLNK {
            // Garbage named like an id: never an object (as a full scan skips it).
            stats.dirty |= cache.objects.remove(name).is_some();
            continue;
        }
        let stamp = stamp_of(&st);
        let reusable = cache.objects.get(name).is_some_and(|seen| {
            seen.probed.is_ok()
                && seen.stamp == stamp
                && settled(&seen.stamp, seen.read_at, slice.margin)
                && (!slice.due(name) || files_unchanged(&dir, name, seen))
        });
        if reusable {
            stats.reused += 1;
        } else {
            stats.probed += 1;
            let prev = cache
                .objects
                .get(name)
                .and_then(|s| s.probed.as_ref().ok())
                .map(|f| f.fingerprint().clone());
            let probed = match dir.subdir(name) {
                Ok(object) => probe(&object, name, prev.as_ref()),
                Err(EntryError::Missing) => {
                    stats.dirty |= cache.objects.remove(name).is_some();
                    continue;
                }
                Err(e) if is_remote_failure(&e) => {
                    return Err(ScanFailure(format!("{path}/{name}: {e}")))
                }
                Err(e) => Err(format!("{path}/{name}: {e}")),
            };
            let same_failure = match (cache.objects.get(name).map(|s| &s.probed), &probed) {
                (Some(Err(old)), Err(new)) => old == new,
                _ => false,
            };
            stats.dirty |= !same_failure;
            cache.objects.insert(
                name.clone(),
                Seen {
                    stamp,
                    read_at: now,
                    probed,
                },
            );
        }
        if let Some(seen) = cache.objects.get(name) {
            area.objects.insert(name.clone(), seen.probed.clone());
        }
    }
    Ok(area)
}

/// Opens an area one component at a time, never through a symlink; `Ok(None)` when absent.
fn walk(root: &DirHandle, components: &[&str]) -> Result<Option<DirHandle>, EntryError> {
    let mut current: Option<DirHandle> = None;
    for component in components {
        let parent = current.as_ref().unwrap_or(root);
        current = match parent.subdir(component) {
            Ok(dir) => Some(dir),
            Err(EntryError::Missing) => return Ok(None),
            Err(e) => return Err(e),
        };
    }
    Ok(current)
}

/// Whether every metadata file of a cached object still has the stamp it had.
fn files_unchanged<T: HasFingerprint>(dir: &DirHandle, id: &str, seen: &Seen<T>) -> bool {
    let Ok(facts) = &seen.probed else {
        return false;
    };
    facts.fingerprint().parts().all(|(part, old)| {
        let Some(file) = file_name(part, id) else {
            return true;
        };
        match dir.lstat(&format!("{id}/{file}")) {
            Ok(st) => same_file(&stamp_of(&st), old),
            Err(_) => false,
        }
    })
}

/// The file a fingerprint part stands for, relative to the object directory.
fn file_name(part: Part, id: &str) -> Option<String> {
    Some(match part {
        Part::OverlayDir | Part::LayerDir | Part::ImageDir => return None,
        Part::Link => "link".to_owned(),
        Part::Lower => "lower".to_owned(),
        Part::LayerJson => "layer.json".to_owned(),
        Part::TarSplit => format!("{id}.tar-split.gz"),
        Part::ImagesJson => "images.json".to_owned(),
        Part::Manifest => "manifest".to_owned(),
        Part::Config => isulad::config_file_name(id),
    })
}

/// The per-object facts of every area carry the fingerprint of what they read.
pub(crate) trait HasFingerprint {
    fn fingerprint(&self) -> &Fingerprint;
}

impl HasFingerprint for scan::OverlayFacts {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
}

impl HasFingerprint for scan::LayerFacts {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
}

impl HasFingerprint for scan::ImageFacts {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
}
