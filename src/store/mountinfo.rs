//! Reading `/proc/self/mountinfo`, which escapes space, tab, newline and backslash in
//! paths as octal (`\040`).

use std::fs::File;
use std::io::{self, Read, Seek};
use std::path::{Path, PathBuf};

/// One mount, as a line of mountinfo describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The mount's id, unique while it is mounted.
    pub id: u64,
    /// The filesystem's device, `major:minor`: the same for every bind of one filesystem.
    pub device: String,
    /// The directory of the filesystem mounted there (`/` unless it is a bind of a part).
    pub root: PathBuf,
    pub point: PathBuf,
    pub fstype: String,
    pub source: String,
}

/// The mounts `info` (mountinfo's text) lists, in mount order; malformed lines are skipped.
pub fn parse(info: &str) -> impl Iterator<Item = Mount> + '_ {
    info.lines().filter_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        let mut before = before.split(' ');
        let id = before.next()?.parse().ok()?;
        let _parent = before.next()?;
        let (device, root, point) = (before.next()?, before.next()?, before.next()?);
        let mut after = after.split(' ');
        let fstype = after.next()?;
        let source = after.next()?;
        Some(Mount {
            id,
            device: device.to_owned(),
            root: PathBuf::from(unescape(root)),
            point: PathBuf::from(unescape(point)),
            fstype: fstype.to_owned(),
            source: unescape(source),
        })
    })
}

/// This process's mounts now; none when `/proc` cannot be read.
pub fn current() -> Vec<Mount> {
    read().unwrap_or_default()
}

/// This process's mounts now, or why `/proc` could not be read.
pub fn read() -> io::Result<Vec<Mount>> {
    Table::open()?.read()
}

const PATH: &str = "/proc/self/mountinfo";

/// The mount table, kept open. A thread that must tell an empty table from an unreadable
/// one, and read it when the process has no descriptor to spare, reads it through this: a
/// daemon at its open-file limit would otherwise see no mounts at all, and act on that.
pub struct Table(File);

impl Table {
    pub fn open() -> io::Result<Table> {
        File::open(PATH).map(Table)
    }

    /// The mounts now. Reading from the start again makes the kernel list the table anew.
    pub fn read(&mut self) -> io::Result<Vec<Mount>> {
        self.0.rewind()?;
        let mut info = String::new();
        self.0.read_to_string(&mut info)?;
        Ok(parse(&info).collect())
    }

    /// The open table, to `poll` for changes (`POLLPRI`).
    pub fn file(&self) -> &File {
        &self.0
    }
}

/// The canonical path the mount was made at, resolved without depending on the mount
/// itself answering: a mount whose daemon died fails every lookup (`ENOTCONN`), and that
/// is just when a user asks what happened.
pub fn resolve_mountpoint(path: &Path) -> PathBuf {
    if let Ok(canonical) = std::fs::canonicalize(path) {
        return canonical;
    }
    let absolute = if path.is_absolute() {
        path.to_owned()
    } else {
        match std::env::current_dir() {
            Ok(cwd) => cwd.join(path),
            Err(_) => path.to_owned(),
        }
    };
    match (absolute.parent(), absolute.file_name()) {
        (Some(parent), Some(name)) => match std::fs::canonicalize(parent) {
            Ok(parent) => parent.join(name),
            Err(_) => absolute,
        },
        _ => absolute,
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u16, |acc, d| acc * 8 + u16::from(d - b'0'));
                if let Ok(v) = u8::try_from(value) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    /// The kept-open table lists the mounts on every read, not just the first: a read
    /// that started past the end would list none, which the trim would take as "nothing
    /// mounted on the view".
    #[test]
    fn a_kept_table_lists_the_mounts_on_every_read() {
        let mut table = super::Table::open().unwrap();
        for _ in 0..3 {
            let mounts = table.read().unwrap();
            assert!(mounts.iter().any(|m| m.point == std::path::Path::new("/")));
        }
    }

    #[test]
    fn parses_point_type_and_source() {
        let info =
            "36 35 98:0 / /mnt/with\\040space rw,noatime master:1 - fuse.layerfs /remote rw\n\
                    garbage\n\
                    37 35 98:0 / /m rw - ext4 /dev/vda rw\n";
        let mounts: Vec<_> = super::parse(info).collect();
        assert_eq!(mounts.len(), 2);
        assert_eq!(mounts[0].point, std::path::Path::new("/mnt/with space"));
        assert_eq!(mounts[0].fstype, "fuse.layerfs");
        assert_eq!(mounts[0].source, "/remote");
        assert_eq!(mounts[1].source, "/dev/vda");
    }

    use super::unescape;

    #[test]
    fn escapes_are_undone_and_odd_ones_kept() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
        // Not a byte: left as it is, never an overflow.
        assert_eq!(unescape("/x\\777"), "/x\\777");
    }
}
