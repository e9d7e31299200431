//! Layers shared with the shared tree (DESIGN §12): a Prepare that carries a chain ID the
//! shared tree holds over the same parent adopts that layer (containerd's remote-snapshot
//! protocol) instead of having it fetched and unpacked, and the Commit of a layer unpacked
//! anyway keeps the shared files and drops the local copy. Both hold only where the chain
//! below the snapshot is known, since a chain ID names every layer below too. The counters
//! say what sharing saved.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::{check_name, check_parent, Snapshots};
use crate::error::Error;
use crate::meta::{self, Backing, Kind, Meta, Place, Record};
use crate::shared;

/// The label containerd's remote-snapshot protocol puts the wanted chain ID in.
pub const REF_LABEL: &str = "containerd.io/snapshot.ref";
/// Marks a snapshot whose files come from elsewhere, with the value stargz and nydus use.
pub const REMOTE_LABEL: &str = "containerd.io/snapshot/remote";
pub const REMOTE_LABEL_VALUE: &str = "remote snapshot";

/// What sharing saved, for metrics: counted since start.
#[derive(Debug, Default)]
pub struct SharingCounters {
    /// Prepares answered with a shared layer (remote-snapshot protocol).
    pub adoptions: std::sync::atomic::AtomicU64,
    /// Commits that kept a shared layer's files instead of the local copy.
    pub dedupes: std::sync::atomic::AtomicU64,
    /// Bytes not written locally thanks to them: the shared layers' sizes for adoptions,
    /// the local copies dropped for dedupes.
    pub bytes_saved: std::sync::atomic::AtomicU64,
}

impl Snapshots {
    /// Answers a labelled Prepare from the shared tree, when it can: Err(AlreadyExists)
    /// once a committed snapshot of the shared layer carries the label over `parent`;
    /// Ok(()) when the shared tree cannot serve it and a normal Prepare must follow.
    pub(super) fn adopt(
        &self,
        key: &str,
        parent: &str,
        target: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<(), Error> {
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        let Some(layer) = shared.find(target) else {
            return Ok(());
        };
        let _writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let parent = check_parent(&meta, parent)?;
        if chain_below(&meta, parent.as_deref())? != Some(layer.parent_chain.clone()) {
            tracing::debug!(
                key,
                target,
                "a shared layer over another parent; preparing normally"
            );
            return Ok(());
        }
        let name = adopted_name(key, target);
        if let Some(existing) = meta.snapshots.get(&name) {
            let same = existing.kind == Kind::Committed
                && existing.parent == parent
                && existing.labels.get(REF_LABEL).map(String::as_str) == Some(target);
            return match same {
                true => Err(Error::AlreadyExists(format!("snapshot {target}"))),
                false => Ok(()),
            };
        }
        let id = meta.next_id.max(1);
        meta.next_id = id + 1;
        let now = meta::now();
        let mut labels = labels.clone();
        labels.insert(REMOTE_LABEL.into(), REMOTE_LABEL_VALUE.into());
        meta.snapshots.insert(
            name.clone(),
            Record {
                id,
                place: Place::Root,
                kind: Kind::Committed,
                parent,
                labels,
                created: now,
                updated: now,
                backing: Backing::Shared {
                    layer: layer.id.clone(),
                    diff: layer.diff.clone(),
                },
                chain: Some(target.to_owned()),
                quota: None,
                usage: None,
            },
        );
        self.publish(meta)?;
        self.counters.adoptions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_saved
            .fetch_add(layer.diff_size.unwrap_or(0), Ordering::Relaxed);
        tracing::info!(target, layer = layer.id, name, "adopted a shared layer");
        Err(Error::AlreadyExists(format!("snapshot {target}")))
    }

    /// Commits the active snapshot `key` as `name`. When `name` is a chain ID the shared
    /// tree holds over the same parent chain, the shared layer's files back the committed
    /// snapshot and the local copy is dropped.
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(), Error> {
        check_name(name)?;
        let chain = chain_of_name(name).map(str::to_owned);
        let shared = match (&self.shared, &chain) {
            (Some(shared), Some(chain)) => shared.find(chain),
            _ => None,
        };
        // Measured before the lock: a walk of a big layer must not hold up other changes.
        // containerd writes nothing into a snapshot it is committing.
        let measured = {
            let active = self.current().get(key)?.clone();
            (active.id, self.measure(&active)?)
        };
        let writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let active = meta.get(key)?.clone();
        if active.kind != Kind::Active {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key} is not active"
            )));
        }
        if meta.snapshots.contains_key(name) {
            return Err(Error::AlreadyExists(format!("snapshot {name}")));
        }
        let dir = self.dirs.dir(&active);
        let usage = match measured {
            (id, usage) if id == active.id => usage,
            // Removed and prepared again meanwhile: measure what is there now.
            _ => self.measure(&active)?,
        };
        let below = chain_below(&meta, active.parent.as_deref())?;
        let dedupe = shared.filter(|layer| below.as_ref() == Some(&layer.parent_chain));
        let mut record = Record {
            kind: Kind::Committed,
            labels,
            updated: meta::now(),
            // A chain ID names every layer below too: over layers of unknown chain, the
            // name cannot be what they are.
            chain: chain.filter(|_| below.is_some()),
            usage: Some(usage),
            ..active
        };
        if let Some(layer) = &dedupe {
            record.backing = Backing::Shared {
                layer: layer.id.clone(),
                diff: layer.diff.clone(),
            };
            // What the snapshot takes now is the shared layer's, measured when asked.
            record.usage = None;
            record
                .labels
                .insert(REMOTE_LABEL.into(), REMOTE_LABEL_VALUE.into());
        }
        meta.snapshots.remove(key);
        meta.snapshots.insert(name.to_owned(), record);
        self.publish(meta)?;
        // No record owns the directory now: it is removed without holding up others.
        drop(writer);
        if let Some(layer) = dedupe {
            self.counters.dedupes.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes_saved
                .fetch_add(usage.size, Ordering::Relaxed);
            tracing::info!(
                name,
                layer = layer.id,
                freed_bytes = usage.size,
                "committed a shared layer's chain: keeping the shared files, dropping the local copy"
            );
            self.discard(&dir);
        }
        Ok(())
    }
}

/// The chain ID of the layers under a snapshot over `parent`: `Some(None)` over none, and
/// `None` where it is not known (the parent, or a snapshot below it, was committed under a
/// name that is no chain ID). A shared layer backs only a snapshot whose layers below are
/// its own, so never one of unknown chain.
fn chain_below(meta: &Meta, parent: Option<&str>) -> Result<Option<Option<String>>, Error> {
    match parent {
        None => Ok(Some(None)),
        Some(p) => Ok(meta.get(p)?.chain.clone().map(Some)),
    }
}

/// containerd names a snapshot `<namespace>/<seq>/<name>`; unpacks commit a layer under
/// its chain ID.
fn chain_of_name(name: &str) -> Option<&str> {
    let last = name.rsplit('/').next()?;
    shared::digest_hex(last).map(|_| last)
}

/// The name an adopted shared layer is committed as: the Prepare key's namespace and
/// sequence number, which containerd allocated for this request alone, and the chain ID.
fn adopted_name(key: &str, target: &str) -> String {
    let mut parts = key.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ns), Some(seq), Some(_)) => format!("{ns}/{seq}/{target}"),
        _ => format!("{key}@{target}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let c = format!("sha256:{}", "a".repeat(64));
        assert_eq!(chain_of_name(&format!("default/3/{c}")), Some(c.as_str()));
        assert_eq!(chain_of_name("default/3/extract-1 x"), None);
        assert_eq!(
            adopted_name("k8s.io/7/extract-1-x sha256:abc", &c),
            format!("k8s.io/7/{c}")
        );
        assert_eq!(adopted_name("plain", &c), format!("plain@{c}"));
    }
}
