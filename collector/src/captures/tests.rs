//! The request table's unit tests: routing, bounds, expiry, several nodes, files.

use super::*;

fn request(node: &str, pid: u32) -> CaptureRequest {
    CaptureRequest {
        node: node.into(),
        pids: vec![pid],
        duration_ms: 1000,
        frequency_hz: 99,
        ..Default::default()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A request reaches its node's agent only, runs once, and ends with the upload; the
/// other tenant neither sees nor answers it.
#[test]
fn a_request_goes_to_its_node_and_ends_with_the_upload() {
    let rt = rt();
    let c = Captures::default();
    rt.block_on(c.poll("", "b", Duration::ZERO));
    rt.block_on(c.poll("", "a", Duration::ZERO));
    let id = c.create("", request("b", 42)).unwrap();
    assert!(rt.block_on(c.poll("", "a", Duration::ZERO)).is_empty());
    assert!(rt.block_on(c.poll("other", "b", Duration::ZERO)).is_empty());
    let got = rt.block_on(c.poll("", "b", Duration::ZERO));
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].id.as_str(), got[0].pids.as_slice()),
        (id.as_str(), &[42][..])
    );
    assert!(
        rt.block_on(c.poll("", "b", Duration::ZERO)).is_empty(),
        "taken once"
    );
    assert_eq!(c.summary("", &id).unwrap().state, "running");
    assert!(c.summary("other", &id).is_none());
    let upload = UploadRequest {
        id: id.clone(),
        node: "b".into(),
        pprof: vec![1, 2, 3],
        samples: 7,
        ..Default::default()
    };
    assert!(c.upload("other", upload.clone()).is_err());
    assert!(
        c.upload(
            "",
            UploadRequest {
                node: "a".into(),
                ..upload.clone()
            }
        )
        .is_err(),
        "another node's agent cannot answer it"
    );
    c.upload("", upload.clone()).unwrap();
    assert_eq!(c.summary("", &id).unwrap().state, "done");
    assert_eq!(c.result("", &id, false), Some(vec![1, 2, 3]));
    assert!(c.upload("", upload).is_err(), "answered once");
}

/// A waiting poll is answered as soon as a request comes, not at its end.
#[test]
fn a_waiting_poll_is_answered_at_once() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = std::sync::Arc::new(Captures::default());
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let poller = c.clone();
    let started = Instant::now();
    let polled = rt.spawn(async move { poller.poll("", "b", Duration::from_secs(10)).await });
    std::thread::sleep(Duration::from_millis(100));
    c.create("", request("b", 1)).unwrap();
    let got = rt.block_on(polled).unwrap();
    assert_eq!(got.len(), 1);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// Bad requests, unknown nodes and busy nodes are refused with their reason.
#[test]
fn requests_are_bounded_and_refused_with_a_reason() {
    let rt = rt();
    let c = Captures::default();
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let err = |r| c.create("", r).unwrap_err();
    assert!(matches!(err(request("z", 1)), CaptureError::NotFound(m) if m.contains("'z'")));
    assert!(matches!(
        err(CaptureRequest { duration_ms: 61_000, ..request("b", 1) }),
        CaptureError::Input(m) if m.contains("60 s")
    ));
    assert!(matches!(
        err(CaptureRequest { frequency_hz: 1000, ..request("b", 1) }),
        CaptureError::Input(m) if m.contains("999")
    ));
    assert!(matches!(err(request("b", 0)), CaptureError::Input(_)));
    c.create("", request("b", 1)).unwrap();
    assert!(matches!(err(request("b", 2)), CaptureError::Busy(m) if m.contains("at most 1")));
    // A dump is not a capture: it passes beside one.
    let dump = CaptureRequest {
        kind: Kind::Dump as i32,
        duration_ms: 0,
        ..request("b", 2)
    };
    c.create("", dump).unwrap();
}

/// A request its agent never takes fails as offline.
#[test]
fn a_request_not_taken_fails_as_offline() {
    let rt = rt();
    let c = Captures::default();
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let id = c.create("", request("b", 1)).unwrap();
    let mut inner = c.inner.lock().unwrap();
    inner.expire(Instant::now() + TAKE_WITHIN + Duration::from_secs(1));
    let e = &inner.entries[&id];
    assert_eq!((e.state, e.failure), (State::Failed, Failure::Offline));
    assert!(e.reason.contains("offline"), "{}", e.reason);
}

/// A request for several nodes makes one per node, all or none: a node without an agent,
/// or one busy already, refuses the whole request.
#[test]
fn a_request_for_several_nodes_makes_one_per_node_or_none() {
    let rt = rt();
    let c = Captures::default();
    rt.block_on(c.poll("", "a", Duration::ZERO));
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let targets = |nodes: &[&str]| -> Vec<(String, Vec<u32>)> {
        nodes.iter().map(|n| (n.to_string(), vec![7, 8])).collect()
    };
    let r = request("", 1);
    let err = c
        .create_many("", r.clone(), targets(&["a", "z"]))
        .unwrap_err();
    assert!(matches!(err, CaptureError::NotFound(m) if m.contains("'z'")));
    assert!(c.list("").is_empty(), "none made");
    let ids = c.create_many("", r.clone(), targets(&["a", "b"])).unwrap();
    assert_eq!(ids.len(), 2);
    let made: Vec<(String, Vec<u32>)> = ids
        .iter()
        .map(|id| {
            let s = c.summary("", id).unwrap();
            (s.node, s.pids)
        })
        .collect();
    assert_eq!(made, targets(&["a", "b"]));
    assert_eq!(rt.block_on(c.poll("", "a", Duration::ZERO)).len(), 1);
    assert_eq!(rt.block_on(c.poll("", "b", Duration::ZERO)).len(), 1);
    let err = c.create_many("", r, targets(&["a"])).unwrap_err();
    assert!(matches!(err, CaptureError::Busy(_)), "{err:?}");
}

/// Finished captures written to the directory come back in a new table over it, with
/// their results, and new ids do not reuse theirs; a dropped one loses its file.
#[test]
fn finished_captures_outlive_the_table() {
    let dir = std::env::temp_dir().join(format!("pyro-captures-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rt = rt();
    let week = Duration::from_secs(7 * 86_400);
    let c = Captures::persistent(dir.clone(), week, &mut |w| panic!("{w}"));
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let id = c.create("", request("b", 42)).unwrap();
    rt.block_on(c.poll("", "b", Duration::ZERO));
    c.upload(
        "",
        UploadRequest {
            id: id.clone(),
            node: "b".into(),
            pprof: vec![4, 5, 6],
            samples: 9,
            ..Default::default()
        },
    )
    .unwrap();
    c.save(&id).unwrap();
    drop(c);
    let c = Captures::persistent(dir.clone(), week, &mut |w| panic!("{w}"));
    let s = c.summary("", &id).expect("kept");
    assert_eq!((s.state, s.samples, s.pids), ("done", Some(9), vec![42]));
    assert_eq!(c.result("", &id, false), Some(vec![4, 5, 6]));
    assert!(c.summary("other", &id).is_none(), "still the tenant's own");
    rt.block_on(c.poll("", "b", Duration::ZERO));
    let next = c.create("", request("b", 43)).unwrap();
    assert_ne!(next, id);
    c.inner.lock().unwrap().drop_entry(&id);
    assert!(!capture_files::path_of(&dir, &id).unwrap().exists());
    let _ = std::fs::remove_dir_all(&dir);
}
