//! The agent's on-disk spool: every batch is written here before it is pushed, and deleted
//! only when the collector acknowledged it, so an unreachable collector or an agent restart
//! loses nothing. The spool is bounded: when a new batch does not fit, the oldest batches
//! are deleted (and counted) first, because recent profiles are worth more than old ones.
//!
//! Layout: `SEQ-SAMPLES.batch` per batch (the sample count in the name lets the agent count
//! what it pushed or dropped without decoding), `agent-id`, and `next-seq`. Files are written
//! to a temporary name and renamed, so a crash never leaves a half-written batch.

use std::collections::VecDeque;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("spool {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a batch of {size} bytes is larger than the whole spool ({max} bytes)")]
    TooLarge { size: u64, max: u64 },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub samples: u64,
    pub bytes: u64,
}

/// What [`Spool::add`] had to delete to make room.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub batches: u64,
    pub samples: u64,
}

pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    entries: VecDeque<Entry>,
    /// The batch being pushed: never dropped for room, so an acknowledgement always finds it.
    in_flight: Option<u64>,
    agent_id: String,
    next_seq: u64,
}

impl Spool {
    /// Opens or creates the spool; a new spool gets an agent id starting with `node`.
    pub fn open(dir: &Path, max_bytes: u64, node: &str) -> Result<Spool, SpoolError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let mut entries = Vec::new();
        for item in fs::read_dir(dir).map_err(io(dir))? {
            let item = item.map_err(io(dir))?;
            let name = item.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                let _ = fs::remove_file(item.path());
                continue;
            }
            let Some(stem) = name.strip_suffix(".batch") else {
                continue;
            };
            let Some((seq, samples)) = stem.split_once('-') else {
                continue;
            };
            if let (Ok(seq), Ok(samples)) = (seq.parse(), samples.parse()) {
                let bytes = item.metadata().map_err(io(dir))?.len();
                entries.push(Entry {
                    seq,
                    samples,
                    bytes,
                });
            }
        }
        entries.sort_by_key(|e| e.seq);
        let id_path = dir.join("agent-id");
        let agent_id = match fs::read_to_string(&id_path) {
            Ok(id) if !id.trim().is_empty() => id.trim().to_string(),
            _ => {
                let id = format!("{node}-{:016x}", random_u64());
                write_atomic(dir, "agent-id", id.as_bytes())?;
                id
            }
        };
        let stored_next = fs::read_to_string(dir.join("next-seq"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(1);
        let next_seq = stored_next.max(entries.last().map_or(1, |e| e.seq + 1));
        Ok(Spool {
            dir: dir.to_path_buf(),
            max_bytes,
            entries: entries.into(),
            in_flight: None,
            agent_id,
            next_seq,
        })
    }

    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// Reserves the next sequence number (persisted, so a restart never reuses one).
    pub fn next_seq(&mut self) -> Result<u64, SpoolError> {
        let seq = self.next_seq;
        self.next_seq += 1;
        write_atomic(&self.dir, "next-seq", self.next_seq.to_string().as_bytes())?;
        Ok(seq)
    }

    fn path(&self, e: &Entry) -> PathBuf {
        self.dir.join(format!("{:020}-{}.batch", e.seq, e.samples))
    }

    /// Stores a batch, first deleting the oldest ones if it would not fit.
    pub fn add(&mut self, seq: u64, samples: u64, body: &[u8]) -> Result<Dropped, SpoolError> {
        let size = body.len() as u64;
        if size > self.max_bytes {
            return Err(SpoolError::TooLarge {
                size,
                max: self.max_bytes,
            });
        }
        let mut dropped = Dropped::default();
        while self.size_bytes() + size > self.max_bytes {
            let Some(pos) = self
                .entries
                .iter()
                .position(|e| Some(e.seq) != self.in_flight)
            else {
                break;
            };
            let e = self.entries.remove(pos).expect("position is in range");
            let _ = fs::remove_file(self.path(&e));
            dropped.batches += 1;
            dropped.samples += e.samples;
        }
        let entry = Entry {
            seq,
            samples,
            bytes: size,
        };
        let name = self.path(&entry);
        let name = name.file_name().expect("has a name").to_string_lossy();
        write_atomic(&self.dir, &name, body)?;
        self.entries.push_back(entry);
        Ok(dropped)
    }

    /// The oldest batch and its bytes, marked in flight until [`Spool::acknowledged`] or
    /// [`Spool::release`].
    pub fn take_oldest(&mut self) -> Result<Option<(Entry, Vec<u8>)>, SpoolError> {
        let Some(e) = self.entries.front().copied() else {
            return Ok(None);
        };
        let path = self.path(&e);
        let mut body = Vec::with_capacity(e.bytes as usize);
        match fs::File::open(&path).and_then(|mut f| f.read_to_end(&mut body)) {
            Ok(_) => {
                self.in_flight = Some(e.seq);
                Ok(Some((e, body)))
            }
            Err(err) => {
                // Someone removed the file: forget it rather than retrying forever.
                self.entries.pop_front();
                Err(io(&path)(err))
            }
        }
    }

    /// The collector acknowledged `seq`: it leaves the spool.
    pub fn acknowledged(&mut self, seq: u64) -> Result<(), SpoolError> {
        self.in_flight = None;
        if let Some(pos) = self.entries.iter().position(|e| e.seq == seq) {
            let e = self.entries.remove(pos).expect("position is in range");
            let path = self.path(&e);
            fs::remove_file(&path).map_err(io(&path))?;
        }
        Ok(())
    }

    /// The push failed: the batch stays for the next try.
    pub fn release(&mut self) {
        self.in_flight = None;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn size_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn samples(&self) -> u64 {
        self.entries.iter().map(|e| e.samples).sum()
    }
}

fn write_atomic(dir: &Path, name: &str, body: &[u8]) -> Result<(), SpoolError> {
    let tmp = dir.join(format!(".tmp-{name}"));
    let dest = dir.join(name);
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(body).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    fs::rename(&tmp, &dest).map_err(io(&dest))
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ u64::from(std::process::id()).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pyrometer-spool-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn replays_in_order_across_reopen() {
        let d = dir("order");
        let mut s = Spool::open(&d, 1000, "n1").unwrap();
        let id = s.agent_id().to_string();
        assert!(id.starts_with("n1-"));
        for i in 0..3 {
            let seq = s.next_seq().unwrap();
            s.add(seq, 10 + i, &[i as u8; 10]).unwrap();
        }
        let (e, body) = s.take_oldest().unwrap().unwrap();
        assert_eq!((e.seq, e.samples, body), (1, 10, vec![0; 10]));
        // Not acknowledged: still there after a restart, and sequence numbers go on.
        drop(s);
        let mut s = Spool::open(&d, 1000, "other").unwrap();
        assert_eq!(s.agent_id(), id);
        assert_eq!(s.len(), 3);
        assert_eq!(s.next_seq().unwrap(), 4);
        let (e, _) = s.take_oldest().unwrap().unwrap();
        s.acknowledged(e.seq).unwrap();
        let (e, _) = s.take_oldest().unwrap().unwrap();
        assert_eq!(e.seq, 2);
        s.release();
        assert_eq!(s.samples(), 11 + 12);
    }

    #[test]
    fn full_spool_drops_oldest_but_not_in_flight() {
        let d = dir("full");
        let mut s = Spool::open(&d, 30, "n").unwrap();
        for seq in 1..=3 {
            s.add(seq, seq, &[0; 10]).unwrap();
        }
        let (e, _) = s.take_oldest().unwrap().unwrap();
        assert_eq!(e.seq, 1);
        let dropped = s.add(4, 4, &[0; 10]).unwrap();
        // 1 is in flight, so 2 goes.
        assert_eq!(
            dropped,
            Dropped {
                batches: 1,
                samples: 2
            }
        );
        s.acknowledged(1).unwrap();
        let seqs: Vec<u64> = s.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![3, 4]);
        assert!(matches!(
            s.add(5, 1, &[0; 31]),
            Err(SpoolError::TooLarge { .. })
        ));
        assert_eq!(Spool::open(&d, 30, "n").unwrap().len(), 2);
    }
}
