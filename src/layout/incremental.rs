//! Scanning the same remote tree again and again, reading only what changed.
//!
//! A [`Scanner`] remembers, per area and per object directory, the stamp it saw and what the
//! directory yielded, and reads again only what may have changed.
//!
//! # What one scan looks at
//!
//! With `E` = `full_check_every` (16 by default; a mount scans every 5 s):
//!
//! | what | looked at | how |
//! |---|---|---|
//! | each area dir (`<driver>/RO`, `<driver>-layers/RO`, `<driver>-images`) | every scan | `fstat`; listed again only when its stamp moved |
//! | every object dir of an area that was listed again | that scan | `lstat` |
//! | every image dir | every scan | `lstat` |
//! | a layer dir (either area) not ready, never probed, or not settled | every scan | `lstat` |
//! | any other layer dir | one scan in `E` (a rotation slice) | `lstat` |
//! | an object's metadata files | one scan in `E`, same slice | `lstat` each |
//! | an object's files, read and parsed | when any stamp above moved, or it was not ready | full probe |
//!
//! An idle scan of 10 000 layers and 1 000 images thus costs 6 `fstat`s, 1 000 `lstat`s of
//! image dirs and about 1/16 of the layer dirs and their files.
//!
//! # Why that is enough, and how late each change is seen
//!
//! - **Object added, removed or renamed** (a pull, a `rmi`): the area dir's mtime moves, so
//!   the next scan lists it and looks at every object in it; seen **next scan**. Looking at
//!   every object then also catches a dir deleted and created again under the same name.
//! - **Image re-tagged**: iSulad rewrites `images.json` through a temporary file and
//!   `rename(2)` into the image dir, which moves the image dir's stamp but not the area's;
//!   image dirs are looked at every scan, so seen **next scan**.
//! - **Layer or image not ready yet** (a pull in progress): probed every scan, so it becomes
//!   ready the **next scan** after the writer finishes.
//! - **Freshly written objects**: timestamps have a granularity, and a directory changed
//!   twice within one tick keeps its mtime. A stamp is only trusted once it is
//!   [`RACY_MARGIN`] older than the moment it was read (as git does with its "racily clean"
//!   index entries); until then the object is probed every scan. The same holds for an area
//!   listing.
//! - **A ready layer's metadata changed** (a file renamed into its dir, which moves only that
//!   dir's stamp): iSulad never does this, a layer is immutable once complete; seen within
//!   **`E` scans** (80 s with the defaults) by the rotation.
//! - **A file edited in place** (no rename, the dir's stamp does not move; the tar-split is
//!   the one file iSulad writes in place, and only before the layer is complete): seen within
//!   **`E` scans** by the file stamps of the rotation. A tar-split once found complete is not
//!   decoded again while its stamp holds.
//!
//! A scan that finds nothing new (no object added, gone, or probed with a different
//! outcome) says so ([`ScanStats::dirty`] false), and the caller skips the readiness rules,
//! the diff and the swap. Otherwise the scan notes which objects changed, and the
//! cross-object rules (chains, image to top layer) judge again only those and what depends
//! on them, over the cached facts (see `rejudge`).
//!
//! The two layer areas are as large as each other and independent: while one is scanned,
//! the other is, on a second thread (or one after the other if no thread can be started).
//! After a pull or a removal both are listed again and every object in them looked at, so
//! this halves the wall time of those scans on a machine with two cores or more.
//!
//! A scan fails as a whole, instead of yielding an empty index, when the remote root cannot
//! be opened or an area fails with an error that says the remote itself is in trouble
//! (`EIO`, `ENOTCONN`, `ESTALE`, a network error): the caller keeps what it had.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::stat::{FileStat, SFlag};
use parking_lot::Mutex;

use super::fingerprint::{Fingerprint, Part, Stamp};
use super::isulad;
use super::nofollow::{self, DirHandle, EntryError};
#[cfg(test)]
use super::readiness;
use super::readiness::{AreaRef, FactsRef};
use super::rejudge::{AreaFacts, Changes, Judged, Sources};
use super::scan::{self, Probe, Probed};
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
    /// The id-named entries of the last listing, sorted by name: one vector rather than a
    /// map, walked in order every scan without a lookup per object.
    entries: Vec<Entry<T>>,
    /// Entries that could not be looked at in the last scan, with the reason.
    errors: BTreeMap<String, String>,
    /// Why the area itself could not be read in the last scan.
    problem: Option<String>,
}

impl<T> Default for AreaCache<T> {
    fn default() -> Self {
        AreaCache {
            stamp: None,
            entries: Vec::new(),
            errors: BTreeMap::new(),
            problem: None,
        }
    }
}

/// One id-named entry of an area listing.
#[derive(Debug)]
struct Entry<T> {
    name: Box<str>,
    /// Which slice of the rotation the entry is in (a hash of its name).
    slot: u32,
    /// `None` until probed, and for an entry that is not an object directory.
    seen: Option<Seen<T>>,
}

/// Which object directories of an area are looked at (`lstat`) in a scan whose listing of
/// the area is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AreaPolicy {
    /// Every one: images are re-tagged in place (`images.json` renamed into the image
    /// directory), which moves the image directory's stamp but not the area's.
    StatEveryObject,
    /// Only those not ready or not settled last time, and the scan's rotation slice: a
    /// layer is immutable once complete, so a change to a ready one is an anomaly that may
    /// be noticed a few scans late.
    StatInRotation,
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
    /// What changed in the caches since the verdicts were last brought up to date.
    changes: Changes,
    /// The verdicts as of the last index.
    judged: Judged,
}

impl Scanner {
    pub fn new(root: &Path, driver: &str) -> Scanner {
        Scanner {
            root: root.to_owned(),
            driver: driver.to_owned(),
            full_check_every: 16,
            racy_margin: RACY_MARGIN,
            scans: 0,
            overlay: AreaCache::default(),
            layers: AreaCache::default(),
            images: AreaCache::default(),
            stats: ScanStats::default(),
            changes: Changes::default(),
            judged: Judged::default(),
        }
    }

    /// What the last scan read.
    pub fn stats(&self) -> ScanStats {
        self.stats
    }

    /// The remote root this scanner reads.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The storage driver whose areas it reads.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// Like [`scan`](Self::scan), but `Ok(None)` when nothing differs from the previous
    /// scan, so the caller keeps the index it has and skips the readiness rules, the diff
    /// and the swap: what makes an idle round cost little more than the `lstat`s above.
    /// `force` asks for an index regardless (the caller no longer has the last one), with
    /// every object judged afresh.
    pub fn scan_if_changed(&mut self, force: bool) -> Result<Option<LayoutIndex>, ScanFailure> {
        let first = self.scans == 0;
        let clock = Instant::now();
        let valid = self.refresh()?;
        let scanned = clock.elapsed();
        if !force && !first && !self.stats.dirty && self.changes.is_empty() {
            tracing::debug!(scan_ms = ms(scanned), "remote scanned: nothing changed");
            return Ok(None);
        }
        self.changes.all |= force;
        let index = self.index(valid);
        tracing::debug!(
            scan_ms = ms(scanned),
            readiness_ms = ms(clock.elapsed() - scanned),
            "remote scanned and judged"
        );
        Ok(Some(index))
    }

    /// Scans the shared areas, reusing what has not changed since the previous scan.
    pub fn scan(&mut self) -> Result<LayoutIndex, ScanFailure> {
        let valid = self.refresh()?;
        Ok(self.index(valid))
    }

    /// The index of what the caches hold now: the objects that changed since the last one
    /// are judged again (see `rejudge`).
    fn index(&mut self, valid_driver: bool) -> LayoutIndex {
        if !valid_driver {
            return LayoutIndex::invalid_driver(&self.driver);
        }
        let (overlay_dir, layers_dir, images_dir) = self.area_dirs();
        let overlay_path = format!("{overlay_dir}/RO");
        let layers_path = format!("{layers_dir}/RO");
        let overlay = AreaView {
            path: &overlay_path,
            cache: &self.overlay,
        };
        let layers = AreaView {
            path: &layers_path,
            cache: &self.layers,
        };
        let images = AreaView {
            path: &images_dir,
            cache: &self.images,
        };
        let sources = Sources {
            overlay: &overlay,
            layers: &layers,
            images: &images,
        };
        let changes = std::mem::take(&mut self.changes);
        if changes.all || !self.judged.can_update(&self.driver) {
            let facts = FactsRef {
                overlay: area_facts(&overlay_path, &self.overlay),
                layers: area_facts(&layers_path, &self.layers),
                images: area_facts(&images_dir, &self.images),
            };
            self.judged.rebuild(facts, &sources, &self.driver)
        } else {
            self.judged.update(&sources, changes)
        }
    }

    /// The index a scan from scratch would give for what the caches hold now: every rule
    /// applied to every object, none of the kept verdicts used.
    #[cfg(test)]
    pub(crate) fn resolve_from_scratch(&self) -> LayoutIndex {
        let (overlay_dir, layers_dir, images_dir) = self.area_dirs();
        let paths = [
            format!("{overlay_dir}/RO"),
            format!("{layers_dir}/RO"),
            images_dir,
        ];
        let facts = FactsRef {
            overlay: area_facts(&paths[0], &self.overlay),
            layers: area_facts(&paths[1], &self.layers),
            images: area_facts(&paths[2], &self.images),
        };
        readiness::resolve(facts, &self.driver)
    }

    fn area_dirs(&self) -> (String, String, String) {
        (
            self.driver.clone(),
            format!("{}-layers", self.driver),
            format!("{}-images", self.driver),
        )
    }

    /// Brings the caches up to date; `false` for a driver name that is not one.
    fn refresh(&mut self) -> Result<bool, ScanFailure> {
        if !is_driver_name(&self.driver) {
            self.scans = self.scans.wrapping_add(1);
            return Ok(false);
        }
        self.stats = ScanStats::default();
        self.scans = self.scans.wrapping_add(1);
        let root = DirHandle::open_root(&self.root)
            .map_err(|e| ScanFailure(format!("remote root {}: {e}", self.root.display())))?;
        let (overlay_dir, layers_dir, images_dir) = self.area_dirs();
        let slice = Slice {
            scan: self.scans,
            every: self.full_check_every.max(1),
            margin: self.racy_margin,
        };
        let mut tallies: [Tally; 3] = Default::default();
        let [overlay_tally, layers_tally, images_tally] = &mut tallies;
        // The two layer areas are as large as each other and independent: the overlay area
        // is scanned on a second thread meanwhile, or here if no thread can be started.
        let overlay_job = Mutex::new(Some((&mut self.overlay, overlay_tally)));
        let scan_overlay = || {
            let (cache, tally) = overlay_job.lock().take()?;
            Some(refresh_area(
                &root,
                &[&overlay_dir, "RO"],
                cache,
                scan::probe_overlay,
                AreaPolicy::StatInRotation,
                slice,
                tally,
            ))
        };
        let results = std::thread::scope(|scope| {
            let overlay = std::thread::Builder::new()
                .name("refresh-scan-2".into())
                .spawn_scoped(scope, scan_overlay);
            let layers = refresh_area(
                &root,
                &[&layers_dir, "RO"],
                &mut self.layers,
                scan::probe_layer,
                AreaPolicy::StatInRotation,
                slice,
                layers_tally,
            );
            let images = refresh_area(
                &root,
                &[&images_dir],
                &mut self.images,
                scan::probe_image,
                AreaPolicy::StatEveryObject,
                slice,
                images_tally,
            );
            let overlay = match overlay {
                Ok(thread) => thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                Err(_) => scan_overlay(),
            };
            [overlay.unwrap_or(Ok(())), layers, images]
        });
        // What the areas noted stands even if one of them failed: their caches moved on.
        for (area, tally) in tallies.into_iter().enumerate() {
            self.stats.listed += tally.stats.listed;
            self.stats.probed += tally.stats.probed;
            self.stats.reused += tally.stats.reused;
            self.stats.dirty |= tally.stats.dirty;
            self.changes.all |= tally.all;
            let ids = if area == 2 {
                &mut self.changes.images
            } else {
                &mut self.changes.layers
            };
            ids.extend(tally.ids);
        }
        for result in results {
            result?;
        }
        Ok(true)
    }
}

/// A duration in milliseconds, for logs.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
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
    fn due(self, slot: u32) -> bool {
        self.every <= 1
            || u64::from(slot) % u64::from(self.every) == self.scan % u64::from(self.every)
    }
}

/// The rotation slot of an object name (FNV-1a; ids are uniform hex, so any mixing spreads
/// them evenly over the slices).
fn slot_of(name: &str) -> u32 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (h ^ (h >> 32)) as u32
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

/// Brings one area's cache up to date; `Ok(Some(problem))` when the area itself cannot be
/// read (it then contributes nothing, as in a full scan).
fn refresh_area<T: HasFingerprint>(
    root: &DirHandle,
    components: &[&str],
    cache: &mut AreaCache<T>,
    probe: Probe<T>,
    policy: AreaPolicy,
    slice: Slice,
    tally: &mut Tally,
) -> Result<(), ScanFailure> {
    let clock = Instant::now();
    let (listed, probed) = (tally.stats.listed, tally.stats.probed);
    let problem = refresh_objects(root, components, cache, probe, policy, slice, tally)?;
    tracing::debug!(
        area = %components.join("/"),
        listed = tally.stats.listed > listed,
        probed = tally.stats.probed - probed,
        ms = ms(clock.elapsed()),
        "area scanned"
    );
    // An area that cannot be read is in the not-ready list, by its path: every object is
    // judged again while it is, and once more when it is readable again.
    if problem.is_some() || cache.problem.is_some() {
        tally.everything();
    }
    cache.problem = problem;
    Ok(())
}

/// What one area's refresh read, and what it changed.
#[derive(Debug, Default)]
struct Tally {
    stats: ScanStats,
    /// Ids of the objects whose facts were added, removed or replaced.
    ids: BTreeSet<String>,
    /// Set when the area changed as a whole.
    all: bool,
}

impl Tally {
    /// The facts of object `id` were added, removed or replaced.
    fn changed(&mut self, id: &str) {
        self.stats.dirty = true;
        if !self.ids.contains(id) {
            self.ids.insert(id.to_owned());
        }
    }

    /// The area was dropped, or could not be read.
    fn everything(&mut self) {
        self.stats.dirty = true;
        self.all = true;
    }
}

/// [`refresh_area`] but for the area's own problem, which it returns.
fn refresh_objects<T: HasFingerprint>(
    root: &DirHandle,
    components: &[&str],
    cache: &mut AreaCache<T>,
    probe: Probe<T>,
    policy: AreaPolicy,
    slice: Slice,
    tally: &mut Tally,
) -> Result<Option<String>, ScanFailure> {
    let path = components.join("/");
    // Entries that could not even be looked at are re-tried every scan, so they are not
    // kept from one scan to the next.
    for name in std::mem::take(&mut cache.errors).into_keys() {
        tally.changed(&name);
    }
    let dir = match walk(root, components) {
        Ok(Some(dir)) => dir,
        Ok(None) => {
            if cache.stamp.is_some() {
                tally.everything();
            }
            *cache = AreaCache::default();
            return Ok(None);
        }
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(e) => {
            *cache = AreaCache::default();
            tally.everything();
            return Ok(Some(format!("{path}: {e}")));
        }
    };
    let now = SystemTime::now();
    let dir_stamp = match dir.stat() {
        Ok(st) => stamp_of(&st),
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(e) => {
            *cache = AreaCache::default();
            tally.everything();
            return Ok(Some(format!("cannot list: {e}")));
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
                *cache = AreaCache::default();
                tally.everything();
                return Ok(Some(format!("cannot list: {e}")));
            }
        };
        tally.stats.listed += 1;
        cache.stamp = Some((dir_stamp, now));
        // Both sorted: the entries that stay keep what was seen of them, and objects that
        // left the listing leave the cache.
        let mut old = std::mem::take(&mut cache.entries).into_iter().peekable();
        let mut entries = Vec::with_capacity(names.len());
        for name in names.into_iter().filter(|n| isulad::is_object_id(n)) {
            let mut seen = None;
            while let Some(entry) = old.next_if(|e| *e.name <= *name) {
                if *entry.name == *name {
                    seen = entry.seen;
                } else if entry.seen.is_some() {
                    tally.changed(&entry.name);
                }
            }
            entries.push(Entry {
                slot: slot_of(&name),
                name: name.into_boxed_str(),
                seen,
            });
        }
        for entry in old.filter(|e| e.seen.is_some()) {
            tally.changed(&entry.name);
        }
        cache.entries = entries;
    }
    // A listing that moved may hide an object deleted and created again under the same
    // name since the last scan: every object of the area is looked at once more.
    let look_at_all = !listing_valid || policy == AreaPolicy::StatEveryObject;

    for entry in &mut cache.entries {
        let name: &str = &entry.name;
        let due = slice.due(entry.slot);
        if !look_at_all && !due {
            let trusted = entry.seen.as_ref().is_some_and(|seen| {
                seen.probed.as_ref().is_ok_and(|facts| !facts.faulty())
                    && settled(&seen.stamp, seen.read_at, slice.margin)
            });
            if trusted {
                tally.stats.reused += 1;
                continue;
            }
        }
        let st = match dir.lstat(name) {
            Ok(st) => st,
            Err(EntryError::Missing) => {
                if entry.seen.take().is_some() {
                    tally.changed(name);
                }
                continue;
            }
            Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
            Err(e) => {
                tally.changed(name);
                entry.seen = None;
                cache
                    .errors
                    .insert(name.to_owned(), format!("{path}/{name}: {e}"));
                continue;
            }
        };
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if kind != SFlag::S_IFDIR && kind != SFlag::S_IFLNK {
            // Garbage named like an id: never an object (as a full scan skips it).
            if entry.seen.take().is_some() {
                tally.changed(name);
            }
            continue;
        }
        let stamp = stamp_of(&st);
        let reusable = entry.seen.as_ref().is_some_and(|seen| {
            let Ok(facts) = &seen.probed else {
                return false;
            };
            // A file found faulty may be mended in place, which the directory's stamp does
            // not show: its files are looked at every scan.
            seen.stamp == stamp
                && settled(&seen.stamp, seen.read_at, slice.margin)
                && ((!due && !facts.faulty()) || files_unchanged(&dir, name, seen))
        });
        if reusable {
            tally.stats.reused += 1;
            continue;
        }
        tally.stats.probed += 1;
        let prev = entry.seen.as_ref().and_then(|s| s.probed.as_ref().ok());
        let probed = match dir.subdir(name) {
            Ok(object) => probe(&object, name, prev.map(|f| f.fingerprint())),
            Err(EntryError::Missing) => {
                if entry.seen.take().is_some() {
                    tally.changed(name);
                }
                continue;
            }
            Err(e) if is_remote_failure(&e) => {
                return Err(ScanFailure(format!("{path}/{name}: {e}")))
            }
            Err(e) => Err(format!("{path}/{name}: {e}")),
        };
        // Read again with the same outcome (a stamp not yet settled, a pull still in
        // progress): nothing for the readiness rules. Equal fingerprints mean equal facts,
        // since they carry the directory's stamp and a hash of every file the facts come from.
        let same_outcome = match (entry.seen.as_ref().map(|s| &s.probed), &probed) {
            (Some(Err(old)), Err(new)) => old == new,
            (Some(Ok(old)), Ok(new)) => old.fingerprint() == new.fingerprint(),
            _ => false,
        };
        if !same_outcome {
            tally.changed(name);
        }
        entry.seen = Some(Seen {
            stamp,
            read_at: now,
            probed,
        });
    }
    Ok(None)
}

/// One area's cache, as the readiness rules look objects up in it.
struct AreaView<'a, T> {
    path: &'a str,
    cache: &'a AreaCache<T>,
}

impl<T> AreaFacts<T> for AreaView<'_, T> {
    fn path(&self) -> &str {
        self.path
    }

    fn problem(&self) -> Option<&str> {
        self.cache.problem.as_deref()
    }

    fn get(&self, id: &str) -> Option<(&str, Result<&T, &str>)> {
        // An entry that could not be looked at counts as its error.
        if let Some((name, error)) = self.cache.errors.get_key_value(id) {
            return Some((name, Err(error)));
        }
        let at = self
            .cache
            .entries
            .binary_search_by(|e| (*e.name).cmp(id))
            .ok()?;
        let entry = &self.cache.entries[at];
        let probed = entry.seen.as_ref()?.probed.as_ref();
        Some((&entry.name, probed.map_err(String::as_str)))
    }

    fn ids(&self) -> Vec<&str> {
        let entries = self.cache.entries.iter().filter(|e| e.seen.is_some());
        let mut ids: Vec<&str> = entries.map(|e| &*e.name).collect();
        ids.extend(self.cache.errors.keys().map(String::as_str));
        ids
    }
}

/// The facts of one area for the readiness rules, borrowed from its cache.
fn area_facts<'a, T>(path: &'a str, cache: &'a AreaCache<T>) -> AreaRef<'a, T> {
    let mut objects: BTreeMap<&str, Result<&T, &str>> = cache
        .entries
        .iter()
        .filter_map(|e| {
            let probed = e.seen.as_ref()?.probed.as_ref();
            Some((&*e.name, probed.map_err(String::as_str)))
        })
        .collect();
    for (id, error) in &cache.errors {
        objects.insert(id, Err(error));
    }
    AreaRef {
        path,
        objects,
        problem: cache.problem.as_deref(),
    }
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
        Part::TarSplit | Part::BadTarSplit(_) => format!("{id}.tar-split.gz"),
        Part::ImagesJson => "images.json".to_owned(),
        Part::Manifest => "manifest".to_owned(),
        Part::Config => isulad::config_file_name(id),
    })
}

/// The per-object facts of every area carry the fingerprint of what they read.
pub(crate) trait HasFingerprint {
    fn fingerprint(&self) -> &Fingerprint;

    /// Whether the facts record a file at fault (see [`scan::LayerFacts::broken`]).
    fn faulty(&self) -> bool {
        false
    }
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

    fn faulty(&self) -> bool {
        self.broken.is_some()
    }
}

impl HasFingerprint for scan::ImageFacts {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
}
