//! One area of the remote as last seen, and bringing it up to date: listing it again only
//! when its stamp moved, looking at its object directories as the area's policy says, and
//! probing again only the objects whose stamps moved (see `incremental` for what a scan
//! looks at and why that is enough).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::stat::{FileStat, SFlag};

use super::fingerprint::{Fingerprint, Part, Stamp};
use super::isulad;
use super::nofollow::{self, DirHandle, EntryError};
use super::readiness::AreaRef;
use super::rejudge::AreaFacts;
use super::scan::{self, Probe, Probed};

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
pub(super) struct AreaCache<T> {
    stamp: Option<(Stamp, SystemTime)>,
    /// The id-named entries of the last listing, sorted by name: one vector rather than a
    /// map, walked in order every scan without a lookup per object.
    entries: Vec<Entry<T>>,
    /// Entries that could not be looked at in the last scan, with the reason.
    errors: BTreeMap<String, String>,
    /// Why the area itself could not be read in the last scan.
    problem: Option<String>,
    /// Where the next light scan's rotation begins (an index into `entries`).
    cursor: usize,
    /// The area as opened by the last scan: a light scan reads its stamp through it rather
    /// than opening it again (on a network filesystem each open and close is a request;
    /// full scans open it afresh).
    dir: Option<DirHandle>,
}

impl<T> Default for AreaCache<T> {
    fn default() -> Self {
        AreaCache {
            stamp: None,
            entries: Vec::new(),
            errors: BTreeMap::new(),
            problem: None,
            cursor: 0,
            dir: None,
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
pub(super) enum AreaPolicy {
    /// Every one: images are re-tagged in place (`images.json` renamed into the image
    /// directory), which moves the image directory's stamp but not the area's.
    StatEveryObject,
    /// Only those not ready or not settled last time, and the scan's rotation slice: a
    /// layer is immutable once complete, so a change to a ready one is an anomaly that may
    /// be noticed a few scans late.
    StatInRotation,
}

/// A duration in milliseconds, for logs.
pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Which objects get a full stamp check in this scan.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slice {
    pub(super) scan: u64,
    pub(super) every: u32,
    /// A light scan (a journal tells what changed): this many objects per area, in turn,
    /// instead of a fraction of them, and no object looked at only because the area's
    /// listing moved or the area's policy says every one.
    pub(super) light: Option<usize>,
    /// Not about slices, but needed in the same places: see [`settled`].
    pub(super) margin: Duration,
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
fn is_remote_failure(e: &EntryError) -> bool {
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
pub(super) fn refresh_area<T: HasFingerprint>(
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
pub(super) struct Tally {
    pub(super) stats: ScanStats,
    /// Ids of the objects whose facts were added, removed or replaced.
    pub(super) ids: BTreeSet<String>,
    /// Set when the area changed as a whole.
    pub(super) all: bool,
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
    let kept = slice.light.and(cache.dir.take());
    let walked = match kept {
        Some(dir) => Ok(Some(dir)),
        None => walk(root, components),
    };
    let dir = match walked {
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
    // name since the last scan: every object of the area is looked at once more (unless a
    // journal names what changed: then only the new names are).
    let look_at_all =
        slice.light.is_none() && (!listing_valid || policy == AreaPolicy::StatEveryObject);
    let len = cache.entries.len();
    let turn = slice
        .light
        .map(|budget| (cache.cursor % len.max(1), budget.min(len)));
    if let Some((start, count)) = turn {
        cache.cursor = (start + count) % len.max(1);
    }
    let AreaCache {
        entries, errors, ..
    } = cache;
    for (at, entry) in entries.iter_mut().enumerate() {
        // A light scan's turn looks at the directory's stamp only, not its files': a ready
        // object's files change in place only by anomaly, and the turn is there to notice
        // what a writer without a publisher did (an object replaced, an image re-tagged).
        let (look, due) = match turn {
            Some((start, count)) => ((at + len - start) % len < count, false),
            None => {
                let due = slice.due(entry.slot);
                (due, due)
            }
        };
        if !look_at_all && !look {
            let trusted = entry.seen.as_ref().is_some_and(|seen| {
                seen.probed.as_ref().is_ok_and(|facts| !facts.faulty())
                    && settled(&seen.stamp, seen.read_at, slice.margin)
            });
            if trusted {
                tally.stats.reused += 1;
                continue;
            }
        }
        look_at(&dir, &path, entry, probe, due, now, slice, tally, errors)?;
    }
    cache.dir = Some(dir);
    Ok(None)
}

/// Brings the named objects of one area up to date, whatever their stamps and the area's
/// listing say: what a journal record asks for. A named object not in the listing yet is
/// added to it; the next scan lists the area anyway (its stamp moved).
pub(super) fn refresh_named<T: HasFingerprint>(
    root: &DirHandle,
    components: &[&str],
    cache: &mut AreaCache<T>,
    probe: Probe<T>,
    names: &BTreeSet<String>,
    slice: Slice,
    tally: &mut Tally,
) -> Result<(), ScanFailure> {
    let path = components.join("/");
    let dir = match walk(root, components) {
        Ok(Some(dir)) => dir,
        // No area: the named objects are not there; the next scan says why.
        Ok(None) => {
            for entry in cache
                .entries
                .iter_mut()
                .filter(|e| names.contains(&*e.name))
            {
                if entry.seen.take().is_some() {
                    tally.changed(&entry.name);
                }
            }
            return Ok(());
        }
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(_) => {
            tally.everything();
            return Ok(());
        }
    };
    let now = SystemTime::now();
    for name in names.iter().filter(|n| isulad::is_object_id(n)) {
        let at = match cache.entries.binary_search_by(|e| (*e.name).cmp(name)) {
            Ok(at) => at,
            Err(at) => {
                cache.entries.insert(
                    at,
                    Entry {
                        slot: slot_of(name),
                        name: name.clone().into_boxed_str(),
                        seen: None,
                    },
                );
                at
            }
        };
        cache.errors.remove(name.as_str());
        let entry = &mut cache.entries[at];
        look_at(
            &dir,
            &path,
            entry,
            probe,
            true,
            now,
            slice,
            tally,
            &mut cache.errors,
        )?;
    }
    Ok(())
}

/// Looks at one object directory: `lstat`, and a probe if its stamps moved (or, when `due`,
/// if any of its files' did).
#[allow(clippy::too_many_arguments)]
fn look_at<T: HasFingerprint>(
    dir: &DirHandle,
    path: &str,
    entry: &mut Entry<T>,
    probe: Probe<T>,
    due: bool,
    now: SystemTime,
    slice: Slice,
    tally: &mut Tally,
    errors: &mut BTreeMap<String, String>,
) -> Result<(), ScanFailure> {
    let name: &str = &entry.name;
    let st = match dir.lstat(name) {
        Ok(st) => st,
        Err(EntryError::Missing) => {
            if entry.seen.take().is_some() {
                tally.changed(name);
            }
            return Ok(());
        }
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}: {e}"))),
        Err(e) => {
            tally.changed(name);
            entry.seen = None;
            errors.insert(name.to_owned(), format!("{path}/{name}: {e}"));
            return Ok(());
        }
    };
    let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
    if kind != SFlag::S_IFDIR && kind != SFlag::S_IFLNK {
        // Garbage named like an id: never an object (as a full scan skips it).
        if entry.seen.take().is_some() {
            tally.changed(name);
        }
        return Ok(());
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
            && ((!due && !facts.faulty()) || files_unchanged(dir, name, seen))
    });
    if reusable {
        tally.stats.reused += 1;
        return Ok(());
    }
    tally.stats.probed += 1;
    let prev = entry.seen.as_ref().and_then(|s| s.probed.as_ref().ok());
    let probed = match dir.subdir(name) {
        Ok(object) => probe(&object, name, prev.map(|f| f.fingerprint())),
        Err(EntryError::Missing) => {
            if entry.seen.take().is_some() {
                tally.changed(name);
            }
            return Ok(());
        }
        Err(e) if is_remote_failure(&e) => return Err(ScanFailure(format!("{path}/{name}: {e}"))),
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
    Ok(())
}

/// One area's cache, as the readiness rules look objects up in it.
pub(super) struct AreaView<'a, T> {
    pub(super) path: &'a str,
    pub(super) cache: &'a AreaCache<T>,
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
pub(super) fn area_facts<'a, T>(path: &'a str, cache: &'a AreaCache<T>) -> AreaRef<'a, T> {
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
