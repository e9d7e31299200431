//! File handles of the view (`name_to_handle_at`, `open_by_handle_at`): valid after the
//! kernel forgets the inode and after a remount, stale once the object is deleted.

mod common;
use common::*;

use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

const MAX: usize = 128;

/// `struct file_handle` with room for any handle.
#[repr(C)]
#[derive(Clone)]
struct Handle {
    bytes: u32,
    kind: i32,
    data: [u8; MAX],
}

fn handle_of(path: &Path) -> Handle {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut h = Handle {
        bytes: MAX as u32,
        kind: 0,
        data: [0; MAX],
    };
    let mut mount_id = 0;
    let res = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            c.as_ptr(),
            &mut h as *mut Handle as *mut libc::file_handle,
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        res,
        0,
        "name_to_handle_at {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    h
}

fn open_handle(m: &Mount, h: &Handle, flags: i32) -> Result<OwnedFd, i32> {
    let root = fs::File::open(&m.mnt).unwrap();
    let mut h = h.clone();
    let fd = unsafe {
        libc::open_by_handle_at(
            root.as_raw_fd(),
            &mut h as *mut Handle as *mut libc::file_handle,
            flags | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn read_handle(m: &Mount, h: &Handle) -> Result<Vec<u8>, i32> {
    let mut f = fs::File::from(open_handle(m, h, libc::O_RDONLY)?);
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    Ok(out)
}

fn ino_of_handle(m: &Mount, h: &Handle) -> Result<u64, i32> {
    let f = fs::File::from(open_handle(m, h, libc::O_RDONLY)?);
    Ok(f.metadata().unwrap().ino())
}

/// Files `f0`..`f{n}` in `dir`, each holding its own name.
fn files(dir: &Path, n: usize) -> Vec<(String, Handle)> {
    fs::create_dir_all(dir).unwrap();
    (0..n)
        .map(|i| {
            let name = format!("f{i}");
            fs::write(dir.join(&name), name.as_bytes()).unwrap();
            (name.clone(), handle_of(&dir.join(&name)))
        })
        .collect()
}

fn assert_all_read(m: &Mount, handles: &[(String, Handle)], when: &str) {
    for (name, h) in handles {
        assert_eq!(
            read_handle(m, h).map(String::from_utf8),
            Ok(Ok(name.clone())),
            "{when}: {name} by its handle"
        );
    }
}

#[test]
fn handles_outlive_the_kernels_cache_and_a_remount() {
    let mut m = Mount::new();
    let dir = m.path("d");
    let handles = files(&dir, 20);
    let dir_handle = handle_of(&dir);
    let dir_ino = fs::metadata(&dir).unwrap().ino();
    drop_caches();
    assert_all_read(&m, &handles, "after dropping caches");
    assert_eq!(ino_of_handle(&m, &dir_handle), Ok(dir_ino), "the directory");

    m.remount(&Options::default());
    assert_all_read(&m, &handles, "after a remount");
    drop_caches();
    assert_eq!(
        ino_of_handle(&m, &dir_handle),
        Ok(dir_ino),
        "the directory, remounted"
    );
    // A handle opened writable writes the file.
    let fd = open_handle(&m, &handles[0].1, libc::O_WRONLY | libc::O_APPEND).unwrap();
    nix::unistd::write(&fd, b"+").unwrap();
    drop(fd);
    assert_eq!(fs::read(dir.join("f0")).unwrap(), b"f0+");
}

#[test]
fn handles_follow_renames_and_links_and_go_stale_with_their_object() {
    let m = Mount::new();
    let dir = m.path("d");
    let handles = files(&dir, 6);
    fs::create_dir(m.path("elsewhere")).unwrap();
    // f0 moves to another directory, f1 is renamed in place, f2 gets a second name and
    // loses its first, f3 is deleted, the directory of f4 and f5 is renamed.
    fs::rename(dir.join("f0"), m.path("elsewhere/moved")).unwrap();
    fs::rename(dir.join("f1"), dir.join("renamed")).unwrap();
    fs::hard_link(dir.join("f2"), dir.join("link")).unwrap();
    fs::remove_file(dir.join("f2")).unwrap();
    fs::remove_file(dir.join("f3")).unwrap();
    fs::rename(&dir, m.path("d2")).unwrap();
    drop_caches();
    for (i, (name, h)) in handles.iter().enumerate() {
        let got = read_handle(&m, h);
        if i == 3 {
            assert_eq!(got, Err(libc::ESTALE), "{name}, deleted");
        } else {
            assert_eq!(got, Ok(name.as_bytes().to_vec()), "{name}");
        }
    }
    fs::remove_dir_all(m.path("d2")).unwrap();
    drop_caches();
    assert_eq!(
        read_handle(&m, &handles[4].1),
        Err(libc::ESTALE),
        "a file deleted with its directory"
    );
}

#[test]
fn a_handle_of_a_local_file_in_a_shared_area_outlives_the_cache() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::write(etc.join("new-file"), b"local in a merged dir").unwrap();
    let h = handle_of(&etc.join("new-file"));
    drop_caches();
    assert_eq!(
        read_handle(&m, &h),
        Ok(b"local in a merged dir".to_vec()),
        "by handle, after dropping caches"
    );
}

#[test]
fn a_number_local_gives_to_a_new_object_does_not_revive_an_old_handle() {
    // A filesystem of its own: nothing else takes the numbers it frees.
    let mut ext4 = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        ext4.ext4(&local_beside(remote), 64)
    });
    let dir = m.path("d");
    let old = files(&dir, 50);
    let inos: Vec<u64> = old
        .iter()
        .map(|(name, _)| fs::metadata(dir.join(name)).unwrap().ino())
        .collect();
    for (name, _) in &old {
        fs::remove_file(dir.join(name)).unwrap();
    }
    drop_caches();
    // Local's filesystem hands freed inode numbers to the next files it makes, once the
    // daemon has closed what it held of them (the kernel's FORGETs come meanwhile).
    let mut made = 0;
    eventually(
        20,
        "local to give one of the 50 inode numbers again",
        || {
            made += 1;
            let path = dir.join(format!("new{made}"));
            fs::write(&path, b"new").unwrap();
            inos.contains(&fs::metadata(&path).unwrap().ino())
        },
    );
    drop_caches();
    for (name, h) in &old {
        assert_eq!(read_handle(&m, h), Err(libc::ESTALE), "{name}");
    }
}

/// A daemon killed while a writer appends and fsyncs, and a new daemon on the same trees:
/// every handle taken before the kill opens its file again, and each file holds at least
/// what its writer had synced.
#[test]
fn handles_and_synced_data_outlive_a_daemon_killed_under_a_writer() {
    let mut m = Mount::new();
    let dir = m.path("w");
    let handles = files(&dir, 8);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (dir, stop) = (dir.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut synced = vec![0usize; 8];
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let i = round % 8;
                let Ok(mut f) = fs::OpenOptions::new()
                    .append(true)
                    .open(dir.join(format!("f{i}")))
                else {
                    break; // the daemon is gone
                };
                use std::io::Write;
                if f.write_all(&[b'.'; 512]).is_err() || f.sync_all().is_err() {
                    break;
                }
                synced[i] += 512;
                round += 1;
            }
            synced
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    m.kill_daemon();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let synced = writer.join().unwrap();
    assert!(synced.iter().sum::<usize>() > 0, "the writer wrote nothing");
    m.mount(&Options::default());
    for (i, (name, h)) in handles.iter().enumerate() {
        let got = read_handle(&m, h).unwrap_or_else(|e| panic!("{name} by its handle: errno {e}"));
        assert!(got.starts_with(name.as_bytes()), "{name}: its first bytes");
        assert!(
            got.len() >= name.len() + synced[i],
            "{name}: {} bytes, {} synced",
            got.len(),
            name.len() + synced[i]
        );
    }
}
