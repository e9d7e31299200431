//! Integrity at rest: a ready image is verified against the size and SHA-512 recorded when it
//! was made each time its state is read ([`ImageStore::get`]), hashing it again only when its
//! file's (size, mtime, inode, ctime) changed since the last verification. One that fails is
//! quarantined: its file moved aside and the state saying why ([`ImageState::quarantined`]);
//! waiting for it is `DATA_LOSS`. A state file that cannot be decoded is moved aside and its
//! image file removed: nothing recorded could vouch for that image, and a snapshot no state
//! names can be deleted (it is gone) instead of failing every call.
//!
//! It is kept apart from the store's plain reads and writes because it is what judges the files
//! and moves them, under `checking`, which a removal takes too: a quarantine never writes back
//! the state of an image deleted meanwhile.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::lock;
use super::state::ImageState;
use super::store::{FileKey, ImageStore, NODE_END};
use crate::copy;
use crate::error::{CsiError, Result};
use crate::files::{self, remove_if_there};

/// Where files that failed verification are moved, inside the images directory.
pub const QUARANTINE_DIR: &str = ".quarantine";

impl ImageStore {
    /// Moves a state file that cannot be decoded aside, and removes its image file. Read
    /// again first, under the lock: a writer may have replaced it by a good one meanwhile.
    pub(super) fn quarantine_state(
        &self,
        name: &str,
        path: &Path,
        why: &str,
    ) -> Result<Option<ImageState>> {
        let _checking = lock(&self.checking);
        match files::read_json_lenient::<ImageState>(path)? {
            None => return Ok(None),
            Some(Ok(state)) => return Ok(Some(state)),
            Some(Err(_)) => {}
        }
        let moved = self.move_aside(path, &format!("{name}.json"))?;
        if let Some(data) = self.data_path(name) {
            remove_if_there(&data)?;
        }
        lock(&self.verified).remove(name);
        files::sync_dir(&self.dir)?;
        tracing::error!(image = %name, error = %why, moved_to = ?moved,
            "backing image state file is corrupt: quarantined it and removed its image file; \
             its snapshot no longer exists");
        Ok(None)
    }

    /// Checks a ready image's file against the size and SHA-512 recorded when it was made;
    /// a file unchanged since it last checked out is not hashed again. One that fails is
    /// moved aside and `state` (also on disk) says why in [`ImageState::quarantined`]. A
    /// missing file is said so in `state` only: there is nothing to move, and its state may
    /// be being removed.
    pub fn verify(&self, state: &mut ImageState) -> Result<()> {
        let name = state.name.clone();
        let Some(data) = self.data_path(&name) else {
            return Ok(());
        };
        let _checking = lock(&self.checking);
        let meta = match fs::metadata(&data) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                state.quarantined = Some(format!("its file {} is missing", data.display()));
                return Ok(());
            }
            Err(e) => return Err(CsiError::io(format!("checking image {name}"), e)),
        };
        let key = FileKey::of(&meta);
        let recorded = state.current_checksum.clone();
        if let Some(sum) = &recorded {
            if lock(&self.verified)
                .get(&name)
                .is_some_and(|(k, s)| *k == key && s == sum)
            {
                return Ok(());
            }
        }
        let problem = if !meta.is_file() {
            Some("it is not a regular file".to_owned())
        } else if meta.len() != state.size {
            Some(format!(
                "its size is {} bytes, but {} bytes were recorded when it was made",
                meta.len(),
                state.size
            ))
        } else if let Some(sum) = &recorded {
            self.hashed.fetch_add(1, Ordering::Relaxed);
            let got = copy::sha512_file(&data)?;
            if got == *sum {
                lock(&self.verified).insert(name.clone(), (key, got));
                None
            } else {
                Some(format!(
                    "its SHA-512 is {got}, but {sum} was recorded when it was made"
                ))
            }
        } else {
            Some("no checksum was recorded when it was made".to_owned())
        };
        let Some(problem) = problem else {
            return Ok(());
        };
        lock(&self.verified).remove(&name);
        let moved = self.move_aside(&data, &format!("{name}.img"))?;
        let reason = match moved {
            Some(to) => format!("{problem}; the file was moved to {}", to.display()),
            None => problem,
        };
        tracing::error!(image = %name, reason = %reason,
            "backing image failed verification: quarantined");
        state.quarantined = Some(reason);
        if self.state_path(&name).is_some_and(|p| p.exists()) {
            self.save(state)?;
        }
        Ok(())
    }

    /// Records that the image `name`, just stored with checksum `sum`, checks out as it is.
    pub(super) fn verified_now(&self, name: &str, sum: &str) {
        if let Some(meta) = self.data_path(name).and_then(|p| fs::metadata(p).ok()) {
            lock(&self.verified).insert(name.to_owned(), (FileKey::of(&meta), sum.to_owned()));
        }
    }

    /// How many times an image was hashed for verification.
    pub fn hashed(&self) -> u64 {
        self.hashed.load(Ordering::Relaxed)
    }

    /// Moves `path` into the quarantine directory as `<when>~<label>`; `None` when it is gone.
    fn move_aside(&self, path: &Path, label: &str) -> Result<Option<PathBuf>> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = self.dir.join(QUARANTINE_DIR);
        fs::create_dir_all(&dir)
            .map_err(|e| CsiError::io(format!("creating {}", dir.display()), e))?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let to = dir.join(format!(
            "{}-{}-{n}{NODE_END}{label}",
            files::now_secs(),
            std::process::id()
        ));
        match fs::rename(path, &to) {
            Ok(()) => {
                files::sync_dir(&dir)?;
                Ok(Some(to))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CsiError::io(format!("quarantining {}", path.display()), e)),
        }
    }

    /// The quarantined files of the image `name`.
    pub fn quarantined_files(&self, name: &str) -> Vec<PathBuf> {
        let dir = self.dir.join(QUARANTINE_DIR);
        let Ok(entries) = fs::read_dir(&dir) else {
            return Vec::new();
        };
        let (img, json) = (format!("{name}.img"), format!("{name}.json"));
        entries
            .flatten()
            .filter(|e| {
                let file = e.file_name().to_string_lossy().into_owned();
                file.split_once(NODE_END)
                    .is_some_and(|(_, label)| label == img || label == json)
            })
            .map(|e| e.path())
            .collect()
    }

    /// Removes what was quarantined of the image `name` and nothing else: for a snapshot whose
    /// state file was corrupt, once it is deleted. Returns how many files went.
    pub fn remove_quarantined(&self, name: &str) -> Result<usize> {
        let _checking = lock(&self.checking);
        self.remove_quarantined_locked(name)
    }

    pub(super) fn remove_quarantined_locked(&self, name: &str) -> Result<usize> {
        let quarantined = self.quarantined_files(name);
        for path in &quarantined {
            remove_if_there(path)?;
        }
        if !quarantined.is_empty() {
            // Only once empty: other images' files may still be there.
            let _ = fs::remove_dir(self.dir.join(QUARANTINE_DIR));
            files::sync_dir(&self.dir)?;
        }
        Ok(quarantined.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing_image::Progress;
    use std::collections::BTreeMap;
    use std::os::unix::fs::FileExt;

    fn ready_image(store: &ImageStore, name: &str, data: &[u8]) -> ImageState {
        let path = store.data_path(name).unwrap();
        fs::write(&path, data).unwrap();
        let sum = copy::sha512_file(&path).unwrap();
        let state = ImageState {
            name: name.to_owned(),
            csi_name: None,
            source_type: "download".into(),
            parameters: BTreeMap::new(),
            expected_checksum: None,
            current_checksum: Some(sum),
            format: Some("raw".into()),
            size: data.len() as u64,
            virtual_size: data.len() as u64,
            created: 1,
            progress: Progress::default(),
            cut: false,
            ready: true,
            node: "n1".into(),
            quarantined: None,
        };
        store.save(&state).unwrap();
        state
    }

    /// An unchanged image is hashed once; any change to its file makes it hashed again.
    #[test]
    fn verification_is_cached_by_file_identity() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "a", &[7u8; 100_000]);
        for _ in 0..3 {
            let state = store.get("a").unwrap().unwrap();
            assert_eq!(state.quarantined, None);
        }
        assert_eq!(store.list().unwrap().len(), 1);
        assert_eq!(store.hashed(), 1, "hashed once while unchanged");
        // The same bytes written again: the file changed (mtime, ctime), so it is read again,
        // and checks out.
        let path = store.data_path("a").unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[7u8], 10)
            .unwrap();
        assert_eq!(store.get("a").unwrap().unwrap().quarantined, None);
        assert_eq!(store.hashed(), 2);
    }

    #[test]
    fn a_changed_image_is_quarantined_and_removed_with_its_state() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "b", &[1u8; 4096]);
        let path = store.data_path("b").unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[2u8], 0)
            .unwrap();
        let state = store.get("b").unwrap().unwrap();
        let why = state.quarantined.expect("quarantined");
        assert!(why.contains("SHA-512"), "{why}");
        assert!(!path.exists());
        assert_eq!(store.quarantined_files("b").len(), 1);
        assert_eq!(store.quarantined_files("a").len(), 0);
        // Said on disk too, and not verified again.
        let again = store.get("b").unwrap().unwrap();
        assert_eq!(again.quarantined.as_deref(), Some(why.as_str()));
        store.remove("b").unwrap();
        assert!(store.get("b").unwrap().is_none());
        assert!(!dir.path().join("images").join(QUARANTINE_DIR).exists());
    }

    #[test]
    fn an_undecodable_state_is_quarantined_with_its_image_removed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "c", &[3u8; 4096]);
        ready_image(&store, "d", &[4u8; 4096]);
        let state = dir.path().join("images/c.json");
        let text = fs::read(&state).unwrap();
        fs::write(&state, &text[..text.len() / 3]).unwrap();
        let listed: Vec<String> = store
            .list_recorded()
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(listed, ["d"]);
        assert!(!state.exists());
        assert!(!store.data_path("c").unwrap().exists());
        assert_eq!(store.quarantined_files("c").len(), 1);
        assert!(store.get("c").unwrap().is_none());
        assert_eq!(store.get("d").unwrap().unwrap().quarantined, None);
    }
}
