//! A reader following the journal: polls the bell, and when it rang, reads every publisher's
//! segments from where it left off and names the objects they mention.
//!
//! The follower never decides what is ready: it only says which ids to look at again (the
//! reader's own rules judge them), or that it lost track ([`Heard::gap`]: a segment gone
//! before it was read, a journal replaced), after which the reader scans the whole remote.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::bell::{BellReader, Ring};
use super::record::Body;
use super::segment::{self, Chunk};
use crate::report::Kind;

/// A ring is followed by a read of every publisher's segments at least this often, even
/// when it names nothing new.
const LOOK_AT_ALL: Duration = Duration::from_secs(30);

/// Ids a journal named since the last poll.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Named {
    pub layers: BTreeSet<String>,
    pub images: BTreeSet<String>,
}

impl Named {
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty() && self.images.is_empty()
    }

    pub fn extend(&mut self, other: Named) {
        self.layers.extend(other.layers);
        self.images.extend(other.images);
    }

    pub fn len(&self) -> usize {
        self.layers.len() + self.images.len()
    }
}

/// What one poll heard.
#[derive(Debug, Default)]
pub struct Heard {
    /// There is no bell: nobody publishes into this remote (yet).
    pub absent: bool,
    pub named: Named,
    /// The follower lost track of some records: the reader must scan everything once.
    pub gap: Option<String>,
    /// Lines skipped because they were not whole records.
    pub torn: usize,
    /// The last ring, if the bell held one.
    pub ring: Option<Ring>,
}

/// Where the follower is in one publisher's journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    generation: u64,
    offset: u64,
}

/// Follows the journal of one remote.
pub struct Follower {
    dir: PathBuf,
    bell: BellReader,
    last: Option<Vec<u8>>,
    last_change: Instant,
    positions: BTreeMap<String, Position>,
    /// When every publisher's segments were last read.
    caught_up: Instant,
    /// What rings said a publisher's segment holds, until the follower has read that far
    /// (a file's new end can reach a reader after the ring does).
    owed: BTreeMap<String, Position>,
}

impl Follower {
    pub fn new(remote: &Path) -> Follower {
        let dir = super::dir_of(remote);
        Follower {
            bell: BellReader::new(&dir.join(super::BELL)),
            dir,
            last: None,
            last_change: Instant::now(),
            caught_up: Instant::now(),
            positions: BTreeMap::new(),
            owed: BTreeMap::new(),
        }
    }

    /// How long the bell has not changed.
    pub fn quiet_for(&self) -> Duration {
        self.last_change.elapsed()
    }

    /// Reads the bell, and the segments if it rang (or if a ring is still owed).
    pub fn poll(&mut self) -> io::Result<Heard> {
        let quiet = self.last_change.elapsed() > super::HEARTBEAT + Duration::from_secs(5);
        let Some(bytes) = self.bell.read(quiet)? else {
            self.last = None;
            return Ok(Heard {
                absent: true,
                ..Heard::default()
            });
        };
        let mut heard = Heard {
            ring: Ring::decode(&bytes),
            ..Heard::default()
        };
        let first = self.last.is_none();
        let rang = self.last.as_deref() != Some(&bytes[..]);
        if rang {
            self.last_change = Instant::now();
            self.last = Some(bytes);
        }
        if first {
            // Where every publisher is now; what came before is the first scan's business.
            self.skip_to_ends()?;
            heard.gap = Some("started following the journal".into());
            return Ok(heard);
        }
        // A ring says how far its publisher's journal goes: one the follower has read that
        // far (a heartbeat) needs no reading, unless it hides another publisher's ring that
        // came just before, which the next ring of that one names (at most a heartbeat
        // later), or the periodic look at all of them finds.
        let news = match &heard.ring {
            Some(ring) if rang => {
                let at = Position {
                    generation: ring.generation,
                    offset: ring.length,
                };
                let read = self.positions.get(&ring.publisher).copied();
                let behind =
                    read.is_none_or(|r| (r.generation, r.offset) < (at.generation, at.offset));
                if behind {
                    self.owed.insert(ring.publisher.clone(), at);
                }
                behind
            }
            // A garbled ring: who knows what it said.
            None => rang,
            Some(_) => false,
        };
        let due = rang && self.caught_up.elapsed() >= LOOK_AT_ALL;
        if news || due || !self.owed.is_empty() {
            self.catch_up(&mut heard)?;
            self.caught_up = Instant::now();
        }
        Ok(heard)
    }

    /// Sets every publisher's position to the end of its newest segment.
    fn skip_to_ends(&mut self) -> io::Result<()> {
        self.positions.clear();
        self.owed.clear();
        for (publisher, generations) in self.segments()? {
            let Some(&generation) = generations.last() else {
                continue;
            };
            let path = self.dir.join(segment::file_name(&publisher, generation));
            // Whole lines only: a torn tail is skipped by the next read of it.
            let mut offset = 0;
            loop {
                let next = match segment::read_from(&path, offset) {
                    Ok(chunk) => chunk.next,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) => return Err(e),
                };
                if next == offset {
                    break;
                }
                offset = next;
            }
            self.positions
                .insert(publisher, Position { generation, offset });
        }
        Ok(())
    }

    /// The segments in the journal directory: per publisher, the generations, oldest first.
    fn segments(&self) -> io::Result<BTreeMap<String, Vec<u64>>> {
        let mut found: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(found),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let Some((publisher, generation)) = name.to_str().and_then(segment::parse_file_name)
            else {
                continue;
            };
            found
                .entry(publisher.to_owned())
                .or_default()
                .push(generation);
        }
        for generations in found.values_mut() {
            generations.sort_unstable();
        }
        Ok(found)
    }

    /// Reads every publisher's segments from where the follower left off.
    fn catch_up(&mut self, heard: &mut Heard) -> io::Result<()> {
        let segments = self.segments()?;
        for (publisher, generations) in &segments {
            let start = match self.positions.get(publisher) {
                Some(p) => *p,
                // A publisher that began after the follower did: all of it is news.
                None => Position {
                    generation: generations[0],
                    offset: 0,
                },
            };
            let end = self.read_publisher(publisher, generations, start, heard)?;
            self.positions.insert(publisher.clone(), end);
        }
        // A publisher whose segments all went (its journal removed): nothing more to read.
        self.positions.retain(|p, _| segments.contains_key(p));
        let positions = &self.positions;
        self.owed.retain(|publisher, owed| {
            positions
                .get(publisher)
                .is_some_and(|p| (p.generation, p.offset) < (owed.generation, owed.offset))
        });
        Ok(())
    }

    /// Reads one publisher's segments from `start` on; returns where it got to.
    fn read_publisher(
        &self,
        publisher: &str,
        generations: &[u64],
        start: Position,
        heard: &mut Heard,
    ) -> io::Result<Position> {
        let mut at = start;
        if !generations.contains(&at.generation) {
            if generations.iter().all(|g| *g < at.generation) {
                // Its newest segment is older than where the follower was: the journal
                // was replaced.
                heard.gap = Some(format!("journal of {publisher} went back in time"));
                let generation = *generations.last().expect("listed publishers have segments");
                return Ok(Position {
                    generation,
                    offset: 0,
                });
            }
            heard.gap = Some(format!(
                "segment {:016x} of {publisher} was removed before it was read",
                at.generation
            ));
            at = Position {
                generation: *generations
                    .iter()
                    .find(|g| **g > at.generation)
                    .expect("a newer generation exists"),
                offset: 0,
            };
        }
        loop {
            let path = self.dir.join(segment::file_name(publisher, at.generation));
            let chunk = match segment::read_from(&path, at.offset) {
                Ok(chunk) => chunk,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    heard.gap = Some(format!("{} vanished while being read", path.display()));
                    return Ok(at);
                }
                Err(e) => return Err(e),
            };
            let sealed = take(chunk, heard, &mut at);
            match sealed {
                Some(next) if generations.contains(&next) || next > at.generation => {
                    at = Position {
                        generation: next,
                        offset: 0,
                    };
                }
                _ => break,
            }
            if !generations.contains(&at.generation) {
                // Sealed, but its successor was not in the listing yet: read it next time.
                break;
            }
        }
        // Later segments without a seal before them (a publisher restarted): read them all.
        let reached = at.generation;
        for &generation in generations.iter().filter(|g| **g > reached) {
            let path = self.dir.join(segment::file_name(publisher, generation));
            let chunk = segment::read_from(&path, 0)?;
            at = Position {
                generation,
                offset: 0,
            };
            take(chunk, heard, &mut at);
        }
        Ok(at)
    }
}

/// Adds a chunk's records to `heard` and moves `at` past them; the generation a seal names.
fn take(chunk: Chunk, heard: &mut Heard, at: &mut Position) -> Option<u64> {
    heard.torn += chunk.torn;
    at.offset = chunk.next;
    let mut sealed = None;
    for record in chunk.records {
        match record.body {
            Body::Object { kind, id, .. } => {
                match kind {
                    Kind::Layer => heard.named.layers.insert(id),
                    Kind::Image => heard.named.images.insert(id),
                };
            }
            Body::Sealed { next } => sealed = Some(next),
        }
    }
    sealed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::bell::{self, Ring};
    use crate::journal::record::Event;
    use crate::journal::segment::Writer;

    fn image(n: u8) -> Body {
        Body::Object {
            event: Event::Ready,
            kind: Kind::Image,
            id: format!("{n:064x}"),
        }
    }

    fn ring_for(dir: &Path, writer: &Writer, token: u64) {
        let (generation, length) = writer.position();
        let ring = Ring {
            publisher: writer.publisher().to_owned(),
            generation,
            length,
            token,
            unix_ms: 0,
        };
        bell::ring(&dir.join(crate::journal::BELL), &ring).unwrap();
    }

    fn images(heard: &Heard) -> Vec<String> {
        heard.named.images.iter().cloned().collect()
    }

    #[test]
    fn a_follower_hears_what_publishers_append_after_it_started() {
        let remote = tempfile::tempdir().unwrap();
        let dir = crate::journal::dir_of(remote.path());
        std::fs::create_dir(&dir).unwrap();
        let mut follower = Follower::new(remote.path());
        assert!(follower.poll().unwrap().absent);

        let mut a = Writer::begin(&dir, "a", 1 << 20).unwrap();
        a.append(vec![image(1)]).unwrap();
        ring_for(&dir, &a, 1);
        let heard = follower.poll().unwrap();
        assert!(heard.gap.is_some(), "the first poll asks for a scan");
        assert!(heard.named.is_empty(), "what came before is the scan's");

        a.append(vec![image(2)]).unwrap();
        ring_for(&dir, &a, 2);
        assert_eq!(
            images(&follower.poll().unwrap()),
            vec![format!("{:064x}", 2)]
        );
        assert!(follower.poll().unwrap().named.is_empty(), "nothing rang");

        // A second publisher rings, and its ring is overwritten by the first's: both are
        // heard.
        let mut b = Writer::begin(&dir, "b", 1 << 20).unwrap();
        b.append(vec![image(3)]).unwrap();
        ring_for(&dir, &b, 3);
        a.append(vec![image(4)]).unwrap();
        ring_for(&dir, &a, 4);
        let heard = follower.poll().unwrap();
        assert_eq!(
            images(&heard),
            vec![format!("{:064x}", 3), format!("{:064x}", 4)]
        );
        assert!(heard.gap.is_none());
    }

    #[test]
    fn rotation_is_followed_and_a_lost_segment_is_a_gap() {
        let remote = tempfile::tempdir().unwrap();
        let dir = crate::journal::dir_of(remote.path());
        std::fs::create_dir(&dir).unwrap();
        let mut a = Writer::begin(&dir, "a", 400).unwrap();
        ring_for(&dir, &a, 0);
        let mut follower = Follower::new(remote.path());
        follower.poll().unwrap();
        for n in 0..6 {
            a.append(vec![image(n)]).unwrap();
        }
        ring_for(&dir, &a, 1);
        let heard = follower.poll().unwrap();
        assert_eq!(heard.named.images.len(), 6, "{heard:?}");
        assert!(heard.gap.is_none(), "{heard:?}");

        // The follower falls behind by more than two segments.
        for n in 10..40 {
            a.append(vec![image(n)]).unwrap();
        }
        ring_for(&dir, &a, 2);
        let heard = follower.poll().unwrap();
        assert!(heard.gap.is_some(), "{heard:?}");
        a.append(vec![image(50)]).unwrap();
        ring_for(&dir, &a, 3);
        let heard = follower.poll().unwrap();
        assert!(heard.gap.is_none(), "back on track: {heard:?}");
        assert!(heard.named.images.contains(&format!("{:064x}", 50)));
    }
}
