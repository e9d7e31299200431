//! Extended attributes.

use super::*;

impl Core {
    pub(super) fn setxattr(
        &self,
        req: Who,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        reply: ReplyEmpty,
    ) {
        let node = tri!(reply, self.view.node(ino.0));
        tri!(
            reply,
            self.view.setxattr(&node, name, value, flags, caller(req))
        );
        self.mode_may_have_changed(&node, name);
        reply.ok();
    }

    pub(super) fn getxattr(&self, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let node = tri!(reply, self.view.node(ino.0));
        let value = tri!(reply, self.view.getxattr(&node, name));
        reply_sized(reply, &value, size);
    }

    pub(super) fn listxattr(&self, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let node = tri!(reply, self.view.node(ino.0));
        let names = tri!(reply, self.view.listxattr(&node));
        reply_sized(reply, &names, size);
    }

    pub(super) fn removexattr(&self, req: Who, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let node = tri!(reply, self.view.node(ino.0));
        tri!(reply, self.view.removexattr(&node, name, caller(req)));
        self.mode_may_have_changed(&node, name);
        reply.ok();
    }

    /// Setting an access ACL sets the mode too, where the kernel cannot see it: it only
    /// marks the inode's attributes stale, and overlayfs stacked on the view copies the
    /// stale mode into its own inode at its next lookup, refusing callers the new mode lets
    /// in. Expiring the node's names makes that lookup fetch the attributes again.
    fn mode_may_have_changed(&self, node: &Arc<Node>, name: &OsStr) {
        if std::os::unix::ffi::OsStrExt::as_bytes(name) == crate::view::attrs::ACCESS_ACL {
            for (parent, name) in self.view.names_of(node) {
                self.notices.expire_name(parent, name);
            }
        }
    }
}

fn reply_sized(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if (size as usize) < value.len() {
        reply.error(errno(Errno::ERANGE));
    } else {
        reply.data(value);
    }
}
