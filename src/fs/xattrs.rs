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
        reply.ok();
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
