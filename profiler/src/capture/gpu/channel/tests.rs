use super::*;
use crate::capture::gpu::testenc::{Enc, kernel, launch};

#[test]
fn records_read_back() {
    let mut e = Enc::default();
    let k = kernel(7, 3, 2, 1000, 5000);
    e.string(3, 1, "_Z6matmulPfS_")
        .device(0, [1; 16])
        .kernel(&k)
        .launch(&launch(7, 42, 64, 0))
        .alias(8, 7)
        .clock(10, 20);
    let c = parse(&e.chunk(5)).unwrap();
    assert_eq!(c.seq, 5);
    assert_eq!(
        c.records,
        vec![
            Record::String {
                id: 3,
                kind: StringKind::Kernel,
                cut: false,
                text: "_Z6matmulPfS_".into()
            },
            Record::Device {
                device: 0,
                uuid: [1; 16]
            },
            Record::Kernel(k),
            Record::Launch(launch(7, 42, 64, 0)),
            Record::Alias { from: 8, to: 7 },
            Record::Clock {
                cupti: 10,
                monotonic: 20
            },
        ]
    );
}

#[test]
fn unknown_types_are_skipped_by_length() {
    let mut e = Enc::default();
    e.raw(&[99, 0, 16, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
        .alias(1, 2);
    let c = parse(&e.chunk(0)).unwrap();
    assert_eq!(
        c.records,
        vec![Record::Unknown(99), Record::Alias { from: 1, to: 2 }]
    );
}

#[test]
fn broken_headers_are_refused() {
    let mut e = Enc::default();
    e.alias(1, 2);
    let good = e.chunk(0);
    let mut bad = good.clone();
    bad[0] ^= 1;
    assert!(matches!(parse(&bad), Err(ChunkError::Magic(_))));
    let mut bad = good.clone();
    bad[4] = 2;
    assert_eq!(parse(&bad), Err(ChunkError::Version(2)));
    let mut bad = good.clone();
    bad[12] += 8;
    assert!(matches!(parse(&bad), Err(ChunkError::Length { .. })));
    assert_eq!(parse(&good[..10]), Err(ChunkError::Size(10)));
    assert_eq!(parse(&vec![0; 5000]), Err(ChunkError::Size(5000)));
}

#[test]
fn record_lengths_are_checked() {
    for (len, want_short) in [
        (0u16, false),
        (4, false),
        (12, false),
        (8, true),
        (4000, false),
    ] {
        let mut e = Enc::default();
        let mut r = vec![4, 0];
        r.extend_from_slice(&len.to_le_bytes());
        r.resize(16, 0);
        e.raw(&r);
        let err = parse(&e.chunk(0)).unwrap_err();
        if want_short {
            assert!(matches!(err, ChunkError::Short { need: 72, .. }), "{err}");
        } else {
            assert!(
                matches!(err, ChunkError::RecordLength { .. }),
                "{len}: {err}"
            );
        }
    }
}

#[test]
fn strings_must_fit_their_record() {
    let mut e = Enc::default();
    e.string(5, 2, "forward");
    let mut c = e.chunk(0);
    // The text's length grows past its record.
    c[16 + 12] = 200;
    assert!(matches!(parse(&c), Err(ChunkError::String { .. })));
    let mut e = Enc::default();
    e.string(0, 2, "x");
    assert!(matches!(parse(&e.chunk(0)), Err(ChunkError::String { .. })));
}

#[test]
fn arbitrary_bytes_never_panic() {
    // Random chunks, and valid chunks with random bytes flipped: refused or read, never a panic.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut e = Enc::default();
    e.string(3, 1, "kernel")
        .kernel(&kernel(1, 3, 0, 1, 2))
        .launch(&launch(1, 2, 3, 0));
    let valid = e.chunk(0);
    for round in 0..20_000 {
        let mut b = if round % 2 == 0 {
            valid.clone()
        } else {
            let len = (next() % 300) as usize;
            let mut v: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if v.len() >= 16 {
                v[..4].copy_from_slice(&MAGIC.to_le_bytes());
                v[4..6].copy_from_slice(&VERSION.to_le_bytes());
                v[6..8].copy_from_slice(&16u16.to_le_bytes());
                v[12..16].copy_from_slice(&(len as u32).to_le_bytes());
            }
            v
        };
        let flips = next() % 4;
        for _ in 0..flips {
            if !b.is_empty() {
                let i = (next() as usize) % b.len();
                b[i] = next() as u8;
            }
        }
        let _ = parse(&b);
        let _ = split_dump(&b);
    }
}

#[test]
fn dumps_split_into_chunks() {
    let mut e = Enc::default();
    let mut dump = e.alias(1, 2).chunk(0);
    dump.extend(e.alias(3, 4).chunk(1));
    let (chunks, err) = split_dump(&dump);
    assert_eq!(chunks.len(), 2);
    assert!(err.is_none());
    let (chunks, err) = split_dump(&dump[..dump.len() - 3]);
    assert_eq!(chunks.len(), 1);
    assert!(err.is_some());
}

#[test]
fn uuids_read_as_nvml_writes_them() {
    let uuid = [
        0x7e, 0x57, 0xd0, 0xb1, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 1,
    ];
    assert_eq!(
        uuid_string(&uuid),
        "GPU-7e57d0b1-0000-4000-8000-000000000001"
    );
}
