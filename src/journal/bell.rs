//! The bell: one small file of fixed size that every publisher rewrites after it appends,
//! and that every reader polls.
//!
//! Readers poll one file whatever the number of publishers, and a read of it costs one
//! request: its size never changes, so a reader keeps it open and reads it with `O_DIRECT`,
//! which goes to the server every time (no page cache, and no attribute cache deciding where
//! the file ends). Two publishers ringing at once leave one ring or the other; either
//! differs from what a reader saw before (each ring carries a fresh token), and a reader
//! that hears a ring reads every publisher's segment, so no record waits for the next ring.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::record::{check_of, is_publisher_name};
use super::{Page, PAGE};

/// The bell's size in bytes: one line, padded with spaces.
pub const BELL_SIZE: usize = 256;

/// A reader opens the bell afresh at least this often, so a bell deleted and created again
/// (a journal directory replaced) is not read through a stale handle for long.
const REOPEN_EVERY: Duration = Duration::from_secs(30);

/// How often while the bell is quiet past a heartbeat: its publishers may be gone, and the
/// journal with them.
const REOPEN_QUIET: Duration = Duration::from_secs(2);

const TAG: &str = "layerfs-bell 1";

/// What a ring says: who rang, how far their current segment goes, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    pub publisher: String,
    pub generation: u64,
    /// The length of that segment once the ring's records were appended.
    pub length: u64,
    /// Fresh for every ring, so that no two rings read the same.
    pub token: u64,
    pub unix_ms: u64,
}

impl Ring {
    pub fn encode(&self) -> [u8; BELL_SIZE] {
        let line = format!(
            "{TAG} {} {:016x} {} {:016x} {} ",
            self.publisher, self.generation, self.length, self.token, self.unix_ms
        );
        let line = format!("{line}{}", check_of(line.as_bytes()));
        let mut bytes = [b' '; BELL_SIZE];
        bytes[..line.len()].copy_from_slice(line.as_bytes());
        bytes[BELL_SIZE - 1] = b'\n';
        bytes
    }

    /// `None` for anything but a whole, intact ring.
    pub fn decode(bytes: &[u8]) -> Option<Ring> {
        let text = std::str::from_utf8(bytes).ok()?.trim_end();
        let (signed, check) = text.rsplit_once(' ')?;
        if check_of(format!("{signed} ").as_bytes()) != check {
            return None;
        }
        let rest = signed.strip_prefix(TAG)?.strip_prefix(' ')?;
        let fields: Vec<&str> = rest.split(' ').collect();
        let [publisher, generation, length, token, unix_ms] = fields[..] else {
            return None;
        };
        if !is_publisher_name(publisher) {
            return None;
        }
        Some(Ring {
            publisher: publisher.to_owned(),
            generation: u64::from_str_radix(generation, 16).ok()?,
            length: length.parse().ok()?,
            token: u64::from_str_radix(token, 16).ok()?,
            unix_ms: unix_ms.parse().ok()?,
        })
    }
}

/// Rings the bell at `path`: one write of the whole bell, made durable before it returns.
pub fn ring(path: &Path, ring: &Ring) -> io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)?;
    file.write_all_at(&ring.encode(), 0)?;
    file.sync_data()
}

/// A reader's handle on the bell.
pub struct BellReader {
    path: PathBuf,
    open: Option<(File, Instant)>,
    /// Whether the filesystem takes `O_DIRECT`; without it the bell is opened afresh for
    /// every read (close-to-open then defeats attribute caching on NFS).
    direct: bool,
    buf: Box<Page>,
}

impl BellReader {
    pub fn new(path: &Path) -> BellReader {
        BellReader {
            path: path.to_owned(),
            open: None,
            direct: true,
            buf: Box::new(Page([0; PAGE])),
        }
    }

    /// Reads the bell as it is on the server now: `Ok(None)` when there is none. `quiet`:
    /// it has not changed for longer than a heartbeat.
    pub fn read(&mut self, quiet: bool) -> io::Result<Option<Vec<u8>>> {
        let every = if quiet { REOPEN_QUIET } else { REOPEN_EVERY };
        let stale = self
            .open
            .as_ref()
            .is_some_and(|(_, at)| !self.direct || at.elapsed() >= every);
        if stale {
            self.open = None;
        }
        if self.open.is_none() {
            match self.open_bell() {
                Ok(file) => self.open = Some((file, Instant::now())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        let (file, _) = self.open.as_ref().expect("opened above");
        match file.read_at(&mut self.buf.0, 0) {
            Ok(n) => Ok(Some(self.buf.0[..n.min(BELL_SIZE)].to_vec())),
            Err(e) => {
                // The next read opens it afresh (a bell replaced, a handle gone stale).
                self.open = None;
                Err(e)
            }
        }
    }

    fn open_bell(&mut self) -> io::Result<File> {
        if !self.direct {
            return OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&self.path);
        }
        let (file, direct) = super::open_direct(&self.path)?;
        if !direct {
            tracing::debug!(path = %self.path.display(), "no O_DIRECT here: the bell is opened for every read");
            self.direct = false;
        }
        Ok(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Ring {
        Ring {
            publisher: "node-1".into(),
            generation: 2,
            length: 4096,
            token: 0xdead_beef,
            unix_ms: 1_765_065_600_000,
        }
    }

    #[test]
    fn rings_round_trip_and_damage_is_refused() {
        let bytes = sample().encode();
        assert_eq!(bytes.len(), BELL_SIZE);
        assert_eq!(Ring::decode(&bytes), Some(sample()));
        let mut torn = bytes;
        torn[20] ^= 1;
        assert_eq!(Ring::decode(&torn), None);
        assert_eq!(Ring::decode(&[b' '; BELL_SIZE]), None);
    }

    #[test]
    fn a_reader_hears_each_ring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bell");
        let mut reader = BellReader::new(&path);
        assert_eq!(reader.read(false).unwrap(), None);
        let mut r = sample();
        ring(&path, &r).unwrap();
        let first = reader.read(false).unwrap().unwrap();
        assert_eq!(Ring::decode(&first), Some(r.clone()));
        r.token += 1;
        ring(&path, &r).unwrap();
        let second = reader.read(false).unwrap().unwrap();
        assert_ne!(first, second);
        assert_eq!(Ring::decode(&second), Some(r));
    }
}
