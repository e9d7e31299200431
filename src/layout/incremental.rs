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
//! # Light scans and named objects
//!
//! A reader that follows a publication journal ([`Scanner::set_light`]) learns of changes
//! from records that name the objects, which [`Scanner::scan_named`] brings up to date
//! alone. Its timed scans are then light: the area dirs are `fstat`ed through the handles
//! the last scan left open, a listing that moved is merged (new names probed, names gone
//! dropped) without looking at every object again, objects not ready or not settled are
//! looked at as above, and of the rest only `budget` per area, in turn, by their directory's
//! stamp. So an idle light scan of any tree costs 3 `fstat`s and a few `lstat`s.
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

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::area::{
    area_facts, ms, refresh_area, refresh_named, AreaCache, AreaPolicy, AreaView, ScanFailure,
    ScanStats, Slice, Tally,
};
use super::nofollow::DirHandle;
#[cfg(test)]
use super::readiness;
use super::readiness::FactsRef;
use super::rejudge::{Changes, Judged, Sources};
use super::scan;
use super::{is_driver_name, LayoutIndex};

/// How much older than the moment it was read a stamp must be before it is trusted.
pub const RACY_MARGIN: Duration = Duration::from_secs(2);

/// Scans one remote root for one graph driver, incrementally (see the module docs).
#[derive(Debug)]
pub struct Scanner {
    root: PathBuf,
    driver: String,
    /// A full stamp check of every object happens once per this many scans (1 = always).
    pub full_check_every: u32,
    /// How old a stamp must be to be trusted; [`RACY_MARGIN`] unless a test says otherwise.
    pub racy_margin: Duration,
    /// Light scans (see [`Scanner::set_light`]): the objects per area looked at in turn.
    light: Option<usize>,
    /// The remote root as the last scan opened it, which light scans reuse.
    root_dir: Option<DirHandle>,
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
            light: None,
            root_dir: None,
            scans: 0,
            overlay: AreaCache::default(),
            layers: AreaCache::default(),
            images: AreaCache::default(),
            stats: ScanStats::default(),
            changes: Changes::default(),
            judged: Judged::default(),
        }
    }

    /// Makes the following scans light, or full again. A light scan is for a reader that
    /// follows a journal, which names what changed ([`Scanner::scan_named`]): it still
    /// notices objects added to or removed from an area (the area's stamp moves) and
    /// probes objects not ready yet, but otherwise looks at only `budget` objects per area,
    /// in turn, so that its cost does not grow with the tree. What it no longer sees at
    /// once (a re-tag by a writer without a publisher, an object deleted and created again
    /// under its name) waits for the rotation to reach it.
    pub fn set_light(&mut self, budget: Option<usize>) {
        self.light = budget;
    }

    /// Brings the named objects up to date, whatever their stamps say, and judges again
    /// what depends on them: `Ok(None)` when none of them changed. Nothing else of the
    /// remote is read.
    pub fn scan_named(
        &mut self,
        layers: &BTreeSet<String>,
        images: &BTreeSet<String>,
    ) -> Result<Option<LayoutIndex>, ScanFailure> {
        if !is_driver_name(&self.driver) || self.scans == 0 {
            return self.scan_if_changed(false);
        }
        self.stats = ScanStats::default();
        let root = self.open_root()?;
        let (overlay_dir, layers_dir, images_dir) = self.area_dirs();
        let slice = self.slice();
        let mut tallies: [Tally; 3] = Default::default();
        let [overlay_tally, layers_tally, images_tally] = &mut tallies;
        let results = [
            refresh_named(
                &root,
                &[&overlay_dir, "RO"],
                &mut self.overlay,
                scan::probe_overlay,
                layers,
                slice,
                overlay_tally,
            ),
            refresh_named(
                &root,
                &[&layers_dir, "RO"],
                &mut self.layers,
                scan::probe_layer,
                layers,
                slice,
                layers_tally,
            ),
            refresh_named(
                &root,
                &[&images_dir],
                &mut self.images,
                scan::probe_image,
                images,
                slice,
                images_tally,
            ),
        ];
        self.absorb(tallies);
        for result in results {
            result?;
        }
        if !self.stats.dirty && self.changes.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.index(true)))
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
        let root = match self.light.and(self.root_dir.take()) {
            Some(root) => root,
            None => self.open_root()?,
        };
        let (overlay_dir, layers_dir, images_dir) = self.area_dirs();
        let slice = self.slice();
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
        self.absorb(tallies);
        for result in results {
            result?;
        }
        self.root_dir = Some(root);
        Ok(true)
    }

    fn open_root(&self) -> Result<DirHandle, ScanFailure> {
        DirHandle::open_root(&self.root)
            .map_err(|e| ScanFailure(format!("remote root {}: {e}", self.root.display())))
    }

    fn slice(&self) -> Slice {
        Slice {
            scan: self.scans,
            every: self.full_check_every.max(1),
            light: self.light,
            margin: self.racy_margin,
        }
    }

    /// Adds what the three areas' refreshes (overlay, layers, images) noted to the scan's
    /// stats and to the changes the next index judges again.
    fn absorb(&mut self, tallies: [Tally; 3]) {
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
    }
}
