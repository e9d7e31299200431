//! Open files and their data through the daemon: opens and closes as the quota must know
//! them, writes, `fallocate`, truncates and `copy_file_range`. Data calls allocate as the
//! caller (see [`crate::store::creds`]); inside a quota root each reserves what it may
//! allocate and is charged what it did (see [`crate::quota::Accounting`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use nix::errno::Errno;

use super::node::Node;
use super::{Caller, View};
use crate::quota::{Accounting, Allocated, Charge, Charged, Gone, Need, Reserved, Under};
use crate::store::{self, creds};

impl View {
    /// Writes `data` at `offset` of the open file `fd` of `node`, within its quota: a
    /// write that only partly fits is cut short at the limit, as on a full disk.
    pub fn write_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        offset: u64,
        data: &[u8],
        caller: Caller,
    ) -> Result<usize, Errno> {
        let write = |data: &[u8]| creds::run_as(caller.acting(), || pwrite_all(fd, data, offset));
        let under = self.quota().under(node);
        if under.is_none() {
            return write(data);
        }
        let st = store::stat_fd(fd)?;
        let len = data.len() as u64;
        let room = self.quota().reserve(
            &under,
            Need::Write {
                fd,
                st: &st,
                offset,
                len,
            },
        )?;
        let written = write(&data[..room.granted() as usize]);
        self.charge_file(&under, node, fd, Some(Allocated::of(&st)));
        drop(room);
        written
    }

    /// `fallocate(2)` within the quota: allocating more than the room fails before
    /// anything is allocated; punching holes credits what they free.
    pub fn fallocate_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        mode: i32,
        offset: u64,
        length: u64,
        caller: Caller,
    ) -> Result<(), Errno> {
        let call = || {
            creds::run_as(caller.acting(), || {
                Errno::result(unsafe {
                    libc::fallocate(
                        fd.as_raw_fd(),
                        mode,
                        offset as libc::off_t,
                        length as libc::off_t,
                    )
                })
            })
            .map(drop)
        };
        let under = self.quota().under(node);
        if under.is_none() {
            return call();
        }
        let st = store::stat_fd(fd)?;
        let frees = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_COLLAPSE_RANGE) != 0;
        let room = match frees {
            true => None,
            false => Some(self.quota().reserve(
                &under,
                Need::Range {
                    fd,
                    st: &st,
                    offset,
                    len: length,
                },
            )?),
        };
        let result = call();
        self.charge_file(&under, node, fd, Some(Allocated::of(&st)));
        drop(room);
        result
    }

    /// Changes the size of the file `fd` of `node` within its quota. Growing a file makes
    /// a hole, free where the filesystem has sparse files; where it allocated anyway and
    /// went over the limit, the old size is put back.
    pub(in crate::view) fn truncate_within_quota(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> Result<(), Errno> {
        let truncate = |len: u64| {
            Errno::result(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }).map(drop)
        };
        let under = self.quota().under(node);
        if under.is_none() {
            return truncate(size);
        }
        let st = store::stat_fd(fd)?;
        let old_size = st.st_size.max(0) as u64;
        let before = Some(Allocated::of(&st));
        truncate(size)?;
        let grew = self.charge_file(&under, node, fd, before);
        if let Some(over) = grew.over.filter(|_| size > old_size && grew.bytes > 0) {
            truncate(old_size)?;
            self.charge_file(&under, node, fd, before);
            return Err(over);
        }
        Ok(())
    }

    /// `copy_file_range(2)` of `len` bytes from `(src, offset_in)` into `(dst, offset_out)`,
    /// `dst` an open file of `node`, within its quota.
    pub fn copy_range_at(
        &self,
        node: &Arc<Node>,
        (src, offset_in): (BorrowedFd<'_>, u64),
        (dst, offset_out): (BorrowedFd<'_>, u64),
        len: u64,
        caller: Caller,
    ) -> Result<usize, Errno> {
        let copy = |len: u64| {
            let mut off_in = offset_in as libc::loff_t;
            let mut off_out = offset_out as libc::loff_t;
            creds::run_as(caller.acting(), || {
                Errno::result(unsafe {
                    libc::copy_file_range(
                        src.as_raw_fd(),
                        &mut off_in,
                        dst.as_raw_fd(),
                        &mut off_out,
                        len.min(1 << 30) as usize,
                        0,
                    )
                })
            })
            .map(|n| n as usize)
        };
        let under = self.quota().under(node);
        if under.is_none() {
            return copy(len);
        }
        let st = store::stat_fd(dst)?;
        let room = self.quota().reserve(
            &under,
            Need::Write {
                fd: dst,
                st: &st,
                offset: offset_out,
                len,
            },
        )?;
        let copied = copy(room.granted());
        self.charge_file(&under, node, dst, Some(Allocated::of(&st)));
        drop(room);
        copied
    }

    /// Charges what the file `node`, open as `fd`, holds now (see [`Charge::File`]).
    fn charge_file(
        &self,
        under: &Under,
        node: &Node,
        fd: BorrowedFd<'_>,
        before: Option<Allocated>,
    ) -> Charged {
        let change = Charge::File {
            obj: node,
            fd,
            before,
        };
        self.quota().charge(under, change)
    }

    /// What a writer of `node` (open through `fd`) must hold while its writes are counted
    /// but a shared mapping of it maps the file itself: the kernel binds every open of a
    /// file that is open for passthrough reading to the same backing file, so a mapping
    /// could fill the file's holes unseen. Its holes are set aside in the quota for as long
    /// as the open lasts (`EDQUOT` when they do not fit), and what it did is measured at
    /// its close. `None` outside quota roots.
    pub fn hold_holes(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
    ) -> Result<Option<Reserved>, Errno> {
        let under = self.quota().under(node);
        if under.is_none() {
            return Ok(None);
        }
        self.quota().reserve(&under, Need::Holes { fd }).map(Some)
    }

    /// Whether an open of `node` may do its I/O with FUSE passthrough, unseen by the
    /// daemon (see [`Accounting::may_passthrough`]). It counts as a passthrough open from
    /// before the quota is asked, so that a quota being set meanwhile sees it;
    /// [`View::bypass_refused`] takes it back.
    pub fn may_bypass(&self, node: &Arc<Node>) -> bool {
        node.state().passthrough_opens += 1;
        let free = self.quota().may_passthrough(node);
        if !free {
            self.bypass_refused(node);
        }
        free
    }

    /// An open that [`View::may_bypass`] counted does not do passthrough after all.
    pub fn bypass_refused(&self, node: &Node) {
        let mut state = node.state();
        state.passthrough_opens = state.passthrough_opens.saturating_sub(1);
    }

    /// An open of `node` was made (see [`View::released`]); `maps_writes`: it is a
    /// passthrough open that may write.
    pub fn opened(&self, node: &Node, maps_writes: bool) {
        let mut state = node.state();
        state.open_files += 1;
        state.mapped_writers += maps_writes as u32;
    }

    /// Measures a file again, through an open of it, after its data reached the disk: a
    /// filesystem may allocate metadata (extent blocks) only at writeback, after the write
    /// was charged.
    pub fn resettle(&self, node: &Arc<Node>, fd: BorrowedFd<'_>) {
        let under = self.quota().under(node);
        if !under.is_none() {
            self.charge_file(&under, node, fd, None);
        }
    }

    /// An open of `node` was closed; the last close of a file whose names are all gone
    /// frees its space. `counted`: the open's descriptor, if it is of the file the quota
    /// counts (an open from before a copy-up reads the remote file, which it does not).
    pub fn released(
        &self,
        node: &Arc<Node>,
        counted: Option<BorrowedFd<'_>>,
        bypasses: bool,
        maps_writes: bool,
    ) {
        if let Some(fd) = counted {
            self.resettle(node, fd);
        }
        {
            let mut state = node.state();
            state.open_files = state.open_files.saturating_sub(1);
            state.passthrough_opens = state.passthrough_opens.saturating_sub(bypasses as u32);
            state.mapped_writers = state.mapped_writers.saturating_sub(maps_writes as u32);
            if state.open_files > 0 {
                return;
            }
        }
        // An open from before a copy-up credits the copy, the file its names led to.
        let object = node.object();
        if let Some(fd) = counted.or(object.as_ref().map(|o| o.as_fd())) {
            self.quota().credit(Gone::Open { obj: &**node, fd });
        }
    }
}

fn pwrite_all(fd: BorrowedFd<'_>, data: &[u8], offset: u64) -> Result<usize, Errno> {
    let mut done = 0;
    while done < data.len() {
        match nix::sys::uio::pwrite(fd, &data[done..], (offset as usize + done) as libc::off_t) {
            Ok(n) => done += n,
            Err(Errno::EINTR) => continue,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}
