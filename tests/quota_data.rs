//! Quotas on real mounts (DESIGN §6) where data is allocated: what a quota root lets
//! through and what it refuses on write, `fallocate`, truncate, `copy_file_range` and
//! copy-up, with writers racing for the last of the room, and beside readers that FUSE
//! passthrough serves without the daemon. Every one of them is a way for bytes to reach
//! local; each must stop at the limit (within one write in flight) and be charged what
//! local then takes on disk.
//!
//! New inodes, links and renames are in `tests/quota_namespace.rs`; setting, reading and
//! keeping quotas in `tests/quota_control.rs`; crashes in `tests/quota_crash.rs`.

mod common;
mod quota_kit;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use quota_kit::*;

// ---- Writing until the quota is full -----------------------------------------------------

/// `dd if=/dev/zero bs=1M` into an 8 MiB root stops with ENOSPC after about the room there was.
fn dd_until_full(opts: Options) {
    let m = Mount::with(opts, |_| {});
    let c1 = root(&m, "c1", "8M", &[]);
    let before = get(&m, "overlay/c1");
    assert_eq!(before.limit, 8 * MIB);
    assert_eq!(before.inode_limit, None);
    assert_eq!(before.inodes_used, 1, "the root dir itself is one inode");
    assert_eq!(
        before.used,
        local_alloc(&m, "overlay/c1"),
        "the root dir is counted"
    );
    let room = before.limit - before.used;

    let f = c1.join("f");
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", f.display()))
        .arg("bs=1M")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "dd did not fail: {err}");
    assert!(err.contains("No space left on device"), "dd: {err}");

    let written = fs::metadata(&f).unwrap().len();
    assert!(
        written <= room,
        "dd wrote {written} bytes into {room} bytes of room"
    );
    assert!(
        written + ONE_WRITE + SLACK >= room,
        "dd stopped after {written} bytes with {room} bytes of room"
    );
    let q = assert_usage_matches_local(&m, "overlay/c1");
    assert!(q.used <= q.limit + SLACK, "{q:?}");
    assert!(
        local_alloc(&m, "overlay/c1") <= q.limit + SLACK,
        "local holds {} bytes under an 8 MiB quota",
        local_alloc(&m, "overlay/c1")
    );
    // Nothing more fits: appending one more block fails too.
    let mut a = fs::OpenOptions::new().append(true).open(&f).unwrap();
    assert_errno(
        "append of 4 KiB to a full root",
        a.write(&[1u8; 4096]),
        libc::ENOSPC,
    );
    assert_eq!(
        fs::metadata(&f).unwrap().len(),
        written,
        "the file is unchanged"
    );
}

#[test]
fn dd_stops_with_enospc_at_the_limit() {
    dd_until_full(Options::default());
}

#[test]
fn dd_stops_with_enospc_at_the_limit_without_passthrough() {
    dd_until_full(Options {
        opts: "nopassthrough".into(),
        ..Default::default()
    });
}

#[test]
fn a_write_that_partly_fits_is_short_and_the_file_keeps_what_was_written() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    let room = 4 * MIB - used(&m, "overlay/c1");
    let p = c1.join("g");
    let mut f = fs::File::create(&p).unwrap();
    let (n, e) = fill(&mut f, MIB as usize, 64 * MIB);
    assert_eq!(e, libc::ENOSPC, "got {}", errname(e));
    assert!(n <= room && n + ONE_WRITE + SLACK >= room, "{n} of {room}");
    // A failing write changed nothing: the file is exactly what the successful writes made.
    assert_eq!(f.metadata().unwrap().len(), n);
    drop(f);
    assert!(fs::read(&p).unwrap() == filled(MIB as usize, n));
    // A write at an offset past the end fails too, and does not extend the file.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    assert_errno(
        "pwrite past the end of a file in a full root",
        nix::sys::uio::pwrite(&f, &[7u8; 8192], (n + 8 * MIB) as i64).map_err(std::io::Error::from),
        libc::ENOSPC,
    );
    assert_eq!(f.metadata().unwrap().len(), n);
    assert_usage_matches_local(&m, "overlay/c1");
}

#[test]
fn a_zero_limit_allows_no_data() {
    let m = mount();
    let c1 = root(&m, "c1", "0", &[]);
    assert_eq!(get(&m, "overlay/c1").limit, 0);
    // Creating the (empty) file may already be refused; if not, writing to it is.
    match fs::File::create(c1.join("f")) {
        Ok(mut f) => {
            assert_errno(
                "write of 1 byte under a 0 quota",
                f.write(b"x"),
                libc::ENOSPC,
            );
            assert_eq!(f.metadata().unwrap().len(), 0);
        }
        Err(e) => assert_eq!(errno(&e), libc::ENOSPC, "create under a 0 quota: {e}"),
    }
}

#[test]
fn edquot_instead_of_enospc_with_the_mount_option() {
    let m = Mount::with(
        Options {
            opts: "quota_errno=edquot".into(),
            ..Default::default()
        },
        |_| {},
    );
    let c1 = root(&m, "c1", "4M", &[]);
    fill_root(&c1, "f", libc::EDQUOT);
    let out = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", c1.join("dd").display()))
        .arg("bs=64K")
        .arg("count=16")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Disk quota exceeded"),
        "dd: {}",
        text(&out.stderr)
    );
    let g = fs::File::create(c1.join("g")).unwrap_or_else(|e| {
        assert_eq!(errno(&e), libc::EDQUOT, "create in a full root: {e}");
        fs::OpenOptions::new()
            .write(true)
            .open(c1.join("f"))
            .unwrap()
    });
    // New blocks past the end of the file (what is below it may be allocated already).
    let end = g.metadata().unwrap().len().div_ceil(4096) * 4096;
    assert_errno(
        "fallocate in a full root",
        fallocate(&g, 0, end, MIB),
        libc::EDQUOT,
    );
    assert_errno(
        "mkdir in a full root",
        fs::create_dir(c1.join("d")),
        libc::EDQUOT,
    );
    // Outside any quota root nothing changes.
    fs::write(m.path("overlay/free"), pattern(2 * MIB as usize, 3)).unwrap();
}

// ---- Sparse files, fallocate, truncate ---------------------------------------------------

fn fallocate(f: &fs::File, mode: i32, off: u64, len: u64) -> std::io::Result<()> {
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn blocks(p: &Path) -> u64 {
    fs::symlink_metadata(p).unwrap().blocks() * 512
}

#[test]
fn a_sparse_file_costs_only_what_is_written() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let before = used(&m, "overlay/c1");
    let p = c1.join("sparse");
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.set_len(1 << 30).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 30);
    let after_extend = used(&m, "overlay/c1");
    assert!(
        after_extend <= before + SLACK,
        "a 1 GiB hole cost {} bytes",
        after_extend - before
    );
    // Writing into the hole is charged.
    let chunk = pattern(MIB as usize, 5);
    nix::sys::uio::pwrite(&f, &chunk, 512 * MIB as i64).unwrap();
    let one = used(&m, "overlay/c1");
    assert!(
        one >= after_extend + MIB && one <= after_extend + MIB + SLACK,
        "1 MiB written into a hole: usage {after_extend} -> {one}"
    );
    // More holes filled, 1 MiB every 2 MiB, until the quota refuses.
    let mut off = 0u64;
    let mut wrote = MIB;
    let e = loop {
        assert!(off < 1 << 30, "the quota never refused");
        match nix::sys::uio::pwrite(&f, &chunk, off as i64) {
            Ok(n) if n == chunk.len() => wrote += n as u64,
            Ok(n) => {
                wrote += n as u64;
                break nix::sys::uio::pwrite(&f, &chunk[n..], (off + n as u64) as i64)
                    .expect_err("after a short write the next fails");
            }
            Err(e) => break e,
        }
        off += 2 * MIB;
    };
    assert_eq!(e, nix::errno::Errno::ENOSPC);
    assert!(
        wrote + ONE_WRITE + SLACK >= 8 * MIB - before,
        "only {wrote} bytes fit in holes"
    );
    let q = assert_usage_matches_local(&m, "overlay/c1");
    assert!(q.used <= q.limit + SLACK, "{q:?}");
    assert_eq!(
        fs::metadata(&p).unwrap().len(),
        1 << 30,
        "the size is unchanged"
    );
    let mut back = vec![0u8; MIB as usize];
    nix::sys::uio::pread(&f, &mut back, 512 * MIB as i64).unwrap();
    assert!(back == chunk);
}

#[test]
fn overwriting_allocated_data_in_a_full_root_succeeds() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    let p = c1.join("f");
    let n = fill_root(&c1, "f", libc::ENOSPC);
    assert!(n >= MIB, "{n}");
    // Rewriting blocks that are already allocated allocates nothing.
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    let new = pattern(MIB as usize, 99);
    nix::sys::uio::pwrite(&f, &new, 0).expect("overwrite of allocated data in a full root");
    drop(f);
    let got = fs::read(&p).unwrap();
    assert!(got[..MIB as usize] == new[..]);
    assert_eq!(got.len() as u64, n);
}

#[test]
fn fallocate_beyond_the_room_fails_and_allocates_nothing() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let p = c1.join("f");
    let data = write_file(&p, MIB as usize, 11);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let u0 = used(&m, "overlay/c1");
    let b0 = blocks(&p);

    assert_errno(
        "fallocate 16 MiB",
        fallocate(&f, 0, 0, 16 * MIB),
        libc::ENOSPC,
    );
    assert_errno(
        "fallocate KEEP_SIZE 16 MiB",
        fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, MIB, 16 * MIB),
        libc::ENOSPC,
    );
    assert_eq!(
        used(&m, "overlay/c1"),
        u0,
        "a failed fallocate charges nothing"
    );
    assert_eq!(blocks(&p), b0, "a failed fallocate allocates nothing");
    assert_eq!(fs::metadata(&p).unwrap().len(), MIB);
    assert!(fs::read(&p).unwrap() == data);

    // Within the room: the size grows, and so does usage.
    fallocate(&f, 0, MIB, 4 * MIB).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 5 * MIB);
    let u1 = used(&m, "overlay/c1");
    assert_close("fallocate of 4 MiB", u1 - u0, 4 * MIB, SLACK);

    // KEEP_SIZE allocates past the end without changing the size; charged all the same.
    fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 5 * MIB, 2 * MIB).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 5 * MIB);
    let u2 = used(&m, "overlay/c1");
    assert_close("fallocate KEEP_SIZE of 2 MiB", u2 - u1, 2 * MIB, SLACK);
    assert_usage_matches_local(&m, "overlay/c1");

    // Punching a hole credits it back and leaves zeros.
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        0,
        4 * MIB,
    )
    .unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 5 * MIB);
    let u3 = used(&m, "overlay/c1");
    assert_close("punching 4 MiB", u2 - u3, 4 * MIB, SLACK);
    let mut head = vec![1u8; 4 * MIB as usize];
    (&f).seek(SeekFrom::Start(0)).unwrap();
    (&f).read_exact(&mut head).unwrap();
    assert!(
        head.iter().all(|b| *b == 0),
        "a punched hole reads as zeros"
    );
    assert_usage_matches_local(&m, "overlay/c1");
    // And the room it frees can be allocated again.
    fallocate(&f, 0, 0, 4 * MIB).unwrap();
}

#[test]
fn fallocate_over_an_allocated_range_charges_only_the_new_blocks() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let f = fs::File::create(c1.join("f")).unwrap();
    fallocate(&f, 0, 0, 6 * MIB).unwrap();
    let u = used(&m, "overlay/c1");
    assert!(u + MIB < 8 * MIB, "{u}");
    // 7 MiB over the 6 already allocated needs 1 MiB more, and there is room for that.
    fallocate(&f, 0, 0, 7 * MIB).expect("fallocate needing 1 MiB with ~2 MiB of room");
    assert_close("usage", used(&m, "overlay/c1"), u + MIB, SLACK);
    assert_usage_matches_local(&m, "overlay/c1");
}

/// Blocks `fallocate` reserved are allocated and charged already: writing into them in a
/// full root allocates nothing (databases preallocate, and so does fio before its jobs).
#[test]
fn writing_into_preallocated_blocks_of_a_full_root_succeeds() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    let open = |name: &str| {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(c1.join(name))
            .unwrap()
    };
    let pre = open("pre");
    fallocate(&pre, 0, 0, 2 * MIB).unwrap();
    let keep = open("keep");
    fallocate(&keep, libc::FALLOC_FL_KEEP_SIZE, 0, 512 * KIB).unwrap();
    fill_root(&c1, "full", libc::ENOSPC);
    let u = used(&m, "overlay/c1");

    let data = pattern(MIB as usize, 8);
    let n = nix::sys::uio::pwrite(&pre, &data, 0)
        .expect("a write into preallocated blocks (inside the size) of a full root");
    assert_eq!(n, data.len(), "short write into preallocated blocks");
    let n = nix::sys::uio::pwrite(&keep, &data[..256 * KIB as usize], 0)
        .expect("a write into KEEP_SIZE-preallocated blocks (past the size) of a full root");
    assert_eq!(
        n,
        256 * KIB as usize,
        "short write into preallocated blocks"
    );
    assert_close("usage", used(&m, "overlay/c1"), u, SLACK);
    let mut back = vec![0u8; MIB as usize];
    nix::sys::uio::pread(&pre, &mut back, 0).unwrap();
    assert!(back == data);
    assert_usage_matches_local(&m, "overlay/c1");
}

#[test]
fn truncate_extends_for_free_and_shrinking_credits() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let base = used(&m, "overlay/c1");
    let p = c1.join("f");
    let data = write_file(&p, 4 * MIB as usize, 21);
    let u4 = used(&m, "overlay/c1");
    assert_close("4 MiB written", u4 - base, 4 * MIB, SLACK);

    // Extending makes a hole: free, even far past the limit.
    nix::unistd::truncate(&p, 1 << 30).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 30);
    assert_eq!(used(&m, "overlay/c1"), u4, "extending by truncate is free");
    let out = Command::new("truncate")
        .args(["-s", "2G"])
        .arg(c1.join("g"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "truncate -s 2G: {}",
        text(&out.stderr)
    );
    assert_eq!(used(&m, "overlay/c1"), u4);

    // Shrinking credits what it frees.
    nix::unistd::truncate(&p, MIB as i64).unwrap();
    let u1 = used(&m, "overlay/c1");
    assert_close("shrinking 4 MiB -> 1 MiB", u4 - u1, 3 * MIB, SLACK);
    assert!(fs::read(&p).unwrap() == data[..MIB as usize]);
    nix::unistd::truncate(&p, 0).unwrap();
    assert_close("shrinking to 0", used(&m, "overlay/c1"), base, SLACK);

    // So does O_TRUNC.
    write_file(&c1.join("h"), 2 * MIB as usize, 22);
    let u2 = used(&m, "overlay/c1");
    drop(fs::File::create(c1.join("h")).unwrap());
    let u3 = used(&m, "overlay/c1");
    assert_close("O_TRUNC of 2 MiB", u2 - u3, 2 * MIB, SLACK);
    assert_usage_matches_local(&m, "overlay/c1");

    // A full root can still extend a file by truncate.
    fill_root(&c1, "full", libc::ENOSPC);
    nix::unistd::truncate(&c1.join("h"), 100 * MIB as i64).expect("extend in a full root");
}

// ---- Copy-up into a quota root -----------------------------------------------------------

/// A dense 64 MiB file in the remote copy of L1's `diff/`.
fn big_remote(remote: &Path) {
    let p = remote.join(l1_diff_rel()).join("big.bin");
    fs::write(p, pattern(64 * MIB as usize, 64)).unwrap();
}

fn sha(p: &Path) -> String {
    use sha2::{Digest, Sha256};
    let mut f = fs::File::open(p).unwrap();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; MIB as usize];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    format!("{:x}", h.finalize())
}

/// Makes the remote-merged dir `rel` a quota root. By xattr: `layerfs quota set` on such a
/// dir is covered by `cli_set_on_a_remote_dir_the_kernel_has_not_looked_up` in
/// `tests/quota_control.rs`.
fn set_remote_root(m: &Mount, rel: &str, size: &str) -> Quota {
    xattr_set(&m.path(rel), XATTR, size.as_bytes()).unwrap();
    get(m, rel)
}

/// Opens `p` with `opts` and writes one byte: the open or the write must fail with `want`.
fn open_and_write_fails(what: &str, p: &Path, opts: &fs::OpenOptions, want: i32) {
    match opts.open(p) {
        Err(e) => assert_eq!(errno(&e), want, "{what}: open failed with {e}"),
        Ok(mut f) => assert_errno(&format!("{what}: write"), f.write(b"!"), want),
    }
}

#[test]
fn a_64_mib_remote_file_does_not_copy_up_into_an_8_mib_quota() {
    let m = Mount::with(Options::default(), big_remote);
    let rel = l1_diff_rel();
    let q = set_remote_root(&m, &rel, "8M");
    assert_eq!(q.limit, 8 * MIB);
    let before = q.used;
    let view = m.path(&rel).join("big.bin");
    let want = sha(&m.remote.join(&rel).join("big.bin"));
    assert_eq!(sha(&view), want);

    open_and_write_fails(
        "O_WRONLY of a 64 MiB remote file",
        &view,
        fs::OpenOptions::new().write(true),
        libc::ENOSPC,
    );
    open_and_write_fails(
        "O_APPEND of a 64 MiB remote file",
        &view,
        fs::OpenOptions::new().append(true),
        libc::ENOSPC,
    );
    open_and_write_fails(
        "O_RDWR of a 64 MiB remote file",
        &view,
        fs::OpenOptions::new().read(true).write(true),
        libc::ENOSPC,
    );
    // `echo >> file` from a shell fails the same way: at its write, which copies the file
    // up (bash names the error; dash's echo calls every write error an I/O error).
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("echo x >> '{}'", view.display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("No space left on device"),
        "sh: {}",
        text(&out.stderr)
    );

    // The file is intact, nothing of it reached local, and usage did not move.
    assert_eq!(fs::metadata(&view).unwrap().len(), 64 * MIB);
    drop_caches();
    assert_eq!(sha(&view), want, "the remote file reads back unchanged");
    assert!(
        fs::symlink_metadata(m.local.join(&rel).join("big.bin")).is_err(),
        "a partial copy-up was left in local"
    );
    assert_no_temp_names(&m.local);
    let after = get(&m, &rel);
    assert_eq!(after.used, before, "usage after failed copy-ups");
    assert_close("local under the root", local_alloc(&m, &rel), before, SLACK);
}

#[test]
fn a_remote_file_that_fits_copies_up_and_is_charged() {
    let m = mount();
    let rel = l1_diff_rel();
    let before = set_remote_root(&m, &rel, "8M").used;
    let view = m.path(&rel).join("etc/os-release");
    let mut f = fs::OpenOptions::new().append(true).open(&view).unwrap();
    f.write_all(b"QUOTA=1\n").unwrap();
    drop(f);
    assert!(m.local.join(&rel).join("etc/os-release").is_file());
    let q = assert_usage_matches_local(&m, &rel);
    assert!(
        q.used >= before + 4096,
        "a copy-up charged nothing: {before} -> {}",
        q.used
    );
    assert!(q.inodes_used >= 2, "{q:?}");
}

/// A reader that opened a remote file before it was copied up still reads the remote file,
/// which the quota does not count; its close and its `fsync` must not measure that file as
/// the copy. They did: the root was charged the remote file's 64 MiB on top of the copy.
/// Its last close after the copy's name is gone frees the copy, not the remote file.
#[test]
fn a_reader_from_before_the_copy_up_does_not_charge_the_remote_file() {
    for opts in ["", "nopassthrough"] {
        let options = Options {
            opts: opts.into(),
            ..Options::default()
        };
        let m = Mount::with(options, big_remote);
        let rel = l1_diff_rel();
        set_remote_root(&m, &rel, "100M");
        let view = m.path(&rel).join("big.bin");
        let reader = fs::File::open(&view).unwrap();
        let mut writer = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&view)
            .unwrap();
        writer.write_all(&pattern(MIB as usize, 3)).unwrap();
        drop(writer);
        reader.sync_all().unwrap();
        assert_usage_matches_local(&m, &rel);
        // Its last close frees the copy, whose name went meanwhile.
        fs::remove_file(&view).unwrap();
        drop(reader);
        assert_usage_matches_local(&m, &rel);
    }
}

#[test]
fn o_trunc_of_a_big_remote_file_in_a_small_quota_copies_no_data() {
    let m = Mount::with(Options::default(), big_remote);
    let rel = l1_diff_rel();
    set_remote_root(&m, &rel, "8M");
    let view = m.path(&rel).join("big.bin");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&view)
        .expect("O_TRUNC needs no room for the old data");
    f.write_all(b"small").unwrap();
    drop(f);
    assert_eq!(fs::read(&view).unwrap(), b"small");
    assert_usage_matches_local(&m, &rel);
}

// ---- Concurrency -------------------------------------------------------------------------

#[test]
fn eight_parallel_writers_overshoot_by_at_most_one_write_each() {
    let m = mount();
    let c1 = root(&m, "c1", "32M", &[]);
    let base = used(&m, "overlay/c1");
    let limit = 32 * MIB;
    // Made before any writer starts: a full root takes no new names, and a writer that
    // started late would find it full.
    let files: Vec<fs::File> = (0..8)
        .map(|i| fs::File::create(c1.join(format!("w{i}"))).unwrap())
        .collect();
    let results: Vec<(u64, i32)> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .into_iter()
            .map(|mut f| s.spawn(move || fill(&mut f, MIB as usize, 1 << 30)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (n, e)) in results.iter().enumerate() {
        assert_eq!(
            *e,
            libc::ENOSPC,
            "writer {i} after {n} bytes: {}",
            errname(*e)
        );
    }
    let written: u64 = results.iter().map(|r| r.0).sum();
    let alloc = local_alloc(&m, "overlay/c1");
    eprintln!(
        "8 writers: {written} bytes written, {alloc} allocated under a {limit}-byte quota \
         (overshoot {} bytes)",
        alloc as i64 - limit as i64
    );
    assert!(
        alloc <= limit + 8 * ONE_WRITE,
        "8 writers allocated {alloc} bytes under a {limit}-byte quota"
    );
    assert!(
        alloc + 8 * ONE_WRITE + SLACK >= limit,
        "8 writers stopped at {alloc} bytes of a {limit}-byte quota"
    );
    let q = assert_usage_matches_local(&m, "overlay/c1");
    assert!(q.used <= limit + 8 * ONE_WRITE, "{q:?}");
    for i in 0..8 {
        fs::remove_file(c1.join(format!("w{i}"))).unwrap();
    }
    // Nothing stays reserved once the writers are gone.
    used_until(&m, "overlay/c1", "all space credited back", |u| {
        u <= base + SLACK
    });
    assert_usage_matches_local(&m, "overlay/c1");
}

/// A file opened for writing before its directory became a quota root (with FUSE
/// passthrough, its writes would never reach the daemon) must not escape the quota: either
/// setting the quota is refused while such a handle is open, or the writes through it are
/// limited and counted like any other.
#[test]
fn a_handle_opened_before_the_quota_was_set_cannot_bypass_it() {
    let m = mount();
    let d = m.path("overlay/d");
    fs::create_dir(&d).unwrap();
    let mut f = fs::File::create(d.join("f")).unwrap();
    f.write_all(&[1u8; 4096]).unwrap();
    let out = quota_cmd(&m, "set", &["overlay/d", "1M", "--json"]);
    if !out.status.success() {
        assert_eq!(text(&out.stderr).trim_end().lines().count(), 1);
        return;
    }
    let (n, e) = fill(&mut f, MIB as usize, 16 * MIB);
    assert_eq!(e, libc::ENOSPC, "{}", errname(e));
    assert!(n <= MIB, "{n} bytes written under a 1 MiB quota");
    drop(f);
    let (alloc, _) = allocated_under(&m.local.join("overlay/d"));
    used_until(&m, "overlay/d", "usage matches local", |u| {
        u.abs_diff(alloc) <= SLACK
    });
}

/// `copy_file_range(2)` (what `cp` uses) into a quota root is limited like a write.
#[test]
fn copy_file_range_into_a_root_stops_at_the_limit() {
    let m = mount();
    let c1 = root(&m, "c1", "2M", &[]);
    let src_path = m.path("overlay/src");
    let data = write_file(&src_path, 4 * MIB as usize, 31);
    let src = fs::File::open(&src_path).unwrap();
    let dst = fs::File::create(c1.join("dst")).unwrap();
    let mut copied = 0u64;
    let e = loop {
        let r = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                std::ptr::null_mut(),
                dst.as_raw_fd(),
                std::ptr::null_mut(),
                (4 * MIB - copied) as usize,
                0,
            )
        };
        if r < 0 {
            break std::io::Error::last_os_error();
        }
        assert!(r > 0, "copy_file_range copied everything into a 2 MiB root");
        copied += r as u64;
    };
    assert_eq!(errno(&e), libc::ENOSPC, "{e}");
    assert!(copied <= 2 * MIB, "{copied} bytes copied into a 2 MiB root");
    let q = assert_usage_matches_local(&m, "overlay/c1");
    assert!(q.used <= q.limit + SLACK, "{q:?}");
    assert_eq!(dst.metadata().unwrap().len(), copied);
    assert!(fs::read(c1.join("dst")).unwrap() == data[..copied as usize]);
}

// ---- Reads and writers beside passthrough readers ----------------------------------------

/// The `/proc` directory of the daemon serving `m`.
fn daemon_proc(m: &Mount) -> PathBuf {
    let pid = m
        .daemon_pid()
        .expect("the quota tests mount in the foreground");
    PathBuf::from(format!("/proc/{pid}"))
}

/// What the daemon serving `m` has read through system calls so far (`rchar`): reads served
/// by the daemon add to it, passthrough reads happen in the reader and do not.
fn daemon_rchar(m: &Mount) -> u64 {
    let io = fs::read_to_string(daemon_proc(m).join("io")).unwrap();
    let rchar = io.lines().find_map(|l| l.strip_prefix("rchar: ")).unwrap();
    rchar.trim().parse().unwrap()
}

/// Waits until the daemon has closed the local file `rel` (see [`Mount::released`]).
fn released(m: &Mount, rel: &str) {
    m.released(&m.local.join(rel));
}

/// A fixture mount where files get FUSE passthrough; `None` where the kernel offers none,
/// which leaves nothing to check ([`missing_capability`]).
fn passthrough_mount() -> Option<Mount> {
    let m = mount();
    if passthrough_in_use(&m, "probe") {
        return Some(m);
    }
    missing_capability(
        "passthrough",
        "FUSE passthrough is not available on this kernel",
    );
    None
}

/// Reads allocate nothing, so a file inside a quota root is read with FUSE passthrough
/// like any other: its bytes never pass through the daemon.
#[test]
fn reads_inside_a_root_get_passthrough() {
    let Some(m) = passthrough_mount() else {
        return;
    };
    let q = root(&m, "q", "64M", &[]);
    let data = write_file(&q.join("f"), 8 * MIB as usize, 11);
    released(&m, "overlay/q/f");
    drop_caches();
    let before = daemon_rchar(&m);
    assert!(fs::read(q.join("f")).unwrap() == data, "content read back");
    let through_daemon = daemon_rchar(&m) - before;
    assert!(
        through_daemon < MIB,
        "{through_daemon} bytes of an 8 MiB read went through the daemon"
    );
}

/// A writer of a file that passthrough readers hold open is still counted and limited: its
/// writes go through the daemon, and the file's holes, which a shared mapping of it could
/// fill unseen, are set aside while it is open.
#[test]
fn a_writer_beside_a_passthrough_reader_is_counted_and_limited() {
    let Some(m) = passthrough_mount() else {
        return;
    };
    let q = root(&m, "q", "8M", &[]);
    let base = used(&m, "overlay/q");
    write_file(&q.join("f"), MIB as usize, 5);
    released(&m, "overlay/q/f");
    let reader = fs::File::open(q.join("f")).unwrap();
    let mut writer = fs::OpenOptions::new()
        .append(true)
        .open(q.join("f"))
        .unwrap();
    let (n, e) = fill(&mut writer, MIB as usize, 64 * MIB);
    assert_eq!(e, libc::ENOSPC, "{}", errname(e));
    assert!(
        n + MIB <= 8 * MIB,
        "{n} bytes appended under an 8 MiB quota"
    );
    drop(writer);
    drop(reader);
    used_until(&m, "overlay/q", "the appended data is counted", |u| {
        u >= base + MIB + n - SLACK
    });
    assert_usage_matches_local(&m, "overlay/q");

    // The holes of a sparse file must fit beside a reader: 16 MiB of them do not fit in 8.
    fs::remove_file(q.join("f")).unwrap();
    let sparse = fs::File::create(q.join("s")).unwrap();
    sparse.set_len(16 * MIB).unwrap();
    drop(sparse);
    released(&m, "overlay/q/s");
    let reader = fs::File::open(q.join("s")).unwrap();
    assert_errno(
        "a writer of 16 MiB of holes beside a passthrough reader, in an 8 MiB root",
        fs::OpenOptions::new().write(true).open(q.join("s")),
        libc::ENOSPC,
    );
    drop(reader);
    // Without readers, writes go through the daemon whatever the holes.
    let mut writer = eventually_open(&q.join("s"));
    writer.write_all(&[3u8; 4096]).unwrap();
    drop(writer);
    assert_usage_matches_local(&m, "overlay/q");
}

/// Opens `p` for writing, retrying while a reader's RELEASE has not arrived yet.
fn eventually_open(p: &Path) -> fs::File {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match fs::OpenOptions::new().write(true).open(p) {
            Ok(f) => return f,
            Err(e) if errno(&e) == libc::ENOSPC && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50))
            }
            Err(e) => panic!("open {} for writing: {e}", p.display()),
        }
    }
}

/// A shared writable mapping of a file that a passthrough reader holds open writes to the
/// file itself; what it allocated is counted once the writer is closed, and while it is
/// open, the holes it could fill are not available to other files.
#[test]
fn a_mapping_beside_a_passthrough_reader_is_counted_at_close() {
    let Some(m) = passthrough_mount() else {
        return;
    };
    let q = root(&m, "q", "8M", &[]);
    let base = used(&m, "overlay/q");
    let len = 4 * MIB as usize;
    let f = fs::File::create(q.join("m")).unwrap();
    f.set_len(len as u64).unwrap();
    drop(f);
    released(&m, "overlay/q/m");
    let reader = fs::File::open(q.join("m")).unwrap();
    let writer = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(q.join("m"))
        .unwrap();
    // The 4 MiB of holes are set aside: another file gets at most the other 4.
    let other = fill_root(&q, "other", libc::ENOSPC);
    assert!(
        other <= 4 * MIB,
        "{other} bytes written beside 4 MiB of held holes"
    );
    fs::remove_file(q.join("other")).unwrap();
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            writer.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        std::ptr::write_bytes(p as *mut u8, 0x5a, len);
        assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0);
        libc::munmap(p, len);
    }
    drop(writer);
    drop(reader);
    used_until(&m, "overlay/q", "the mapped writes are counted", |u| {
        u + SLACK >= base + len as u64
    });
    assert_usage_matches_local(&m, "overlay/q");
    assert!(fs::read(q.join("m")).unwrap().iter().all(|&b| b == 0x5a));
}

/// Random 4 KiB writes, with an `fsync` every 64, into a file preallocated in a root whose
/// room is too small to take each write's worst case unasked, with local on btrfs. Each
/// write asks FIEMAP which blocks of its span exist; btrfs, while the file has data not yet
/// written back, lists extents from the file's start whatever range is asked, and asked
/// again from where that list ended it listed the same extents: the first write that met a
/// full list of them did not return until writeback had cleared the file's delayed
/// allocations, 30 s later (fio made one write a second). The whole takes about a second
/// now; the watchdog fails it at 20.
#[test]
fn random_writes_into_a_root_on_btrfs_all_return() {
    if Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .is_err()
    {
        missing_capability("btrfs", "mkfs.btrfs is not installed");
        return;
    }
    let mut btrfs = LocalFs::default();
    let daemon_counts = Options {
        opts: "quota_backend=fuse".into(),
        ..Options::default()
    };
    let m = Mount::with(daemon_counts, |remote| {
        btrfs.btrfs(&local_beside(remote), 512);
    });
    let _w = Watchdog::of(&m, 20);
    let q = root(&m, "q", "64M", &[]);
    assert_eq!(get(&m, "overlay/q").backend, "fuse");
    let size = 32 * MIB;
    let f = fs::File::create(q.join("f")).unwrap();
    nix::fcntl::posix_fallocate(&f, 0, size as i64).unwrap();
    let block = pattern(4096, 5);
    let mut at = 12_345u64;
    for i in 0..4000u64 {
        at = (at * 1_103_515_245 + 12_345) % (size / 4096);
        let n = nix::sys::uio::pwrite(&f, &block, (at * 4096) as i64)
            .unwrap_or_else(|e| panic!("write {i}: {e}"));
        assert_eq!(n, block.len(), "write {i}");
        if i % 64 == 63 {
            f.sync_all().unwrap();
        }
    }
    drop(f);
    released(&m, "overlay/q/f");
    assert_usage_matches_local(&m, "overlay/q");
}
