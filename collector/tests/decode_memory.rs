//! A counting global allocator shows that decoding a push never holds more than 64 times the
//! push's size: valid pushes of several shapes (a thousand to twelve thousand stacks of long
//! names, a label set per sample), every hostile push of the adversarial suite, and two
//! thousand random mutations. Peak bytes live during `ingest::decode` are measured above what
//! was live before it, whether the push is decoded or refused.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use common::hostile::{self, Pb, Profile, Rng};
use pyrometer_collector::ingest::{Context, Limits, decode};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        // SAFETY: allocated above with this layout.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // Counted as a new block and the old freed after, as the peak of a moving realloc.
        let live = LIVE.fetch_add(new, Relaxed) + new;
        PEAK.fetch_max(live, Relaxed);
        // SAFETY: as in alloc and dealloc.
        let q = unsafe { System.realloc(p, l, new) };
        LIVE.fetch_sub(l.size(), Relaxed);
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const NOW: i64 = 1_900_000_000;
const FACTOR: usize = 64;

/// Peak bytes live while `bytes` is decoded, above what was live before.
fn peak(bytes: &[u8]) -> (usize, bool) {
    let limits = Limits::default();
    let ctx = Context::new(&limits, NOW);
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let ok = decode(bytes, &ctx).is_ok();
    (PEAK.load(Relaxed).saturating_sub(base), ok)
}

/// `rows` stacks of `depth` frames over names of `name_len` bytes, one label set per
/// `per_label_set` samples.
fn agent_like(
    rows: usize,
    depth: usize,
    name_len: usize,
    per_label_set: usize,
    seed: u64,
) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut p = Profile::new();
    p.sample_type("samples", "count")
        .sample_type("cpu", "nanoseconds");
    let names: Vec<String> = (0..800)
        .map(|i| format!("{}::fn_{i}_{seed}", "n".repeat(name_len.saturating_sub(12))))
        .collect();
    for (i, name) in names.iter().enumerate() {
        p.function(i as u64 + 1, name);
        p.location(i as u64 + 1, i as u64 + 1, 1);
    }
    let (k, comm, t) = (p.s("comm"), p.s("app"), p.s("thread"));
    for r in 0..rows {
        let stack: Vec<u64> = (0..depth).map(|_| 1 + rng.below(800)).collect();
        let thread = p.s_new(format!("t{}", r / per_label_set.max(1)));
        p.sample(&stack, &[3, 30_000_000], &[(k, comm), (t, thread)]);
    }
    hostile::push("agent", 1, "node-1", &p.finish(NOW))
}

#[test]
fn decoding_holds_at_most_64_times_the_push() {
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        ("100 stacks".into(), agent_like(100, 30, 46, 50, 1)),
        ("2000 stacks".into(), agent_like(2000, 30, 46, 50, 2)),
        (
            "12000 stacks of 40".into(),
            agent_like(12_000, 40, 46, 50, 3),
        ),
        (
            "2000 stacks of long names".into(),
            agent_like(2000, 30, 160, 50, 4),
        ),
        (
            "a label set per sample".into(),
            agent_like(5000, 10, 46, 1, 5),
        ),
        (
            "empty samples, many types".into(),
            hostile::empty_samples_many_types(NOW),
        ),
        ("empty samples".into(), hostile::empty_samples(200_000, NOW)),
        (
            "41 KB of inlined lines".into(),
            hostile::inlined(10_000, 1000, 1, NOW),
        ),
        (
            "404 KB of inlined lines".into(),
            hostile::inlined(100_000, 1000, 2, NOW),
        ),
        (
            "distinct deep stacks".into(),
            hostile::deep_distinct(20_000, 4000, NOW),
        ),
        ("huge values".into(), hostile::huge_values(3, NOW)),
        ("100 labels".into(), hostile::wide_labels(100, 1, 4, NOW)),
        ("long labels".into(), hostile::wide_labels(1, 2000, 5, NOW)),
        (
            "a million strings".into(),
            hostile::many("strings", 1_000_001, NOW),
        ),
        ("functions".into(), hostile::many("functions", 400_000, NOW)),
        ("locations".into(), hostile::many("locations", 400_000, NOW)),
        ("mappings".into(), hostile::many("mappings", 10_000, NOW)),
        (
            "a label value per sample".into(),
            hostile::distinct_labels(0, 200_000, 6, NOW),
        ),
    ];
    let mut rng = Rng(0x00c0_ffee);
    let bases = [
        hostile::simple("m", 1, "m", 3, NOW),
        agent_like(20, 8, 20, 3, 7),
        hostile::inlined(300, 40, 8, NOW),
    ];
    for i in 0..2000 {
        let base = &bases[i % bases.len()];
        cases.push((format!("mutation {i}"), hostile::mutate(base, &mut rng)));
    }
    // Nested empty messages: the smallest encoding of each list entry.
    let mut nested = Pb::default();
    for _ in 0..200_000 {
        nested.bytes(4, &[]);
    }
    cases.push((
        "empty locations".into(),
        hostile::push("a", 1, "n", &nested),
    ));

    let mut worst = (0.0f64, String::new());
    for (name, bytes) in &cases {
        let (held, ok) = peak(bytes);
        let ratio = held as f64 / bytes.len() as f64;
        if ratio > worst.0 {
            worst = (ratio, format!("{name}, {} bytes", bytes.len()));
        }
        assert!(
            held <= FACTOR * bytes.len().max(1024),
            "{name}: {held} bytes held decoding {} bytes ({ratio:.1}x, decoded: {ok})",
            bytes.len()
        );
        if !name.starts_with("mutation") {
            println!(
                "{name}: {} bytes, {held} held, {ratio:.1}x, decoded: {ok}",
                bytes.len()
            );
        }
    }
    println!("most: {:.1}x ({})", worst.0, worst.1);
}
