//! One async lock per key (a volume id), so that work on one volume waits only for work on
//! that same volume.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedMutexGuard;

/// A lock per key, made on first use and forgotten once nobody holds or waits for it, so the
/// map stays as small as the number of volumes being worked on.
#[derive(Default)]
pub struct KeyedLocks {
    /// Held only to look up, add or remove an entry; never across an await.
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Holds the lock of one key until dropped.
pub struct KeyedGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyedLocks {
    /// Waits for the lock of `key`.
    pub async fn lock(&self, key: &str) -> KeyedGuard<'_> {
        let mutex = Arc::clone(self.entries().entry(key.to_owned()).or_default());
        let guard = mutex.lock_owned().await;
        KeyedGuard {
            locks: self,
            key: key.to_owned(),
            guard: Some(guard),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        // The map is consistent after every statement, so a panic elsewhere cannot leave it
        // half-changed.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for KeyedGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.entries();
        drop(self.guard.take());
        // Entries are cloned out of the map only under its lock, so a count of one (the map's
        // own) means no holder and no waiter: nobody can be handed this entry after it goes.
        if map
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_key_waits_for_itself_only() {
        let locks = KeyedLocks::default();
        let a = locks.lock("a").await;
        // Another key is free at once.
        let b = tokio::time::timeout(Duration::from_secs(1), locks.lock("b"))
            .await
            .expect("key b is not held");
        drop(b);
        // The same key waits until it is released.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), locks.lock("a"))
                .await
                .is_err()
        );
        drop(a);
        drop(
            tokio::time::timeout(Duration::from_secs(1), locks.lock("a"))
                .await
                .expect("key a was released"),
        );
        assert!(locks.entries().is_empty());
    }

    #[tokio::test]
    async fn an_entry_with_a_waiter_outlives_its_holder() {
        let locks = Arc::new(KeyedLocks::default());
        let first = locks.lock("v").await;
        let waiter = {
            let locks = Arc::clone(&locks);
            tokio::spawn(async move {
                let _second = locks.lock("v").await;
            })
        };
        // Let the waiter queue on the lock before the holder lets go.
        while locks.entries().get("v").map(Arc::strong_count) != Some(3) {
            tokio::task::yield_now().await;
        }
        drop(first);
        waiter.await.unwrap();
        assert!(locks.entries().is_empty());
    }
}
