//! Acting as the caller in local.
//!
//! The daemon runs as root, but what a caller makes and allocates must look to local's
//! filesystem as if the caller had done it: new objects owned by the caller's fsuid and
//! fsgid (and set-group-ID directories passing their group on), default ACLs applied in place
//! of the caller's umask, disk quotas charged and root-reserved blocks refused. So around the
//! one system call that creates or allocates, the serving thread takes the caller's fsuid,
//! fsgid and umask, and drops `CAP_SYS_RESOURCE` (which bypasses quotas and reserved blocks).
//!
//! Everything here is per thread: `setfsuid(2)` and `setfsgid(2)` change only the calling
//! thread, the umask is made per thread with `unshare(CLONE_FS)`, and capabilities are per
//! thread. `SECBIT_NO_SETUID_FIXUP` keeps the thread's other capabilities when its fsuid
//! leaves 0: the kernel has already checked the caller's permissions against the view
//! (`default_permissions`), so local's filesystem must not check them again against
//! supplementary groups the daemon does not know.
//!
//! A thread that cannot be set up this way (a daemon not running as root) acts as itself.

use std::cell::Cell;

use caps::{CapSet, Capability};

/// Who a call is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct As {
    pub uid: u32,
    pub gid: u32,
    /// The umask to create with; `None` for calls that create nothing.
    pub umask: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Thread {
    Unknown,
    /// Set up; whether `CAP_SYS_RESOURCE` is in its effective set to drop.
    Ready {
        resource: bool,
    },
    Unable,
}

thread_local! {
    static THREAD: Cell<Thread> = const { Cell::new(Thread::Unknown) };
}

/// Whether [`run_as`] really acts as the caller on this thread (the daemon runs as root
/// and could set the thread up).
pub fn acts_as_caller() -> bool {
    matches!(thread_state(), Thread::Ready { .. })
}

/// Runs `op` as `who` (see the module documentation).
pub fn run_as<T>(who: As, op: impl FnOnce() -> T) -> T {
    let Thread::Ready { resource } = thread_state() else {
        return op();
    };
    let _back = Switched::enter(who, resource);
    op()
}

/// The thread's state as it was before [`run_as`] switched it; restores it on drop, also
/// when `op` panics.
struct Switched {
    umask: Option<libc::mode_t>,
    resource: bool,
    ids: bool,
}

impl Switched {
    fn enter(who: As, resource: bool) -> Switched {
        let ids = who.uid != 0 || who.gid != 0;
        if ids {
            // Per-thread system calls; glibc's wrappers for these do not broadcast.
            unsafe {
                libc::setfsgid(who.gid);
                libc::setfsuid(who.uid);
            }
        }
        let resource = resource
            && who.uid != 0
            && caps::drop(None, CapSet::Effective, Capability::CAP_SYS_RESOURCE).is_ok();
        let umask = who
            .umask
            .map(|m| unsafe { libc::umask(m as libc::mode_t & 0o777) });
        Switched {
            umask,
            resource,
            ids,
        }
    }
}

impl Drop for Switched {
    fn drop(&mut self) {
        if let Some(mask) = self.umask {
            unsafe { libc::umask(mask) };
        }
        if self.resource {
            let _ = caps::raise(None, CapSet::Effective, Capability::CAP_SYS_RESOURCE);
        }
        if self.ids {
            unsafe {
                libc::setfsuid(0);
                libc::setfsgid(0);
            }
        }
    }
}

fn thread_state() -> Thread {
    THREAD.with(|t| {
        if t.get() == Thread::Unknown {
            t.set(set_up_thread());
        }
        t.get()
    })
}

/// Gives the thread its own umask and keeps its capabilities across fsuid changes.
fn set_up_thread() -> Thread {
    if unsafe { libc::geteuid() } != 0 {
        return Thread::Unable;
    }
    if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "no per-thread umask: objects are created as the daemon");
        return Thread::Unable;
    }
    let bits = unsafe { libc::prctl(libc::PR_GET_SECUREBITS) };
    let keep = bits >= 0
        && unsafe {
            libc::prctl(
                libc::PR_SET_SECUREBITS,
                (bits | libc::SECBIT_NO_SETUID_FIXUP) as libc::c_ulong,
            )
        } == 0;
    if !keep {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot keep capabilities across fsuid changes: objects are created as the daemon");
        return Thread::Unable;
    }
    let resource =
        caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_RESOURCE).unwrap_or(false);
    Thread::Ready { resource }
}

/// Whether the thread `tid` has `CAP_SYS_ADMIN` in its effective set, in the daemon's user
/// namespace (root of a container's own user namespace does not count).
pub fn is_admin(tid: u32) -> bool {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/user")).ok();
    let same_ns = match (ns(&tid.to_string()), ns("self")) {
        (Some(theirs), Some(ours)) => theirs == ours,
        _ => false,
    };
    same_ns
        && caps::has_cap(
            Some(tid as i32),
            CapSet::Effective,
            Capability::CAP_SYS_ADMIN,
        )
        .unwrap_or(false)
}

/// Whether the thread `tid` (acting as `gid`) is a member of `group`: its fsgid or one of
/// its supplementary groups.
pub fn in_group(tid: u32, gid: u32, group: u32) -> bool {
    if gid == group {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|groups| {
            groups
                .split_whitespace()
                .any(|g| g.parse::<u32>() == Ok(group))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fsuid() -> u32 {
        // setfsuid with an invalid id changes nothing and returns the current one.
        unsafe { libc::setfsuid(u32::MAX) as u32 }
    }

    #[test]
    fn a_switch_is_undone_and_stays_on_its_thread() {
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let (ask, asked) = std::sync::mpsc::channel::<()>();
        let (tell, told) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            while asked.recv().is_ok() {
                tell.send(fsuid()).unwrap();
            }
        });
        std::thread::spawn(move || {
            let who = As {
                uid: 4242,
                gid: 4343,
                umask: Some(0o077),
            };
            let inside = run_as(who, || {
                ask.send(()).unwrap();
                (fsuid(), told.recv().unwrap(), unsafe { libc::umask(0o077) })
            });
            assert_eq!(inside, (4242, 0, 0o077));
            assert_eq!(fsuid(), 0);
            let umask = unsafe { libc::umask(0o022) };
            assert_ne!(umask, 0o077, "the umask comes back");
        })
        .join()
        .unwrap();
        other.join().unwrap();
    }

    #[test]
    fn the_daemon_itself_is_an_admin_and_in_its_groups() {
        let me = std::process::id();
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(is_admin(me), root);
        assert!(in_group(me, 77, 77));
    }
}
