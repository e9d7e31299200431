//! What the numbering keeps across a daemon's death (DESIGN §13).
//!
//! The kernel knows nodes by number and never says which it holds; overlay mounts stacked
//! on the view cache the numbers too. A daemon that resumes a connection must therefore give
//! every number the same meaning the dead one gave it. Numbers derived from local inodes
//! need nothing kept (`exports` finds their objects again). The rest is written down as it
//! happens, before the reply that hands the number out, as [`Fact`]s appended to a
//! [`Journal`] that outlives the daemon (the keeper holds it):
//!
//! - numbers given by parent and name (synthesized entries, remote names with several
//!   links), and their withdrawal;
//! - the numbers copied-up objects keep (their remote original's), until they are deleted;
//! - how far the counter has gone, a block at a time, so that no number is given twice;
//! - where a node numbered after the remote (or from the counter) was placed: its parent and
//!   name, from which a resumed daemon looks it up again.
//!
//! A resumed daemon reads the facts back in order ([`super::inodes::InodeTable::restore`]):
//! the last word on a key wins.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

/// The record kind of [`Fact::Placed`].
const PLACED: u8 = 6;

/// A record: its kind, its numbers, then its name.
fn record(kind: u8, numbers: &[u64], name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 8 * numbers.len() + name.len());
    out.push(kind);
    for n in numbers {
        out.extend_from_slice(&n.to_le_bytes());
    }
    out.extend_from_slice(name);
    out
}

/// Where facts go: appended whole, in the order they happened, and kept while the mount
/// lives. Appending must not fail the request that made the fact; a journal that cannot
/// take one stops resuming from being exact, which it reports itself.
pub trait Journal: Send + Sync + std::fmt::Debug {
    fn append(&self, record: &[u8]);
}

/// One thing the numbering did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fact {
    /// `number` was given to `name` in `parent`.
    Named {
        parent: u64,
        name: OsString,
        number: u64,
    },
    /// The number of `name` in `parent` was withdrawn.
    Unnamed { parent: u64, name: OsString },
    /// The local object `(dev, ino)` is a copy numbered `number`.
    Origin { dev: u64, ino: u64, number: u64 },
    /// The local object `(dev, ino)` is gone.
    OriginGone { dev: u64, ino: u64 },
    /// Counter numbers below `upto` may have been given.
    Reserved { upto: u64 },
    /// Node `number` was placed as `name` in `parent`.
    Placed {
        number: u64,
        parent: u64,
        name: OsString,
    },
}

impl Fact {
    /// The fact as a record: a kind byte, its numbers, then its name if it has one.
    pub fn encode(&self) -> Vec<u8> {
        let (kind, numbers, name): (u8, &[u64], Option<&OsString>) = match self {
            Fact::Named {
                parent,
                name,
                number,
            } => (1, &[*parent, *number], Some(name)),
            Fact::Unnamed { parent, name } => (2, std::slice::from_ref(parent), Some(name)),
            Fact::Origin { dev, ino, number } => (3, &[*dev, *ino, *number], None),
            Fact::OriginGone { dev, ino } => (4, &[*dev, *ino], None),
            Fact::Reserved { upto } => (5, std::slice::from_ref(upto), None),
            Fact::Placed {
                number,
                parent,
                name,
            } => (PLACED, &[*number, *parent], Some(name)),
        };
        record(kind, numbers, name.map_or(&[][..], |n| n.as_bytes()))
    }

    /// The record of [`Fact::Placed`], made from a borrowed name: a lookup that places a
    /// node journals it without copying the name twice.
    pub fn placed_record(number: u64, parent: u64, name: &OsStr) -> Vec<u8> {
        record(PLACED, &[number, parent], name.as_bytes())
    }

    /// A record back as a fact; `None` for one this daemon does not know or that is cut.
    pub fn decode(record: &[u8]) -> Option<Fact> {
        let (&kind, rest) = record.split_first()?;
        let count = match kind {
            1 | 4 | 6 => 2,
            2 | 5 => 1,
            3 => 3,
            _ => return None,
        };
        if rest.len() < 8 * count {
            return None;
        }
        let n = |i: usize| u64::from_le_bytes(rest[8 * i..8 * i + 8].try_into().unwrap());
        let name = || OsString::from_vec(rest[8 * count..].to_vec());
        Some(match kind {
            1 => Fact::Named {
                parent: n(0),
                number: n(1),
                name: name(),
            },
            2 => Fact::Unnamed {
                parent: n(0),
                name: name(),
            },
            3 => Fact::Origin {
                dev: n(0),
                ino: n(1),
                number: n(2),
            },
            4 => Fact::OriginGone {
                dev: n(0),
                ino: n(1),
            },
            5 => Fact::Reserved { upto: n(0) },
            _ => Fact::Placed {
                number: n(0),
                parent: n(1),
                name: name(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fact_reads_back_as_written() {
        let name = OsString::from("a\u{e9}b");
        for fact in [
            Fact::Named {
                parent: 1,
                name: name.clone(),
                number: 1 << 63 | 5,
            },
            Fact::Unnamed {
                parent: 9,
                name: name.clone(),
            },
            Fact::Origin {
                dev: 3,
                ino: 4,
                number: 1 << 62 | 7,
            },
            Fact::OriginGone { dev: 3, ino: 4 },
            Fact::Reserved { upto: 8193 },
            Fact::Placed {
                number: 1 << 62 | 11,
                parent: 1,
                name: OsString::new(),
            },
        ] {
            assert_eq!(Fact::decode(&fact.encode()), Some(fact));
        }
        assert_eq!(Fact::decode(&[1, 2, 3]), None, "a cut record is no fact");
        assert_eq!(Fact::decode(&[77; 40]), None, "nor is an unknown kind");
    }
}
