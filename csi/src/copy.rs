//! Writing and checksumming image files in one pass.
//!
//! An image is read once: what is read is written and fed to SHA-512 at the same time, and
//! the checksum of the finished file is the one computed on the way (no second read). Hashing
//! is the slowest part, so it runs on a thread of its own while the caller reads and writes.
//! Images are mostly holes: a source's holes are found with `SEEK_DATA`/`SEEK_HOLE` and never
//! read, blocks of zeros are never written (the destination stays sparse), and both are hashed
//! from a static buffer of zeros.

use std::fs::File;
use std::io::{self, Read};
use std::num::NonZeroU64;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::{CsiError, Result};
use super::sha512::Sha512;

/// The unit of reads, writes and hashing.
pub const CHUNK: usize = 1 << 20;

/// Chunks in flight between the writer and the hashing thread.
const IN_FLIGHT: usize = 8;

/// How often progress is reported.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

static ZEROS: [u8; CHUNK] = [0; CHUNK];

/// What a finished copy produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub size: u64,
    pub sha512: String,
}

enum Piece {
    Data(Vec<u8>, usize),
    Zeros(u64),
}

/// Writes a file sequentially while a thread hashes what is written. Zero chunks become holes.
pub struct HashingWriter {
    dest: File,
    offset: u64,
    /// Where writeback was last started (see [`HashingWriter::start_writeback`]).
    flushed: u64,
    to_hasher: Option<SyncSender<Piece>>,
    recycled: Receiver<Vec<u8>>,
    hasher: Option<JoinHandle<Sha512>>,
}

impl HashingWriter {
    /// Writes into `dest`, which must be empty.
    pub fn new(dest: File) -> HashingWriter {
        let (to_hasher, pieces) = mpsc::sync_channel::<Piece>(IN_FLIGHT);
        let (give_back, recycled) = mpsc::sync_channel::<Vec<u8>>(IN_FLIGHT + 2);
        for _ in 0..IN_FLIGHT + 2 {
            let _ = give_back.try_send(vec![0u8; CHUNK]);
        }
        let hasher = std::thread::spawn(move || {
            let mut sha = Sha512::new();
            for piece in pieces {
                match piece {
                    Piece::Data(buf, n) => {
                        sha.update(&buf[..n]);
                        let _ = give_back.try_send(buf);
                    }
                    Piece::Zeros(mut n) => {
                        while n > 0 {
                            let k = n.min(CHUNK as u64) as usize;
                            sha.update(&ZEROS[..k]);
                            n -= k as u64;
                        }
                    }
                }
            }
            sha
        });
        HashingWriter {
            dest,
            offset: 0,
            flushed: 0,
            to_hasher: Some(to_hasher),
            recycled,
            hasher: Some(hasher),
        }
    }

    /// Bytes written (or skipped as zeros) so far.
    pub fn len(&self) -> u64 {
        self.offset
    }

    pub fn is_empty(&self) -> bool {
        self.offset == 0
    }

    /// A buffer of [`CHUNK`] bytes to fill and hand to [`HashingWriter::write`].
    pub fn buffer(&mut self) -> Vec<u8> {
        self.recycled
            .try_recv()
            .unwrap_or_else(|_| vec![0u8; CHUNK])
    }

    /// Appends `buf[..n]`.
    pub fn write(&mut self, buf: Vec<u8>, n: usize) -> io::Result<()> {
        if !is_zero(&buf[..n]) {
            self.dest.write_all_at(&buf[..n], self.offset)?;
        }
        self.offset += n as u64;
        self.send(Piece::Data(buf, n))?;
        self.start_writeback();
        Ok(())
    }

    /// Appends `n` zero bytes, as a hole.
    pub fn zeros(&mut self, n: u64) -> io::Result<()> {
        self.offset += n;
        self.send(Piece::Zeros(n))
    }

    fn send(&mut self, piece: Piece) -> io::Result<()> {
        let sent = self.to_hasher.as_ref().map(|tx| tx.send(piece));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(io::Error::other("the hashing thread is gone")),
        }
    }

    /// Starts writing back what was written since the last call, every 8 MiB, so that the
    /// final fsync finds little left to do and the page cache does not fill with dirty pages.
    fn start_writeback(&mut self) {
        const EVERY: u64 = 8 << 20;
        if self.offset - self.flushed < EVERY {
            return;
        }
        // SAFETY: a plain syscall on an open descriptor; errors only lose the head start.
        unsafe {
            libc::sync_file_range(
                self.dest.as_raw_fd(),
                self.flushed as i64,
                (self.offset - self.flushed) as i64,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
        self.flushed = self.offset;
    }

    /// Sets the file's length (trailing holes), fsyncs it while the hash is completed, and
    /// returns the size and checksum.
    pub fn finish(mut self) -> io::Result<Copied> {
        self.dest.set_len(self.offset)?;
        drop(self.to_hasher.take());
        let synced = self.dest.sync_all();
        let sha = self
            .hasher
            .take()
            .map(JoinHandle::join)
            .and_then(std::result::Result::ok)
            .ok_or_else(|| io::Error::other("the hashing thread failed"))?;
        synced?;
        Ok(Copied {
            size: self.offset,
            sha512: sha.finish_hex(),
        })
    }
}

impl Drop for HashingWriter {
    fn drop(&mut self) {
        drop(self.to_hasher.take());
        if let Some(h) = self.hasher.take() {
            let _ = h.join();
        }
    }
}

/// Whether every byte is zero.
pub fn is_zero(buf: &[u8]) -> bool {
    let (head, words, tail) = unsafe {
        // SAFETY: u128 has no invalid bit patterns; align_to keeps the slices in bounds.
        buf.align_to::<u128>()
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// The next data segment `[start, end)` of `file` at or after `offset`, `None` past the last.
fn next_data(file: &File, offset: u64, len: u64) -> io::Result<Option<(u64, u64)>> {
    if offset >= len {
        return Ok(None);
    }
    let fd = file.as_raw_fd();
    // SAFETY: lseek on an open descriptor; reads and writes use explicit offsets, so moving
    // the file position is harmless.
    let start = unsafe { libc::lseek(fd, offset as i64, libc::SEEK_DATA) };
    if start < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            // A filesystem that cannot tell: all of it is data.
            Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(Some((offset, len))),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    if end < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(((start as u64).min(len), (end as u64).min(len))))
}

/// Keeps reads at or under a rate in bytes per second, so that copying a large volume leaves
/// the node's disk to the workloads on it. Only data read counts: holes are free.
struct Pace {
    rate: Option<NonZeroU64>,
    start: Instant,
    read: u64,
}

impl Pace {
    fn new(rate: Option<NonZeroU64>) -> Pace {
        Pace {
            rate,
            start: Instant::now(),
            read: 0,
        }
    }

    /// Counts `n` bytes read and waits until the rate allows them, stopping early (with
    /// [`Cancelled`]) once `stop` is set.
    fn read(&mut self, n: u64, stop: &AtomicBool) -> io::Result<()> {
        let Some(rate) = self.rate else {
            return Ok(());
        };
        self.read += n;
        let due = self.start + Duration::from_secs_f64(self.read as f64 / rate.get() as f64);
        loop {
            if stop.load(Ordering::Relaxed) {
                return Err(io::Error::other(Cancelled));
            }
            let now = Instant::now();
            if now >= due {
                return Ok(());
            }
            std::thread::sleep((due - now).min(Duration::from_millis(100)));
        }
    }
}

/// Feeds every byte of `src` to `out`, reading only its data segments (at most `rate` bytes
/// per second of them); holes go in as zeros. Stops with [`Cancelled`] once `stop` is set.
fn pump_sparse(
    src: &File,
    out: &mut HashingWriter,
    stop: &AtomicBool,
    rate: Option<NonZeroU64>,
    progress: &mut dyn FnMut(u64, u64),
) -> io::Result<()> {
    let len = src.metadata()?.len();
    let mut pace = Pace::new(rate);
    let mut pos = 0u64;
    let mut last = Instant::now();
    progress(0, len);
    while pos < len {
        let (start, end) = next_data(src, pos, len)?.unwrap_or((len, len));
        if start > pos {
            out.zeros(start - pos)?;
        }
        pos = start;
        while pos < end {
            if stop.load(Ordering::Relaxed) {
                return Err(io::Error::other(Cancelled));
            }
            let mut buf = out.buffer();
            let want = ((end - pos) as usize).min(CHUNK);
            let n = read_full_at(src, &mut buf[..want], pos)?;
            if n == 0 {
                // Truncated under us: what is missing reads as zeros, as for any hole.
                break;
            }
            out.write(buf, n)?;
            pos += n as u64;
            pace.read(n as u64, stop)?;
            if last.elapsed() >= PROGRESS_EVERY {
                progress(pos, len);
                last = Instant::now();
            }
        }
        pos = pos.max(end);
    }
    if out.len() < len {
        out.zeros(len - out.len())?;
    }
    progress(len, len);
    Ok(())
}

fn read_full_at(src: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match src.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Why a copy stopped early: its caller set the stop flag.
#[derive(Debug)]
struct Cancelled;

impl std::fmt::Display for Cancelled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cancelled")
    }
}

impl std::error::Error for Cancelled {}

/// Sets a stop flag when dropped: a copy on a blocking thread ends with the task that
/// waited for it, as a child process killed on drop would.
pub struct StopOnDrop(pub Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Copies `src` to a new file `dest` (sparse, fsynced) and checksums it in the same pass,
/// reading at most `rate` bytes per second when given. `progress(done, total)` is called
/// about once a second; setting `stop` ends the copy with `ABORTED`. Blocking.
pub fn copy_file(
    src: &Path,
    dest: &Path,
    stop: &AtomicBool,
    rate: Option<NonZeroU64>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Copied> {
    let input =
        File::open(src).map_err(|e| CsiError::io(format!("opening {}", src.display()), e))?;
    let output = File::options()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| CsiError::io(format!("creating {}", dest.display()), e))?;
    let mut out = HashingWriter::new(output);
    pump_sparse(&input, &mut out, stop, rate, progress).map_err(|e| {
        if e.get_ref().is_some_and(|inner| inner.is::<Cancelled>()) {
            return CsiError::Aborted(format!("copying {} was cancelled", src.display()));
        }
        CsiError::io(
            format!("copying {} to {}", src.display(), dest.display()),
            e,
        )
    })?;
    out.finish()
        .map_err(|e| CsiError::io(format!("writing {}", dest.display()), e))
}

/// SHA-512 of a whole file, as 128 lower-case hex digits; holes are not read. Blocking.
pub fn sha512_file(path: &Path) -> Result<String> {
    let file =
        File::open(path).map_err(|e| CsiError::io(format!("opening {}", path.display()), e))?;
    let len = file
        .metadata()
        .map_err(|e| CsiError::io(format!("{}", path.display()), e))?
        .len();
    let mut sha = Sha512::new();
    let mut buf = vec![0u8; CHUNK];
    let mut pos = 0u64;
    let fail = |e| CsiError::io(format!("reading {}", path.display()), e);
    while pos < len {
        let (start, end) = next_data(&file, pos, len)
            .map_err(fail)?
            .unwrap_or((len, len));
        hash_zeros(&mut sha, start - pos);
        pos = start;
        while pos < end {
            let want = ((end - pos) as usize).min(CHUNK);
            let n = read_full_at(&file, &mut buf[..want], pos).map_err(fail)?;
            if n == 0 {
                break;
            }
            sha.update(&buf[..n]);
            pos += n as u64;
        }
        if pos < end {
            hash_zeros(&mut sha, end - pos);
            pos = end;
        }
    }
    Ok(sha.finish_hex())
}

fn hash_zeros(sha: &mut Sha512, mut n: u64) {
    while n > 0 {
        let k = n.min(CHUNK as u64) as usize;
        sha.update(&ZEROS[..k]);
        n -= k as u64;
    }
}

/// Why [`pump_stream`] stopped early.
#[derive(Debug)]
pub enum StreamError {
    /// Reading the source failed.
    Read(io::Error),
    /// Writing the destination failed.
    Write(io::Error),
    /// The first chunk was refused by the caller.
    Refused(CsiError),
}

/// Reads `src` to its end into `out`, a chunk at a time. `first` checks the first chunk
/// before anything is written; `progress(done)` is called about once a second.
pub fn pump_stream(
    src: &mut dyn Read,
    out: &mut HashingWriter,
    first: &mut dyn FnMut(&[u8]) -> Result<()>,
    progress: &mut dyn FnMut(u64),
) -> std::result::Result<(), StreamError> {
    let mut last = Instant::now();
    let mut started = false;
    loop {
        let mut buf = out.buffer();
        // Fill the chunk (a socket hands out a few KiB at a time): fewer, bigger writes.
        let mut n = 0;
        while n < CHUNK {
            match src.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(StreamError::Read(e)),
            }
        }
        if n == 0 {
            return Ok(());
        }
        if !started {
            first(&buf[..n]).map_err(StreamError::Refused)?;
            started = true;
        }
        out.write(buf, n).map_err(StreamError::Write)?;
        if last.elapsed() >= PROGRESS_EVERY {
            progress(out.len());
            last = Instant::now();
        }
        if n < CHUNK {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sha512::hex;
    use sha2::Digest;
    use std::io::Write;

    fn sparse_file(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
        let path = dir.join("src.img");
        let mut f = File::create(&path).unwrap();
        let len = 9 * CHUNK as u64 + 12345;
        f.set_len(len).unwrap();
        let mut whole = vec![0u8; len as usize];
        for (i, at) in [CHUNK as u64 / 2, 3 * CHUNK as u64 + 7, 8 * CHUNK as u64]
            .iter()
            .enumerate()
        {
            let data: Vec<u8> = (0..CHUNK + 999).map(|j| (j * 31 + i) as u8 | 1).collect();
            let end = (*at as usize + data.len()).min(len as usize);
            f.write_all_at(&data[..end - *at as usize], *at).unwrap();
            whole[*at as usize..end].copy_from_slice(&data[..end - *at as usize]);
        }
        // Zeros written as data: copied as a hole.
        f.write_all_at(&vec![0u8; CHUNK], 6 * CHUNK as u64).unwrap();
        f.flush().unwrap();
        f.sync_all().unwrap();
        (path, whole)
    }

    fn blocks(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().blocks()
    }

    #[test]
    fn copies_sparse_files_and_hashes_them_in_one_pass() {
        let dir = tempfile::tempdir().unwrap();
        let (src, whole) = sparse_file(dir.path());
        let dest = dir.path().join("dest.img");
        let mut calls = 0;
        let got = copy_file(&src, &dest, &AtomicBool::new(false), None, &mut |_, _| {
            calls += 1
        })
        .unwrap();
        let expected = hex(&sha2::Sha512::digest(&whole));
        assert_eq!(got.size, whole.len() as u64);
        assert_eq!(got.sha512, expected);
        assert!(calls >= 2);
        assert!(std::fs::read(&dest).unwrap() == whole);
        assert_eq!(sha512_file(&dest).unwrap(), expected);
        assert_eq!(sha512_file(&src).unwrap(), expected);
        // Only the data is allocated: about 3 MiB of 9.
        assert!(
            blocks(&dest) * 512 < 4 * CHUNK as u64,
            "{} blocks",
            blocks(&dest)
        );
        // The destination must be new.
        assert!(copy_file(&src, &dest, &AtomicBool::new(false), None, &mut |_, _| {}).is_err());
        // A stopped copy ends early, as ABORTED.
        let stop = AtomicBool::new(true);
        let err = copy_file(
            &src,
            &dir.path().join("stopped"),
            &stop,
            None,
            &mut |_, _| {},
        )
        .unwrap_err();
        assert!(matches!(err, CsiError::Aborted(_)), "{err}");
    }

    #[test]
    fn a_paced_copy_reads_no_faster_than_its_rate_and_stops_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let (src, whole) = sparse_file(dir.path());
        // About 3 MiB of data (the holes are free) at 6 MiB/s: half a second at least.
        let rate = NonZeroU64::new(6 * CHUNK as u64);
        let started = Instant::now();
        let dest = dir.path().join("paced");
        let got = copy_file(&src, &dest, &AtomicBool::new(false), rate, &mut |_, _| {}).unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(450),
            "{:?}",
            started.elapsed()
        );
        assert!(std::fs::read(&dest).unwrap() == whole);
        assert_eq!(got.sha512, hex(&sha2::Sha512::digest(&whole)));
        // A copy waiting on its rate still stops when asked.
        let stop = Arc::new(AtomicBool::new(false));
        let stopper = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                stop.store(true, Ordering::Relaxed);
            })
        };
        let slow = NonZeroU64::new(1024);
        let started = Instant::now();
        let err = copy_file(&src, &dir.path().join("slow"), &stop, slow, &mut |_, _| {});
        stopper.join().unwrap();
        assert!(matches!(err, Err(CsiError::Aborted(_))), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn empty_and_all_hole_files() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        File::create(&empty).unwrap();
        let got = copy_file(
            &empty,
            &dir.path().join("e2"),
            &AtomicBool::new(false),
            None,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(got.sha512, hex(&sha2::Sha512::digest(b"")));
        let holes = dir.path().join("holes");
        File::create(&holes)
            .unwrap()
            .set_len(3 * CHUNK as u64 + 1)
            .unwrap();
        let got = copy_file(
            &holes,
            &dir.path().join("h2"),
            &AtomicBool::new(false),
            None,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(got.size, 3 * CHUNK as u64 + 1);
        assert_eq!(
            got.sha512,
            hex(&sha2::Sha512::digest(vec![0u8; 3 * CHUNK + 1]))
        );
    }

    #[test]
    fn streams_are_hashed_while_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut data: Vec<u8> = (0..5 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
        data[CHUNK..3 * CHUNK].fill(0);
        let dest = dir.path().join("stream");
        let mut out = HashingWriter::new(File::create(&dest).unwrap());
        let mut seen = Vec::new();
        pump_stream(
            &mut &data[..],
            &mut out,
            &mut |head: &[u8]| {
                seen.extend_from_slice(&head[..4]);
                Ok(())
            },
            &mut |_| {},
        )
        .unwrap();
        let got = out.finish().unwrap();
        assert_eq!(seen, data[..4]);
        assert_eq!(got.sha512, hex(&sha2::Sha512::digest(&data)));
        assert!(std::fs::read(&dest).unwrap() == data);
    }
}
