//! What containerd asks of a snapshot that exists: its Info (Stat, List, and Update, which
//! changes only labels), its mounts and what it uses. Reads take the current table without
//! the writer lock, so that they never wait for a change in progress.

use std::collections::BTreeMap;
use std::path::Path;

use super::Snapshots;
use crate::api::types::Mount;
use crate::error::Error;
use crate::filter::{self, Filter};
use crate::meta::{self, Backing, Kind, Record, Usage};
use crate::mounts;
use crate::quota;

/// A snapshot as containerd's Info describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub record: Record,
}

impl Snapshots {
    pub fn stat(&self, key: &str) -> Result<Info, Error> {
        let meta = self.current();
        Ok(Info {
            name: key.to_owned(),
            record: meta.get(key)?.clone(),
        })
    }

    /// Changes a snapshot's labels: all of them (`paths` empty or `labels`), or the ones
    /// named `labels.<key>` (a key absent from `labels` is removed). Nothing else changes.
    pub fn update(
        &self,
        name: &str,
        labels: BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Info, Error> {
        let _writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let record = meta
            .snapshots
            .get_mut(name)
            .ok_or_else(|| Error::NotFound(format!("snapshot {name}")))?;
        if paths.is_empty() || paths.iter().any(|p| p == "labels") {
            record.labels = labels;
        } else {
            for path in paths {
                let Some(key) = path.strip_prefix("labels.") else {
                    return Err(Error::InvalidArgument(format!(
                        "cannot update field {path:?}: only labels can change"
                    )));
                };
                match labels.get(key) {
                    Some(value) => record.labels.insert(key.to_owned(), value.clone()),
                    None => record.labels.remove(key),
                };
            }
        }
        record.updated = meta::now();
        let info = Info {
            name: name.to_owned(),
            record: record.clone(),
        };
        self.publish(meta)?;
        Ok(info)
    }

    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>, Error> {
        let filters = filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>, _>>()?;
        let meta = self.current();
        Ok(meta
            .snapshots
            .iter()
            .filter(|(name, record)| filter::any(&filters, name, record))
            .map(|(name, record)| Info {
                name: name.clone(),
                record: record.clone(),
            })
            .collect())
    }

    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, Error> {
        let meta = self.current();
        // A shared layer removed from the shared tree leaves its snapshots without files:
        // say so, rather than hand out a mount that fails with a bare ENOENT.
        for name in std::iter::once(key).chain(meta.ancestors(key)?) {
            if let Backing::Shared { layer, diff } = &meta.get(name)?.backing {
                if !diff.is_dir() {
                    return Err(Error::FailedPrecondition(format!(
                        "snapshot {name}: its shared layer {layer} is gone from the shared tree"
                    )));
                }
            }
        }
        mounts::mounts(&self.dirs, &meta, key)
    }

    /// What the snapshot `key` uses: for an active one, now (its quota's figures when it
    /// has one); for a committed one, what it used when committed; for one backed by a
    /// shared layer, what that layer's files take (as containerd's snapshotters report a
    /// layer's own size, although it takes no local space).
    pub fn usage(&self, key: &str) -> Result<Usage, Error> {
        let record = self.current().get(key)?.clone();
        if let Backing::Shared { layer, diff } = &record.backing {
            return self.shared_usage(layer, diff);
        }
        match (record.kind, record.usage) {
            (Kind::Committed, Some(usage)) => Ok(usage),
            _ => self.measure(&record),
        }
    }

    /// What a local snapshot takes now: its quota's figures (the whole directory the quota
    /// covers) when it has one, else its files, as containerd's overlay snapshotter
    /// measures its upper directory.
    pub(super) fn measure(&self, record: &Record) -> Result<Usage, Error> {
        match record.quota {
            Some(_) => quota::usage(&self.root, &self.dirs.dir(record)),
            None => quota::walk(&self.dirs.files(record)),
        }
    }

    /// What the shared layer `layer`'s files take: walked once through the view (a layer
    /// never changes once complete), then remembered.
    fn shared_usage(&self, layer: &str, diff: &Path) -> Result<Usage, Error> {
        if let Some(usage) = self.shared_usage.lock().get(layer) {
            return Ok(*usage);
        }
        let usage = quota::walk(diff)?;
        self.shared_usage.lock().insert(layer.to_owned(), usage);
        Ok(usage)
    }
}
