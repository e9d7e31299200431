//! Open files: opens (and the passthrough each gets), I/O through the daemon, release and sync.

use std::os::fd::BorrowedFd;

use super::*;

impl Core {
    /// How an open is served, and what it holds of its quota. Reads never allocate, so a
    /// read-only open gets passthrough anywhere. One that may write gets it only outside
    /// quota roots; under one, its writes go through the daemon, uncached, naming the
    /// inode's backing file where readers gave it one (see `backing`, and
    /// [`crate::view::View::hold_holes`] for what such a writer holds). A remote file
    /// opened for writing before its copy-up has no file to write through yet: its I/O goes
    /// through the daemon. `None`: the kernel's inode has a backing file of another layer
    /// (see `backing`).
    fn grant(
        &self,
        node: &Arc<Node>,
        fd: &OwnedFd,
        layer: Layer,
        writes: bool,
        who: Caller,
        open: impl FnOnce(&OwnedFd) -> std::io::Result<fuser::BackingId>,
    ) -> Result<Option<Granted>, Errno> {
        let free = !writes || self.view.may_bypass(node);
        let before_copy_up = writes && layer != Layer::Local;
        let opening = Opening {
            layer,
            passthrough: self.passthrough.load(Ordering::Relaxed) && free && !before_copy_up,
            intercept: writes && !free,
            writes,
            rights: registered_rights(who, layer),
        };
        let opening_rights = opening.rights;
        let grant = self
            .backing
            .acquire(node.ino, opening, || backing_as(who, layer, || open(fd)));
        if writes && free && !matches!(grant, Some(Grant::Passthrough(_))) {
            self.view.bypass_refused(node);
        }
        let Some(grant) = grant else {
            return Ok(None);
        };
        let held = match grant {
            Grant::Direct(_) => match self.view.hold_holes(node, fd.as_fd()) {
                Ok(held) => held,
                Err(e) => {
                    self.backing.release(node.ino);
                    return Err(e);
                }
            },
            _ => None,
        };
        Ok(Some(Granted {
            grant,
            held,
            rights: opening_rights,
        }))
    }

    /// The local copy of a remote file `file` opened before it was copied up, once it has
    /// one: reads through the daemon share the kernel's page cache with writers of the copy,
    /// so they must read the copy too (as kernel overlayfs redirects them).
    fn copy_of(&self, file: &OpenFile) -> Result<Option<Arc<OwnedFd>>, Errno> {
        if file.layer != Layer::Remote || file.node.layer() != Layer::Local {
            return Ok(None);
        }
        let mut copy = file.copy.lock();
        if copy.is_none() {
            *copy = Some(Arc::new(self.view.reopen(&file.node, file.copy_flags)?));
        }
        Ok(copy.clone())
    }

    /// What a read through `file` reads: the copy, for a remote file opened before a
    /// copy-up (see [`Core::copy_of`]), else the file it opened.
    fn readable<'a>(&self, file: &'a OpenFile) -> Result<Target<'a>, Errno> {
        Ok(match self.copy_of(file)? {
            Some(copy) => Target::Copy(copy),
            None => Target::Opened(&file.fd),
        })
    }

    /// What a change through `file` writes to: the file it opened, or, for a remote file
    /// opened before its copy-up, the copy, made now if this is the file's first change.
    fn writable<'a>(&self, file: &'a OpenFile) -> Result<Target<'a>, Errno> {
        if file.layer == Layer::Local {
            return Ok(Target::Opened(&file.fd));
        }
        if !file.writes() {
            return Err(Errno::EBADF);
        }
        if file.node.layer() != Layer::Local {
            self.view.copy_up(&file.node, true)?;
        }
        self.copy_of(file)?.map(Target::Copy).ok_or(Errno::EIO)
    }

    /// How the kernel is to cache an open file's data.
    fn open_flags(&self, grant: &Grant) -> FopenFlags {
        match grant {
            Grant::Passthrough(_) => FopenFlags::empty(),
            Grant::Cached if self.keep_cache => FopenFlags::FOPEN_KEEP_CACHE,
            Grant::Cached => FopenFlags::empty(),
            Grant::Direct(_) | Grant::Uncached => FopenFlags::FOPEN_DIRECT_IO,
        }
    }

    /// Records an open and what it was granted; returns its handle number and the grant,
    /// for the reply.
    fn opened(
        &self,
        node: &Arc<Node>,
        fd: OwnedFd,
        layer: Layer,
        flags: i32,
        created: bool,
        Granted {
            grant,
            held,
            rights,
        }: Granted,
    ) -> (u64, Grant) {
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        // A shared writable mapping of this open changes the file where the daemon cannot
        // see it: from now on the kernel trusts none of its attributes (see `attr_ttl`). A
        // file just created is new to the kernel, which takes its attributes from the reply.
        let maps_writes = writes && matches!(grant, Grant::Passthrough(_) | Grant::Direct(_));
        let bypasses = writes && matches!(grant, Grant::Passthrough(_));
        self.view.opened(node, maps_writes);
        if maps_writes && !created {
            self.notices.drop_attributes(node.ino);
        }
        let fh = self.handles.insert(Handle::File(OpenFile {
            node: node.clone(),
            bypasses,
            maps_writes,
            fd,
            layer,
            mode: grant.mode(),
            copy: Mutex::new(None),
            copy_flags: copy_flags(flags),
            _held: held,
        }));
        self.note_open(HandleFact::Opened(resume::Opened {
            fh,
            ino: node.ino,
            flags,
            layer,
            mode: grant.mode(),
            backing: match &grant {
                Grant::Passthrough(id) | Grant::Direct(id) => Some(id.raw()),
                Grant::Cached | Grant::Uncached => None,
            },
            rights,
            bypasses,
            maps_writes,
        }));
        (fh, grant)
    }

    pub(super) fn open(
        &self,
        req: Who,
        ino: INodeNo,
        flags: OpenFlags,
        reply: ReplyOpen,
    ) -> Handed<ReplyOpen> {
        let node = tri!(reply, self.view.node(ino.0));
        let writes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        // A remote file opened for writing is copied up by its first change (a truncating
        // open's SETATTR copies no data), unless the kernel's inode maps the remote file
        // for passthrough readers: a writer then needs a new inode, bound to the copy (see
        // `backing`), and the copy is made now.
        let defer = writes
            && node.layer() != Layer::Local
            && !self.backing.bound_to(node.ino, Layer::Remote);
        let (fd, layer) = opened!(
            reply,
            self.patiently(|view| view.open(&node, flags.0, defer))
        );
        let who = caller(req);
        let granted = self.grant(&node, &fd, layer, writes, who, |fd| reply.open_backing(fd));
        let Some(granted) = tri!(reply, granted) else {
            // The kernel's inode is bound to the remote copy it had before a copy-up, and
            // would map it: the node goes, and the kernel, told the open is stale, looks
            // the name up again and gets a new node for the copy.
            for (parent, name) in self.view.detach(&node) {
                self.notices.drop_name(parent, name);
            }
            reply.error(errno(Errno::ESTALE));
            return Ok(());
        };
        let (fh, grant) = self.opened(&node, fd, layer, flags.0, false, granted);
        let fopen = self.open_flags(&grant);
        match &grant {
            // The kernel wants every open of an inode with a backing file to name it.
            Grant::Passthrough(id) | Grant::Direct(id) => {
                reply.opened_passthrough(FileHandle(fh), fopen, id)
            }
            Grant::Cached | Grant::Uncached => reply.opened(FileHandle(fh), fopen),
        }
        Ok(())
    }

    pub(super) fn read(&self, fh: FileHandle, offset: u64, size: u32, reply: ReplyData) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let target = tri!(reply, self.readable(file));
        let fd = target.as_fd();
        let mut buf = vec![0u8; size as usize];
        let mut done = 0;
        while done < buf.len() {
            match nix::sys::uio::pread(
                fd,
                &mut buf[done..],
                (offset as usize + done) as libc::off_t,
            ) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(Errno::EINTR) => continue,
                Err(e) => return reply.error(errno(e)),
            }
        }
        reply.data(&buf[..done]);
    }

    pub(super) fn write(
        &self,
        req: Who,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        reply: ReplyWrite,
    ) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let who = caller(req);
        // Direct-I/O writes by a caller without CAP_FSETID come with this instead of a
        // SETATTR.
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            tri!(reply, self.view.drop_privileges(&file.node, who));
        }
        let target = tri!(reply, self.writable(file));
        let done = tri!(
            reply,
            self.view
                .write_at(&file.node, target.as_fd(), offset, data, who)
        );
        reply.written(done as u32);
    }

    pub(super) fn release(&self, fh: FileHandle, reply: ReplyEmpty) {
        // Journaled once done: a release resent after a crash finds the handle still open
        // in the journal, and is done again by the daemon that resumes.
        if self.release_orphan(fh.0) {
            self.note_open(HandleFact::Released { fh: fh.0 });
            return reply.ok();
        }
        if let Some(handle) = self.handles.remove(fh.0) {
            if let Some(file) = handle.as_file() {
                self.backing.release(file.node.ino);
                if file.layer != Layer::Local && file.writes() {
                    self.view.writer_closed(&file.node);
                }
                // The kernel trusts nothing it was told of a file written through a mapping
                // (see `Core::attr_ttl`): nothing to drop here.
                let counted = file.counted();
                self.view
                    .released(&file.node, counted, file.bypasses, file.maps_writes);
            }
        }
        self.note_open(HandleFact::Released { fh: fh.0 });
        reply.ok();
    }

    pub(super) fn fsync(&self, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        // An open from before a copy-up syncs the copy its changes went to.
        let target = tri!(reply, self.readable(file));
        let res = if datasync {
            nix::unistd::fdatasync(target.as_fd())
        } else {
            nix::unistd::fsync(target.as_fd())
        };
        tri!(reply, res);
        if let Some(fd) = file.counted() {
            self.view.resettle(&file.node, fd);
        }
        reply.ok();
    }

    // The request's own arguments, and whether it is sent again (see `resent`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create(
        &self,
        who: Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        flags: i32,
        resent: bool,
        reply: ReplyCreate,
    ) -> Handed<ReplyCreate> {
        let made = match self.patiently(|view| view.create(parent.0, name, mode, flags, who)) {
            // Made by the daemon that died with the request (see `resent`): opened now.
            Err(Errno::EEXIST) if resent => self.view.lookup(parent.0, name).and_then(|entry| {
                let reopen = flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
                let (fd, _) = self.view.open(&entry.node, reopen, false)?;
                Ok((entry, fd))
            }),
            made => made,
        };
        let (entry, fd) = opened!(reply, made);
        let layer = crate::view::Layer::Local;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let granted = self.grant(&entry.node, &fd, layer, writes, who, |fd| {
            reply.open_backing(fd)
        });
        // A new object has no other open to be bound to.
        let granted = tri!(reply, granted).unwrap_or(Granted {
            grant: Grant::Uncached,
            held: None,
            rights: registered_rights(who, layer),
        });
        let (fh, grant) = self.opened(&entry.node, fd, layer, flags, true, granted);
        let fopen = self.open_flags(&grant);
        let backing = match &grant {
            Grant::Passthrough(id) | Grant::Direct(id) => Some(&**id),
            Grant::Cached | Grant::Uncached => None,
        };
        // The name is cached as any looked-up name is, however briefly the attributes are.
        reply.created_with_ttls(
            &self.created_ttl(&entry.node),
            &self.timeouts.entry,
            &file_attr(&entry.stat),
            Generation(u64::from(entry.node.generation)),
            FileHandle(fh),
            fopen,
            backing,
        );
        Ok(())
    }

    pub(super) fn fallocate(
        &self,
        req: Who,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let target = tri!(reply, self.writable(file));
        tri!(
            reply,
            self.view.fallocate_at(
                &file.node,
                target.as_fd(),
                mode,
                offset,
                length,
                caller(req)
            )
        );
        reply.ok();
    }

    pub(super) fn lseek(&self, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let target = tri!(reply, self.readable(file));
        let res = unsafe { libc::lseek(target.as_fd().as_raw_fd(), offset as libc::off_t, whence) };
        let pos = tri!(reply, Errno::result(res));
        reply.offset(pos);
    }

    /// `from` and `to`: an open file and an offset in it.
    pub(super) fn copy_file_range(
        &self,
        req: Who,
        from: (FileHandle, u64),
        to: (FileHandle, u64),
        len: u64,
        reply: ReplyWrite,
    ) {
        let ((fh_in, offset_in), (fh_out, offset_out)) = (from, to);
        let (src, dst) = (
            tri!(reply, self.file(fh_in)),
            tri!(reply, self.file(fh_out)),
        );
        let (Some(src), Some(dst)) = (src.as_file(), dst.as_file()) else {
            return reply.error(errno(Errno::EBADF));
        };
        let to = tri!(reply, self.writable(dst));
        // What a read of `src` would read, taken after `dst`'s copy-up: the two may be one
        // remote file.
        let from = tri!(reply, self.readable(src));
        let n = tri!(
            reply,
            self.view.copy_range_at(
                &dst.node,
                (from.as_fd(), offset_in),
                (to.as_fd(), offset_out),
                len,
                caller(req),
            )
        );
        reply.written(n as u32);
    }
}

/// The descriptor a request on an open file works on: the file it opened, or the copy of a
/// remote file opened before its copy-up.
enum Target<'a> {
    Opened(&'a OwnedFd),
    Copy(Arc<OwnedFd>),
}

impl AsFd for Target<'_> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Target::Opened(fd) => fd.as_fd(),
            Target::Copy(fd) => fd.as_fd(),
        }
    }
}

/// How an open's local copy is opened, from its own flags (see [`OpenFile::copy_flags`]).
pub(super) fn copy_flags(flags: i32) -> i32 {
    match flags & libc::O_ACCMODE {
        libc::O_RDONLY => libc::O_RDONLY,
        _ => libc::O_RDWR | (flags & (libc::O_SYNC | libc::O_DSYNC)),
    }
}

/// What an open was granted: its I/O mode, and the quota it holds while open.
struct Granted {
    grant: Grant,
    held: Option<Reserved>,
    /// Whose rights a backing file registered for it has.
    rights: Rights,
}

/// Registers a passthrough backing file. The kernel writes through it later with the
/// credentials it was registered with, so a local file is registered as the caller:
/// allocations by passthrough writes then meet local's reserved blocks as the caller's would.
/// Remote files keep the daemon's: a network filesystem checks every read against them.
fn backing_as<T>(who: Caller, layer: Layer, register: impl FnOnce() -> T) -> T {
    match layer {
        // Registering creates nothing, so the umask of a CREATE's caller is not set for it.
        Layer::Local => creds::run_as(
            creds::As {
                umask: None,
                ..who.acting()
            },
            register,
        ),
        _ => register(),
    }
}

/// The rights a backing file registered by [`backing_as`] carries.
fn registered_rights(who: Caller, layer: Layer) -> Rights {
    match layer {
        Layer::Local if who.uid != 0 => Rights::User,
        _ => Rights::Root,
    }
}
