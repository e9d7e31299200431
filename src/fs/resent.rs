//! Requests the kernel sends again (DESIGN §13).
//!
//! A daemon that resumes a connection asks the kernel to send again the requests the dead
//! one had read and not answered (`FUSE_NOTIFY_RESEND`); they come back with bit 63 of
//! their id set. Reads, writes at an offset, attribute changes and lookups may simply be
//! served again. A change to the namespace may not: one the dead daemon made before it died
//! would fail the second time (`EEXIST`, `ENOENT`). The kernel holds the directories such a
//! change names locked from the first sending of the request to its answer, so nothing else
//! can change those names in between, and their state tells whether the change was made:
//! a resent change that fails because it is already made is answered as it would have been
//! the first time.
//!
//! Told wrong: a change that failed the first time because its name already existed (or did
//! not), and whose answer the crash lost, is answered as a success the second time. An
//! exchange (`RENAME_EXCHANGE`) cannot be told from its state and is made again.

use std::ffi::OsStr;

use fuser::Request;
use nix::errno::Errno;

use super::Core;
use crate::view::Entry;

/// Set in the id of a request the kernel sends again.
const RESENT: u64 = 1 << 63;

/// Whether the kernel sends `req` again, after a daemon died with it unanswered.
pub(super) fn resent(req: &Request) -> bool {
    req.unique().0 & RESENT != 0
}

impl Core {
    /// What a resent request that makes `name` in `parent` answers: the entry, if making it
    /// failed because the dead daemon had made it.
    pub(super) fn made_before(
        &self,
        resent: bool,
        parent: u64,
        name: &OsStr,
        made: Result<Entry, Errno>,
    ) -> Result<Entry, Errno> {
        match made {
            Err(Errno::EEXIST) if resent => self.view.lookup(parent, name),
            made => made,
        }
    }

    /// What a resent removal answers: done, if it failed because the dead daemon had
    /// removed the name.
    pub(super) fn removed_before(
        &self,
        resent: bool,
        removed: Result<(), Errno>,
    ) -> Result<(), Errno> {
        match removed {
            Err(Errno::ENOENT) if resent => Ok(()),
            removed => removed,
        }
    }

    /// What a resent rename answers: done, if its source is gone and its target there.
    pub(super) fn renamed_before(
        &self,
        resent: bool,
        exchange: bool,
        target: (u64, &OsStr),
        renamed: Result<(), Errno>,
    ) -> Result<(), Errno> {
        match renamed {
            Err(Errno::ENOENT) if resent && !exchange => {
                let (parent, name) = target;
                let entry = self.view.lookup(parent, name).map_err(|_| Errno::ENOENT)?;
                // Looked at, not handed to the kernel.
                self.view.inodes.forget(entry.node.ino, 1);
                Ok(())
            }
            renamed => renamed,
        }
    }
}
