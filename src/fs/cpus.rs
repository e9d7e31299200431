//! The CPUs threads run on: where a thread is, which CPUs it may use, and pinning it to one.

/// The CPUs the calling thread may run on, in ascending order; empty if that cannot be read.
pub fn allowed() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data that sched_getaffinity fills in.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
            .collect()
    }
}

/// The CPU the calling thread runs on (read from the vDSO: no system call).
pub fn current() -> Option<usize> {
    // SAFETY: no arguments; returns -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// Pins the calling thread to `cpu`. Best effort: a thread that stays unpinned works the same,
/// only its wakeups may cross CPUs.
pub fn pin(cpu: usize) {
    if cpu >= libc::CPU_SETSIZE as usize {
        return;
    }
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}
