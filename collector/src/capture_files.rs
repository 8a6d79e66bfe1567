//! Finished captures on disk, so their results outlive a restart of the collector: one file
//! per request (`ID.capture`, a protobuf [`SavedCapture`]) in the `captures` directory of
//! the embedded store, written to a temporary name and renamed, read back at start-up within
//! the same bounds as in memory (size, age).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use prost::Message;
use pyrometer_proto::capture::CaptureStatus;

/// A finished request as kept: whose it is, when it was made, its state and result.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SavedCapture {
    /// The tenant's internal name (empty for the default tenant).
    #[prost(string, tag = "1")]
    pub tenant: String,
    #[prost(uint64, tag = "2")]
    pub created_unix_s: u64,
    /// The request, its state and reason, and its result.
    #[prost(message, optional, tag = "3")]
    pub status: Option<CaptureStatus>,
}

/// Room for a request's fields beside its result in a file.
const MAX_OVERHEAD_BYTES: u64 = 1 << 20;

/// An id the collector made (`SECONDS-N`): nothing else names a file.
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 40 && id.bytes().all(|b| b.is_ascii_digit() || b == b'-')
}

/// The file of request `id` in `dir`, or None for an id the collector did not make.
pub fn path_of(dir: &Path, id: &str) -> Option<PathBuf> {
    valid_id(id).then(|| dir.join(format!("{id}.capture")))
}

/// Writes `saved` as its request's file, whole or not at all.
pub fn save(dir: &Path, saved: &SavedCapture) -> std::io::Result<()> {
    let id = saved
        .status
        .as_ref()
        .and_then(|s| s.request.as_ref())
        .map(|r| r.id.as_str())
        .unwrap_or_default();
    let Some(path) = path_of(dir, id) else {
        return Err(std::io::Error::other(format!(
            "no file for request id '{id}'"
        )));
    };
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{id}.tmp"));
    std::fs::write(&tmp, saved.encode_to_vec())?;
    std::fs::rename(&tmp, &path)
}

/// Deletes request `id`'s file, if it has one.
pub fn remove(dir: &Path, id: &str) {
    if let Some(path) = path_of(dir, id) {
        let _ = std::fs::remove_file(path);
    }
}

/// The captures kept in `dir`, oldest first; files older than `max_age`, unreadable ones or
/// those whose result could exceed `max_result_bytes` are deleted (and reported through
/// `warn`), half-written ones too.
pub fn load(
    dir: &Path,
    max_age: Duration,
    max_result_bytes: usize,
    warn: &mut dyn FnMut(String),
) -> Vec<SavedCapture> {
    let max_file = max_result_bytes as u64 + MAX_OVERHEAD_BYTES;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let oldest = now.saturating_sub(max_age.as_secs());
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        if !name.ends_with(".capture") {
            continue;
        }
        match read(&path, max_file) {
            Ok(saved) if saved.created_unix_s >= oldest => out.push(saved),
            Ok(_) => {
                let _ = std::fs::remove_file(&path);
            }
            Err(why) => {
                warn(format!(
                    "dropping the kept capture {}: {why}",
                    path.display()
                ));
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    out.sort_by_key(|s| s.created_unix_s);
    out
}

fn read(path: &Path, max_file: u64) -> Result<SavedCapture, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() || meta.len() > max_file {
        return Err(format!("not a file of at most {max_file} bytes"));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_file)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    let saved = SavedCapture::decode(&bytes[..]).map_err(|e| e.to_string())?;
    let id_ok = saved
        .status
        .as_ref()
        .and_then(|s| s.request.as_ref())
        .is_some_and(|r| path_of(path.parent().unwrap_or(path), &r.id).as_deref() == Some(path));
    if !id_ok {
        return Err("its request id is not its name".into());
    }
    Ok(saved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyrometer_proto::capture::{CaptureRequest, UploadRequest};

    fn saved(id: &str, created_unix_s: u64) -> SavedCapture {
        SavedCapture {
            tenant: "t".into(),
            created_unix_s,
            status: Some(CaptureStatus {
                request: Some(CaptureRequest {
                    id: id.into(),
                    node: "n".into(),
                    ..Default::default()
                }),
                state: "done".into(),
                result: Some(UploadRequest {
                    id: id.into(),
                    pprof: vec![1, 2, 3],
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
    }

    /// What is saved loads back, oldest first; stale, foreign and half-written files go.
    #[test]
    fn saved_captures_load_back_within_their_age() {
        let dir = std::env::temp_dir().join(format!("pyro-capfiles-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        save(&dir, &saved("200-2", now)).unwrap();
        save(&dir, &saved("100-1", now - 10)).unwrap();
        save(&dir, &saved("50-1", now - 7200)).unwrap();
        std::fs::write(dir.join("9-9.tmp"), b"half").unwrap();
        std::fs::write(dir.join("1-1.capture"), b"\xff\xff not protobuf").unwrap();
        assert!(path_of(&dir, "../x").is_none());
        let mut warned = Vec::new();
        let got = load(&dir, Duration::from_secs(3600), 1 << 20, &mut |w| {
            warned.push(w)
        });
        let ids: Vec<&str> = got
            .iter()
            .map(|s| {
                s.status
                    .as_ref()
                    .unwrap()
                    .request
                    .as_ref()
                    .unwrap()
                    .id
                    .as_str()
            })
            .collect();
        assert_eq!(ids, vec!["100-1", "200-2"]);
        assert_eq!(warned.len(), 1, "{warned:?}");
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
        remove(&dir, "100-1");
        assert_eq!(
            load(&dir, Duration::from_secs(3600), 1 << 20, &mut |_| {}).len(),
            1
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
