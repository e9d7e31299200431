//! Directory handles: a listing is read once per open and served from the handle.

use super::*;

impl Core {
    pub(super) fn opendir(&self, ino: INodeNo, reply: ReplyOpen) {
        let node = tri!(reply, self.view.node(ino.0));
        if !node.is_dir() {
            return reply.error(errno(Errno::ENOTDIR));
        }
        let fh = self.handles.insert(Handle::Dir(DirHandle {
            ino: ino.0,
            entries: Mutex::new(Arc::new(Vec::new())),
        }));
        // The kernel may keep a listing across opens, as it keeps names: a directory's
        // entries change only through this mount (which bumps the directory's version, and
        // that drops the cached listing) or through a refresh, which invalidates the
        // directories whose entries it changes (see `refresh::invalidate`).
        let cache = if self.timeouts.entry.is_zero() || !self.keep_cache {
            FopenFlags::empty()
        } else {
            FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
        };
        reply.opened(FileHandle(fh), cache);
    }

    pub(super) fn readdir(
        &self,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) -> Handed<ReplyDirectory> {
        let (handle, adopted) = match self.handles.get(fh.0) {
            Some(handle) => (handle, false),
            // A directory an earlier daemon opened (see `resume`): its listing is taken
            // again, and read on from the same offset.
            None if self.resumed.load(Ordering::Relaxed) => {
                let dir = Handle::Dir(DirHandle {
                    ino: ino.0,
                    entries: Mutex::new(Arc::new(Vec::new())),
                });
                (self.handles.insert_at(fh.0, dir), true)
            }
            None => {
                reply.error(errno(Errno::EBADF));
                return Ok(());
            }
        };
        let dir = tri!(reply, handle.as_dir().ok_or(Errno::EBADF));
        // Offset 0 is an opendir or a rewind: take a fresh listing.
        let entries = if offset == 0 || adopted {
            let node = tri!(reply, self.view.node(ino.0));
            let listing = Arc::new(opened!(reply, self.patiently(|view| view.list(&node))));
            *dir.entries.lock() = listing.clone();
            listing
        } else {
            dir.entries.lock().clone()
        };
        let parent = self
            .view
            .node(ino.0)
            .ok()
            .and_then(|n| n.primary())
            .map_or(ino.0, |(p, _)| p.ino);
        // Offsets: 1 is after ".", 2 after "..", 3 + i after entries[i].
        let dots = [(".", ino.0), ("..", parent)];
        for (i, (name, dot_ino)) in dots.iter().enumerate().skip(offset as usize) {
            if reply.add(
                INodeNo(*dot_ino),
                i as u64 + 1,
                fuser::FileType::Directory,
                name,
            ) {
                reply.ok();
                return Ok(());
            }
        }
        let skip = (offset as usize).saturating_sub(2);
        for (i, e) in entries.iter().enumerate().skip(skip) {
            if reply.add(INodeNo(e.ino), (i + 3) as u64, file_type(e.kind), &e.name) {
                break;
            }
        }
        reply.ok();
        Ok(())
    }

    pub(super) fn releasedir(&self, fh: FileHandle, reply: ReplyEmpty) {
        self.handles.remove(fh.0);
        reply.ok();
    }

    pub(super) fn fsyncdir(&self, ino: INodeNo, datasync: bool, reply: ReplyEmpty) {
        let node = tri!(reply, self.view.node(ino.0));
        if let Some(local) = node.dir_fds().local {
            let dir = tri!(
                reply,
                crate::store::reopen(
                    local.as_fd(),
                    nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY
                )
            );
            let res = if datasync {
                nix::unistd::fdatasync(dir.as_fd())
            } else {
                nix::unistd::fsync(dir.as_fd())
            };
            tri!(reply, res);
        }
        reply.ok();
    }
}
