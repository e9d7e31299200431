//! Names and attributes: lookups, the namespace changes and `statfs`.

use super::*;

impl Core {
    pub(super) fn lookup(
        &self,
        parent: INodeNo,
        name: &OsStr,
        reply: ReplyEntry,
    ) -> Handed<ReplyEntry> {
        // `.` and `..` come only from file handles (see `view::exports`): the node by its
        // number, and a directory's parent. The kernel makes ENOENT of either ESTALE.
        let found = match name.as_encoded_bytes() {
            b"." => Some(self.patiently(|view| view.find(parent.0))),
            b".." => Some(self.patiently(|view| view.parent_of(parent.0))),
            _ => None,
        };
        if let Some(found) = found {
            let entry = opened!(reply, found);
            self.reply_entry(reply, &entry);
            return Ok(());
        }
        let entry = match self.patiently(|view| view.lookup(parent.0, name)) {
            // A negative entry: the kernel remembers the name is absent. Names appear only
            // through this daemon (which the kernel sees) or a refresh (which invalidates).
            Err(Errno::ENOENT) if !self.timeouts.entry.is_zero() => {
                outcome::failed(Errno::ENOENT);
                reply.entry_with_ttls(
                    &self.timeouts.attr,
                    &self.timeouts.entry,
                    &attr::negative(),
                    Generation(0),
                );
                return Ok(());
            }
            looked => opened!(reply, looked),
        };
        self.reply_entry(reply, &entry);
        Ok(())
    }

    pub(super) fn forget(&self, ino: INodeNo, nlookup: u64) {
        self.view.inodes.forget(ino.0, nlookup);
    }

    pub(super) fn getattr(&self, ino: INodeNo, reply: ReplyAttr) {
        let node = tri!(reply, self.view.node(ino.0));
        // A node holds its object: attributes stay readable when its name is gone, and
        // are the copy's once a remote file open through `fh` was copied up.
        let st = tri!(reply, self.view.getattr(&node));
        reply.attr(&self.attr_ttl(&node), &file_attr(&st));
    }

    pub(super) fn setattr(
        &self,
        req: Who,
        ino: INodeNo,
        set: SetAttr,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        let node = tri!(reply, self.view.node(ino.0));
        let who = caller(req);
        // A SETATTR that changes nothing is the kernel asking for the set-ID bits to go (see
        // `init`: a write, fallocate or copy by a caller without CAP_FSETID, or a chown).
        let kill = set.is_empty() && ctime.is_none();
        // A truncate by an unprivileged caller clears them as a write does (the kernel's
        // flag for it is not passed on by the FUSE library).
        if kill || (set.size.is_some() && who.uid != 0) {
            tri!(reply, self.view.drop_privileges(&node, who));
        }
        let handle = fh.and_then(|fh| self.file(fh).ok());
        let open = handle
            .as_ref()
            .and_then(|h| h.as_file())
            .filter(|f| f.layer == crate::view::Layer::Local)
            .map(|f| f.fd.as_fd());
        let st = tri!(reply, self.view.setattr(&node, &set, open));
        reply.attr(&self.attr_ttl(&node), &file_attr(&st));
    }

    pub(super) fn readlink(&self, ino: INodeNo, reply: ReplyData) {
        let node = tri!(reply, self.view.node(ino.0));
        let target = tri!(reply, self.view.readlink(&node));
        reply.data(&target);
    }

    // The request's own arguments, and whether it is sent again (see `resent`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mknod(
        &self,
        who: Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        resent: bool,
        reply: ReplyEntry,
    ) -> Handed<ReplyEntry> {
        let made = self.patiently(|view| view.mknod(parent.0, name, mode, rdev, who));
        let entry = opened!(reply, self.made_before(resent, parent.0, name, made));
        self.reply_entry(reply, &entry);
        Ok(())
    }

    pub(super) fn mkdir(
        &self,
        who: Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        resent: bool,
        reply: ReplyEntry,
    ) -> Handed<ReplyEntry> {
        let made = self.patiently(|view| view.mkdir(parent.0, name, mode, who));
        let entry = opened!(reply, self.made_before(resent, parent.0, name, made));
        self.reply_entry(reply, &entry);
        Ok(())
    }

    pub(super) fn unlink(&self, parent: INodeNo, name: &OsStr, resent: bool, reply: ReplyEmpty) {
        let removed = self.view.unlink(parent.0, name);
        tri!(reply, self.removed_before(resent, removed));
        reply.ok();
    }

    pub(super) fn rmdir(&self, parent: INodeNo, name: &OsStr, resent: bool, reply: ReplyEmpty) {
        let removed = self.view.rmdir(parent.0, name);
        tri!(reply, self.removed_before(resent, removed));
        reply.ok();
    }

    pub(super) fn symlink(
        &self,
        req: Who,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        resent: bool,
        reply: ReplyEntry,
    ) -> Handed<ReplyEntry> {
        let (target, who) = (target.as_os_str(), caller(req));
        let made = self.patiently(|view| view.symlink(parent.0, link_name, target, who));
        let entry = opened!(reply, self.made_before(resent, parent.0, link_name, made));
        self.reply_entry(reply, &entry);
        Ok(())
    }

    // The request's own arguments, and whether it is sent again (see `resent`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rename(
        &self,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        resent: bool,
        reply: ReplyEmpty,
    ) {
        let renamed = self
            .view
            .rename(parent.0, name, newparent.0, newname, flags.bits());
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let target = (newparent.0, newname);
        tri!(
            reply,
            self.renamed_before(resent, exchange, target, renamed)
        );
        reply.ok();
    }

    pub(super) fn link(
        &self,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        resent: bool,
        reply: ReplyEntry,
    ) -> Handed<ReplyEntry> {
        let made = self.patiently(|view| view.link(ino.0, newparent.0, newname));
        let entry = opened!(reply, self.made_before(resent, newparent.0, newname, made));
        self.reply_entry(reply, &entry);
        Ok(())
    }

    pub(super) fn statfs(&self, ino: INodeNo, reply: ReplyStatfs) {
        let node = tri!(reply, self.view.node(ino.0));
        let s = tri!(reply, self.view.statfs_at(&node));
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            s.f_namemax as u32,
            s.f_frsize as u32,
        );
    }

    pub(super) fn access(&self, ino: INodeNo, reply: ReplyEmpty) {
        // default_permissions: the kernel checks permissions itself.
        tri!(reply, self.view.node(ino.0));
        reply.ok();
    }
}
