//! A publisher's segments: `<publisher>.<generation>.log` files, each written by one
//! publisher only and only ever appended to.
//!
//! One writer per file is what keeps a segment whole on NFS, where `O_APPEND` from two
//! hosts is not atomic (each client writes at the end it last saw). A publisher never
//! appends to a segment an earlier run left: it starts a new generation, so a tail torn by
//! a crash stays where it was, followed by nothing. A segment that outgrows its limit is
//! sealed (a last record names the next generation) and the publisher goes on in the next;
//! segments older than the one before the current are removed.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::record::{Body, Header, Record};
use super::{unix_ms, JournalError};

/// The file name of a segment.
pub fn file_name(publisher: &str, generation: u64) -> String {
    format!("{publisher}.{generation:016x}.log")
}

/// The publisher and generation a segment's file name stands for.
pub fn parse_file_name(name: &str) -> Option<(&str, u64)> {
    let stem = name.strip_suffix(".log")?;
    let (publisher, generation) = stem.rsplit_once('.')?;
    if generation.len() != 16 || !super::record::is_publisher_name(publisher) {
        return None;
    }
    Some((publisher, u64::from_str_radix(generation, 16).ok()?))
}

/// The generations of `publisher`'s segments in `dir`, oldest first.
pub fn generations(dir: &Path, publisher: &str) -> io::Result<Vec<u64>> {
    let mut found: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let (who, generation) = parse_file_name(name.to_str()?)?;
            (who == publisher).then_some(generation)
        })
        .collect();
    found.sort_unstable();
    Ok(found)
}

/// The appending end of one publisher's journal.
pub struct Writer {
    dir: PathBuf,
    publisher: String,
    generation: u64,
    file: File,
    len: u64,
    seq: u64,
    /// Past this many bytes the segment is sealed and the next one begun.
    limit: u64,
}

impl Writer {
    /// Begins a new segment for `publisher` in `dir`, one generation past any it finds.
    pub fn begin(dir: &Path, publisher: &str, limit: u64) -> Result<Writer, JournalError> {
        let at = |error| JournalError::Io {
            path: dir.to_owned(),
            error,
        };
        let next = generations(dir, publisher)
            .map_err(at)?
            .last()
            .map_or(1, |g| g + 1);
        let (file, generation) = create(dir, publisher, next)?;
        let mut writer = Writer {
            dir: dir.to_owned(),
            publisher: publisher.to_owned(),
            generation,
            file,
            len: 0,
            seq: 0,
            limit,
        };
        writer.start()?;
        Ok(writer)
    }

    /// The current segment and how long it is.
    pub fn position(&self) -> (u64, u64) {
        (self.generation, self.len)
    }

    pub fn publisher(&self) -> &str {
        &self.publisher
    }

    /// Appends one record per body, in one write, and makes them durable.
    pub fn append(&mut self, bodies: Vec<Body>) -> Result<(), JournalError> {
        if bodies.is_empty() {
            return Ok(());
        }
        let now = unix_ms();
        let mut text = String::new();
        for body in bodies {
            self.seq += 1;
            let record = Record {
                seq: self.seq,
                unix_ms: now,
                body,
            };
            text.push_str(&record.encode());
        }
        self.write(text.as_bytes())?;
        if self.len >= self.limit {
            self.rotate()?;
        }
        Ok(())
    }

    /// Seals this segment and goes on in the next generation; drops all but the last two.
    fn rotate(&mut self) -> Result<(), JournalError> {
        let (file, next) = create(&self.dir, &self.publisher, self.generation + 1)?;
        self.seq += 1;
        let sealed = Record {
            seq: self.seq,
            unix_ms: unix_ms(),
            body: Body::Sealed { next },
        };
        self.write(sealed.encode().as_bytes())?;
        let previous = self.generation;
        self.file = file;
        self.generation = next;
        self.len = 0;
        self.seq = 0;
        self.start()?;
        // Readers further behind than the segment before this one scan the remote instead.
        if let Ok(old) = generations(&self.dir, &self.publisher) {
            for generation in old.into_iter().filter(|g| *g < previous) {
                let path = self.dir.join(file_name(&self.publisher, generation));
                if let Err(e) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "old journal segment not removed");
                }
            }
        }
        Ok(())
    }

    fn start(&mut self) -> Result<(), JournalError> {
        let header = Header {
            publisher: self.publisher.clone(),
            generation: self.generation,
        };
        self.write(header.encode().as_bytes())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), JournalError> {
        let path = self.dir.join(file_name(&self.publisher, self.generation));
        let io = |error| JournalError::Io {
            path: path.clone(),
            error,
        };
        // One write: a reader sees all of it or a torn tail it skips, never a mixture
        // with another writer's bytes (nobody else writes this file).
        self.file.write_all(bytes).map_err(io)?;
        self.file.sync_data().map_err(io)?;
        self.len += bytes.len() as u64;
        Ok(())
    }
}

/// Creates the segment of `generation`, or of the first free one after it (another run
/// under the same name got there first), and makes its name durable.
fn create(dir: &Path, publisher: &str, from: u64) -> Result<(File, u64), JournalError> {
    for generation in from..from.saturating_add(64) {
        let path = dir.join(file_name(publisher, generation));
        match OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)
        {
            Ok(file) => {
                super::sync_dir(dir).map_err(|error| JournalError::Io {
                    path: dir.to_owned(),
                    error,
                })?;
                return Ok((file, generation));
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(source) => {
                return Err(JournalError::Io {
                    path,
                    error: source,
                })
            }
        }
    }
    Err(JournalError::Io {
        path: dir.to_owned(),
        error: io::Error::other(format!(
            "64 segments of publisher {publisher} already exist past generation {from:016x}: is another publisher running under this name?"
        )),
    })
}

/// What a reader got out of a segment from some offset on.
#[derive(Debug, Default)]
pub struct Chunk {
    pub header: Option<Header>,
    pub records: Vec<Record>,
    /// Where the next read starts: after the last whole line.
    pub next: u64,
    /// Whole lines that were not records (torn or garbled), skipped.
    pub torn: usize,
}

/// At most this much is read from a segment per read.
const READ_MAX: usize = 1 << 20;

/// Reads `path` from `offset` on, opening it afresh (close-to-open: on NFS the open fetches
/// the file's current attributes). A line not yet ended by a newline is left for later.
///
/// The read is direct where the filesystem allows: a FUSE client such as sshfs may keep the
/// file's old size for a second after it grew, and a cached read stops there. A direct read
/// from below that size returns what the server holds, so it starts at the block holding
/// `offset`, or lower if the size the client knows is lower still.
pub fn read_from(path: &Path, offset: u64) -> io::Result<Chunk> {
    let (file, direct) = super::open_direct(path)?;
    let start = if direct {
        let known = file.metadata()?.len();
        let below = offset.min(known.saturating_sub(1));
        below - below % super::PAGE as u64
    } else {
        offset
    };
    let mut pages = vec![super::Page([0; super::PAGE]); READ_MAX / super::PAGE];
    let buf = super::bytes_of(&mut pages);
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], start + got as u64) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                // A direct read must go on from an aligned offset: a short one ends it.
                if direct && got % super::PAGE != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let skip = usize::try_from(offset - start).unwrap_or(usize::MAX);
    let bytes = buf.get(skip..got).unwrap_or_default();
    let mut chunk = Chunk {
        next: offset,
        ..Chunk::default()
    };
    let mut at = 0;
    while let Some(end) = bytes[at..].iter().position(|b| *b == b'\n') {
        let line = &bytes[at..at + end];
        if offset == 0 && at == 0 {
            chunk.header = Header::decode(line);
            if chunk.header.is_none() {
                chunk.torn += 1;
            }
        } else {
            match Record::decode(line) {
                Some(record) => chunk.records.push(record),
                None => {
                    chunk.torn += 1;
                    chunk.records.extend(salvage(line));
                }
            }
        }
        at += end + 1;
    }
    chunk.next = offset + at as u64;
    Ok(chunk)
}

/// The whole record at the end of a line that is not one: a torn tail left by a writer
/// that died, followed by what the next write to the file appended.
fn salvage(line: &[u8]) -> Option<Record> {
    (1..line.len()).find_map(|at| Record::decode(&line[at..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::record::Event;
    use crate::report::Kind;

    fn ready(n: u8) -> Body {
        Body::Object {
            event: Event::Ready,
            kind: Kind::Image,
            id: format!("{:064x}", n),
        }
    }

    #[test]
    fn names_round_trip() {
        let name = file_name("node-1", 42);
        assert_eq!(parse_file_name(&name), Some(("node-1", 42)));
        assert_eq!(parse_file_name("bell"), None);
        assert_eq!(parse_file_name("a/b.0000000000000001.log"), None);
    }

    #[test]
    fn appended_records_are_read_back_and_torn_tails_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = Writer::begin(dir.path(), "node-1", 1 << 20).unwrap();
        writer.append(vec![ready(1), ready(2)]).unwrap();
        let (generation, len) = writer.position();
        let path = dir.path().join(file_name("node-1", generation));
        let chunk = read_from(&path, 0).unwrap();
        assert_eq!(chunk.header.unwrap().publisher, "node-1");
        assert_eq!(chunk.records.len(), 2);
        assert_eq!(chunk.next, len);

        // A crash mid-write leaves half a line: not read until it ends, then counted as torn.
        let mut raw = OpenOptions::new().append(true).open(&path).unwrap();
        raw.write_all(b"3 17 ready ima").unwrap();
        let chunk = read_from(&path, len).unwrap();
        assert_eq!((chunk.records.len(), chunk.torn, chunk.next), (0, 0, len));
        drop(raw);
        writer.append(vec![ready(4)]).unwrap();
        let chunk = read_from(&path, len).unwrap();
        assert_eq!(chunk.torn, 1);
        assert_eq!(
            chunk
                .records
                .iter()
                .map(|r| r.body.clone())
                .collect::<Vec<_>>(),
            vec![ready(4)],
            "the record glued to the torn half-line is salvaged"
        );
        writer.append(vec![ready(5)]).unwrap();
        let chunk = read_from(&path, chunk.next).unwrap();
        assert_eq!(chunk.records.len(), 1);
    }

    #[test]
    fn a_new_run_starts_a_new_generation_and_rotation_keeps_two() {
        let dir = tempfile::tempdir().unwrap();
        let first = Writer::begin(dir.path(), "p", 1 << 20).unwrap();
        let second = Writer::begin(dir.path(), "p", 1 << 20).unwrap();
        assert_eq!(second.position().0, first.position().0 + 1);
        drop((first, second));

        let mut writer = Writer::begin(dir.path(), "p", 600).unwrap();
        let start = writer.position().0;
        for n in 0..40 {
            writer.append(vec![ready(n)]).unwrap();
        }
        let (now, _) = writer.position();
        assert!(now > start + 2, "rotated: {start} -> {now}");
        assert_eq!(generations(dir.path(), "p").unwrap(), vec![now - 1, now]);
        // The sealed segment names its successor last.
        let sealed = read_from(&dir.path().join(file_name("p", now - 1)), 0).unwrap();
        assert_eq!(
            sealed.records.last().map(|r| r.body.clone()),
            Some(Body::Sealed { next: now })
        );
    }
}
