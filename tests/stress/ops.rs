//! The operations a worker draws. Each changes the view and the model alike, then reads
//! what it did back through the view, so that a wrong answer is caught by the operation
//! that caused it rather than by some later one.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::common::{xattr_get, xattr_set};
use crate::model::Ent;
use crate::protocol::XATTR;
use crate::verify::{describe, hex, kind_of};
use crate::worker::Worker;

impl Worker {
    /// Write a file in place (`O_CREAT|O_TRUNC`): a new file, or every link of an old one.
    pub fn op_write(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| e.is_none() || Self::is_file(e)) else {
            return;
        };
        self.count("write");
        let path = self.path(a, &name);
        let len = self.random_size();
        let data = self.content(len);
        let r = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)
            .and_then(|mut f| f.write_all(&data));
        if let Err(e) = r {
            self.error("write", &path, "ok", &e);
            return self.resync(a, &name);
        }
        match self.ent(a, &name) {
            Some(Ent::File(o)) => {
                let obj = self.objs.get_mut(&o).unwrap();
                obj.data = data;
                obj.remote = false;
            }
            _ => {
                let o = self.new_obj(data);
                self.put(a, &name, Ent::File(o));
            }
        }
        self.verify_file("write/read-back", a, &name);
    }

    /// Write a temporary file and rename it over a name (file, symlink or nothing).
    pub fn op_replace(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| !matches!(e, Some(Ent::Dir))) else {
            return;
        };
        self.count("replace");
        self.seq += 1;
        let tmp = format!(".tmp{}", self.seq);
        let (tmp_path, path) = (self.path(a, &tmp), self.path(a, &name));
        let len = self.random_size();
        let data = self.content(len);
        if let Err(e) = fs::write(&tmp_path, &data) {
            self.error("replace/write-temp", &tmp_path, "ok", &e);
            let _ = fs::remove_file(&tmp_path);
            return;
        }
        if let Err(e) = fs::rename(&tmp_path, &path) {
            self.error("replace/rename", &path, "ok", &e);
            let _ = fs::remove_file(&tmp_path);
            return self.resync(a, &name);
        }
        let o = self.new_obj(data);
        self.put(a, &name, Ent::File(o));
        self.verify_file("replace/read-back", a, &name);
        self.verify_absent("replace/temp-gone", a, &tmp);
    }

    /// Read a file back whole, a range of it, or through `mmap`; a symlink: readlink.
    pub fn op_read(&mut self, a: usize, mmap: bool) {
        let Some(name) = self.pick(a, false, |e| {
            Self::is_file(e) || (!mmap && matches!(e, Some(Ent::Link(_))))
        }) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            self.count("readlink");
            return self.verify_link("readlink", a, &name);
        };
        let path = self.path(a, &name);
        if mmap {
            self.count("mmap");
            let expected = &self.objs[&o].data;
            match mmap_read(&path) {
                Err(e) => {
                    self.error("mmap", &path, "ok", &e);
                    self.resync(a, &name);
                }
                Ok(got) if &got != expected => {
                    let expected = describe(expected);
                    self.mismatch("mmap", &path, &expected, &describe(&got));
                    self.resync(a, &name);
                }
                Ok(_) => {}
            }
        } else if self.rng.chance(25) && !self.objs[&o].data.is_empty() {
            self.count("pread");
            let len = self.objs[&o].data.len();
            let off = self.rng.below(len);
            let n = 1 + self.rng.below(len - off);
            let mut buf = vec![0u8; n];
            let r = fs::File::open(&path).and_then(|f| f.read_exact_at(&mut buf, off as u64));
            let expected = &self.objs[&o].data[off..off + n];
            match r {
                Err(e) => {
                    self.error("pread", &path, &format!("{n} bytes at {off}"), &e);
                    self.resync(a, &name);
                }
                Ok(()) if buf != expected => {
                    let expected = format!("at {off}: {}", describe(expected));
                    self.mismatch("pread", &path, &expected, &describe(&buf));
                    self.resync(a, &name);
                }
                Ok(()) => {}
            }
        } else {
            self.count("read");
            self.verify_file("read", a, &name);
        }
    }

    pub fn op_append(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        self.count("append");
        let path = self.path(a, &name);
        let len = 1 + self.rng.below(5000);
        let extra = self.content(len);
        let r = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(&extra));
        if let Err(e) = r {
            self.error("append", &path, "ok", &e);
            return self.resync(a, &name);
        }
        let obj = self.objs.get_mut(&o).unwrap();
        obj.data.extend_from_slice(&extra);
        obj.remote = false;
        self.verify_file("append/read-back", a, &name);
    }

    pub fn op_truncate(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        self.count("truncate");
        let path = self.path(a, &name);
        let len = self.rng.below(self.objs[&o].data.len() + 5000);
        let r = if self.rng.chance(50) {
            fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(len as u64))
        } else {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            if unsafe { libc::truncate(c.as_ptr(), len as libc::off_t) } == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        if let Err(e) = r {
            self.error("truncate", &path, &format!("length {len}"), &e);
            return self.resync(a, &name);
        }
        let obj = self.objs.get_mut(&o).unwrap();
        obj.data.resize(len, 0);
        obj.remote = false;
        self.verify_stat("truncate/stat", a, &name);
        self.verify_file("truncate/read-back", a, &name);
    }

    /// Rename a file or symlink over another name (of either kind, or none), possibly into
    /// the other directory; or (in the new directory only) a directory over nothing or an
    /// empty directory.
    pub fn op_rename(&mut self, a: usize) {
        let dirs = a == 0 && self.rng.chance(15);
        let Some(src) = self.pick(a, true, |e| match e {
            Some(Ent::Dir) => dirs,
            Some(_) => !dirs,
            None => false,
        }) else {
            return;
        };
        let b = if dirs { a } else { self.pick_area() };
        let Some(dst) = self.pick(b, true, |e| match e {
            Some(Ent::Dir) | None => dirs || e.is_none(),
            Some(_) => !dirs,
        }) else {
            return;
        };
        if a == b && src == dst {
            return;
        }
        self.count("rename");
        let (from, to) = (self.path(a, &src), self.path(b, &dst));
        if let Err(e) = fs::rename(&from, &to) {
            self.error("rename", &from, &format!("renamed to {}", to.display()), &e);
            self.resync(a, &src);
            return self.resync(b, &dst);
        }
        let s = self.ent(a, &src).unwrap();
        let same = matches!((&s, self.ent(b, &dst)), (Ent::File(x), Some(Ent::File(y))) if *x == y);
        if same {
            // Two links of one file: rename does nothing.
            self.verify_file("rename/same-file-src", a, &src);
            self.verify_file("rename/same-file-dst", b, &dst);
            return;
        }
        self.put(b, &dst, s);
        self.drop_name(a, &src);
        self.verify_absent("rename/source-gone", a, &src);
        self.verify_stat("rename/stat", b, &dst);
        self.verify_file("rename/read-back", b, &dst);
        self.verify_link("rename/readlink", b, &dst);
    }

    pub fn op_unlink(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| matches!(e, Some(Ent::File(_) | Ent::Link(_))))
        else {
            return;
        };
        self.count("unlink");
        let path = self.path(a, &name);
        if let Err(e) = fs::remove_file(&path) {
            self.error("unlink", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.drop_name(a, &name);
        self.verify_absent("unlink/gone", a, &name);
    }

    /// mkdir, then (mostly) rmdir at once.
    pub fn op_mkdir(&mut self, a: usize) {
        let Some(name) = self.pick(a, false, |e| e.is_none()) else {
            return;
        };
        self.count("mkdir");
        let path = self.path(a, &name);
        if let Err(e) = fs::create_dir(&path) {
            self.error("mkdir", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.put(a, &name, Ent::Dir);
        self.verify_stat("mkdir/stat", a, &name);
        if self.rng.chance(60) {
            self.rmdir(a, &name);
        }
    }

    pub fn op_rmdir(&mut self, a: usize) {
        if let Some(name) = self.pick(a, false, |e| matches!(e, Some(Ent::Dir))) {
            self.rmdir(a, &name);
        }
    }

    fn rmdir(&mut self, a: usize, name: &str) {
        self.count("rmdir");
        let path = self.path(a, name);
        if let Err(e) = fs::remove_dir(&path) {
            self.error("rmdir", &path, "ok", &e);
            return self.resync(a, name);
        }
        self.drop_name(a, name);
        self.verify_absent("rmdir/gone", a, name);
    }

    /// Unlink a name if it is there, make it a symlink, read the link back.
    pub fn op_symlink(&mut self, a: usize) {
        let Some(name) = self.pick(a, true, |e| !matches!(e, Some(Ent::Dir))) else {
            return;
        };
        self.count("symlink");
        let path = self.path(a, &name);
        if self.ent(a, &name).is_some() {
            if let Err(e) = fs::remove_file(&path) {
                self.error("symlink/unlink", &path, "ok", &e);
                return self.resync(a, &name);
            }
            self.drop_name(a, &name);
        }
        self.seq += 1;
        let len = 1 + self.rng.below(60);
        let mut target = format!("target-w{}-{}-", self.index, self.seq);
        while target.len() < len + 16 {
            target.push((b'a' + self.rng.below(26) as u8) as char);
        }
        if let Err(e) = std::os::unix::fs::symlink(&target, &path) {
            self.error("symlink", &path, "ok", &e);
            return self.resync(a, &name);
        }
        self.put(a, &name, Ent::Link(target));
        self.verify_link("symlink/readlink", a, &name);
        if self.rng.chance(30) {
            self.verify_stat("symlink/stat", a, &name);
        }
    }

    /// A hard link of a file under a new name (maybe in the other directory): both names
    /// read the same, `lstat` shows one inode with the model's link count.
    pub fn op_link(&mut self, a: usize) {
        let Some(src) = self.pick(a, true, Self::is_file) else {
            return;
        };
        let b = self.pick_area();
        let Some(dst) = self.pick(b, false, |e| e.is_none()) else {
            return;
        };
        self.count("link");
        let (from, to) = (self.path(a, &src), self.path(b, &dst));
        if let Err(e) = fs::hard_link(&from, &to) {
            self.error("link", &to, &format!("a link of {}", from.display()), &e);
            self.resync(a, &src);
            return self.resync(b, &dst);
        }
        let s = self.ent(a, &src).unwrap();
        if let Ent::File(o) = s {
            self.objs.get_mut(&o).unwrap().remote = false;
        }
        self.put(b, &dst, s);
        self.verify_file("link/read-new", b, &dst);
        self.verify_file("link/read-old", a, &src);
        match (fs::symlink_metadata(&from), fs::symlink_metadata(&to)) {
            (Ok(x), Ok(y)) => {
                let links = match self.ent(b, &dst) {
                    Some(Ent::File(o)) => self.objs[&o].links as u64,
                    _ => 0,
                };
                if x.ino() != y.ino() || y.nlink() != links || x.nlink() != links {
                    let got = format!(
                        "ino {} nlink {} / ino {} nlink {}",
                        x.ino(),
                        x.nlink(),
                        y.ino(),
                        y.nlink()
                    );
                    self.mismatch("link/stat", &to, &format!("one inode, {links} links"), &got);
                    self.resync(a, &src);
                    self.resync(b, &dst);
                }
            }
            (Err(e), _) => self.error("link/stat-old", &from, "ok", &e),
            (_, Err(e)) => self.error("link/stat-new", &to, "ok", &e),
        }
    }

    /// List a directory: exactly the model's names, each of which `lstat`s fine, with the
    /// model's kind (in `d_type` and in `lstat`).
    pub fn op_scandir(&mut self, a: usize) {
        self.count("scandir");
        let dir = self.areas[a].dir.clone();
        let entries = match fs::read_dir(&dir).and_then(|it| it.collect::<io::Result<Vec<_>>>()) {
            Ok(v) => v,
            Err(e) => return self.error("scandir", &dir, "a listing", &e),
        };
        let mut listed = BTreeSet::new();
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            listed.insert(name.clone());
            let dtype = e.file_type().ok();
            match fs::symlink_metadata(&path) {
                Err(err) => {
                    self.error("scandir/lstat", &path, "a listed name lstats", &err);
                    self.resync(a, &name);
                    continue;
                }
                Ok(m) => {
                    let ft = m.file_type();
                    let kind = kind_of(&ft);
                    let want = match self.ent(a, &name) {
                        Some(Ent::File(_)) => "file",
                        Some(Ent::Link(_)) => "symlink",
                        Some(Ent::Dir) => "dir",
                        None => "absent",
                    };
                    let dkind = dtype.as_ref().map(kind_of).unwrap_or("?");
                    if kind != want || dkind != want {
                        let got = format!("lstat {kind}, d_type {dkind}");
                        self.mismatch("scandir/kind", &path, want, &got);
                        self.resync(a, &name);
                    }
                }
            }
        }
        let model: BTreeSet<String> = self.areas[a].names.keys().cloned().collect();
        let missing: Vec<String> = model.difference(&listed).cloned().collect();
        for name in missing {
            let path = self.path(a, &name);
            self.mismatch("scandir/missing", &path, "listed", "not listed");
            self.resync(a, &name);
        }
    }

    pub fn op_xattr(&mut self, a: usize) {
        let set = self.rng.chance(50);
        let Some(name) = self.pick(a, set, Self::is_file) else {
            return;
        };
        let Some(Ent::File(o)) = self.ent(a, &name) else {
            return;
        };
        let path = self.path(a, &name);
        if set {
            self.count("setxattr");
            let len = 1 + self.rng.below(64);
            let value = self.content(len);
            if let Err(e) = xattr_set(&path, XATTR, &value) {
                self.error("setxattr", &path, "ok", &e);
                return self.resync(a, &name);
            }
            let obj = self.objs.get_mut(&o).unwrap();
            obj.xattr = Some(value);
            obj.remote = false;
        }
        self.count("getxattr");
        let expected = self.objs[&o].xattr.clone();
        match (xattr_get(&path, XATTR), expected) {
            (Ok(got), Some(want)) if got == want => {}
            (Err(e), None) if e.raw_os_error() == Some(libc::ENODATA) => {}
            (Err(e), want) => {
                let want = want.map_or("ENODATA".to_owned(), |w| hex(&w));
                self.error("getxattr", &path, &want, &e);
                self.resync(a, &name);
            }
            (Ok(got), want) => {
                let want = want.map_or("ENODATA".to_owned(), |w| hex(&w));
                self.mismatch("getxattr", &path, &want, &hex(&got));
                self.resync(a, &name);
            }
        }
    }

    /// Read one of L1's fixture files through the view.
    pub fn op_fixture(&mut self) {
        self.count("fixture");
        let i = self.rng.below(self.fixtures.len());
        let (path, want) = &self.fixtures[i];
        let (path, want) = (path.clone(), describe(want));
        match fs::read(&path) {
            Err(e) => self.error("fixture", &path, &want, &e),
            Ok(got) if describe(&got) != want => {
                self.mismatch("fixture", &path, &want, &describe(&got))
            }
            Ok(_) => {}
        }
    }

    /// Create a file, write it, unlink it while open, then read it through the open fd.
    pub fn op_scratch(&mut self, a: usize) {
        self.count("scratch");
        self.seq += 1;
        let name = format!(".scratch{}", self.seq);
        let path = self.path(a, &name);
        let len = self.random_size();
        let data = self.content(len);
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path);
        let mut f = match f {
            Ok(f) => f,
            Err(e) => return self.error("scratch/create", &path, "ok", &e),
        };
        if let Err(e) = f.write_all(&data) {
            self.error("scratch/write", &path, "ok", &e);
        }
        if let Err(e) = fs::remove_file(&path) {
            self.error("scratch/unlink", &path, "ok", &e);
            return;
        }
        self.verify_absent("scratch/gone", a, &name);
        let mut got = vec![0u8; data.len()];
        match f.read_exact_at(&mut got, 0) {
            Err(e) => self.error("scratch/read-unlinked", &path, "ok", &e),
            Ok(()) if got != data => self.mismatch(
                "scratch/read-unlinked",
                &path,
                &describe(&data),
                &describe(&got),
            ),
            Ok(()) => {}
        }
    }

    pub fn op_stat(&mut self, a: usize) {
        let Some(name) = self.pick(a, false, |e| e.is_some()) else {
            return;
        };
        self.count("stat");
        self.verify_stat("stat", a, &name);
    }
}

/// Reopens `path` and reads it whole through a shared read-only mapping.
fn mmap_read(path: &Path) -> io::Result<Vec<u8>> {
    let f = fs::File::open(path)?;
    let len = f.metadata()?.len() as usize;
    if len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: a fresh read-only mapping of `len` bytes of an open file, copied out and
    // unmapped before returning; nobody else writes this file meanwhile.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let data = std::slice::from_raw_parts(p as *const u8, len).to_vec();
        libc::munmap(p, len);
        Ok(data)
    }
}
