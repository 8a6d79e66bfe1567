use super::*;
use crate::capture::gpu::channel::{Copy, Status};
use crate::capture::gpu::testenc::{Enc, kernel, launch};

const S: u64 = 1_000_000_000;

fn status(every: u32) -> Status {
    Status {
        lib_version: 1,
        sample_every: every,
        ..Status::default()
    }
}

fn copy(correlation: u32, runtime_correlation: u32, start: u64, end: u64) -> Copy {
    Copy {
        correlation,
        runtime_correlation,
        device: 0,
        context: 1,
        stream: 7,
        copy_kind: 1,
        src_kind: 3,
        dst_kind: 4,
        flags: 1,
        graph: 0,
        bytes: 4096,
        start,
        end,
    }
}

#[test]
fn sampled_launches_bring_their_stack_weight_and_ranges() {
    let mut j: Joiner<&str> = Joiner::default();
    let mut e = Enc::default();
    e.status(&status(4))
        .string(3, 1, "_Z6matmulv")
        .string(9, 2, "train/forward")
        .device(0, [7; 16])
        .launch(&launch(10, 42, 4, 9));
    assert!(j.chunk(100, &e.chunk(0), S).is_empty());
    j.stack(100, 42, 10, "main;train;matmul", 1, S);
    e.kernel(&kernel(10, 3, 1, 1000, 3000))
        .kernel(&kernel(11, 3, 1, 3000, 3500));
    let ev = j.chunk(100, &e.chunk(1), S);
    assert_eq!(ev.len(), 2);
    let s = ev[0].sample.as_ref().expect("sampled");
    assert_eq!(s.weight, 4);
    assert_eq!(s.stack, Some("main;train;matmul"));
    assert_eq!(s.tid, Some(42));
    assert_eq!(s.nvtx.as_deref(), Some("train/forward"));
    assert_eq!(ev[0].uuid, Some([7; 16]));
    assert_eq!(ev[0].duration(), 2000);
    assert!(
        matches!(&ev[0].op, Op::Kernel { name, .. } if &**name == "_Z6matmulv"),
        "{:?}",
        ev[0].op
    );
    // Not sampled: counts, no stack.
    assert_eq!(ev[1].sample, None);
    let st = j.stats();
    assert_eq!((st.kernels, st.sampled, st.stacks_missing), (2, 1, 0));
}

#[test]
fn a_graph_launch_gives_its_stack_to_every_kernel() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    e.status(&status(1)).launch(&launch(20, 1, 1, 0));
    j.stack(5, 1, 20, 77, 1, S);
    for i in 0..3 {
        let mut k = kernel(20, 2, 0, 100 * i, 100 * i + 50);
        k.graph = 9;
        e.kernel(&k);
    }
    let ev = j.chunk(5, &e.chunk(0), S);
    assert_eq!(ev.len(), 3);
    assert!(
        ev.iter()
            .all(|e| e.sample.as_ref().unwrap().stack == Some(77))
    );
    assert!(matches!(ev[2].op, Op::Kernel { graph: 9, .. }));
}

#[test]
fn copies_join_by_runtime_id_or_alias() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    // Copy 1: its driver call 31 inside runtime call 30 (sampled): the record has both ids.
    // Copy 2: only the driver call's id 41, which an ALIAS ties to the sampled runtime call 40.
    e.status(&status(2))
        .launch(&launch(30, 1, 2, 0))
        .launch(&launch(40, 1, 2, 0))
        .alias(41, 40);
    j.stack(5, 1, 30, 300, 1, S);
    j.stack(5, 1, 40, 400, 1, S);
    e.copy(5, &copy(31, 30, 10, 20))
        .copy(5, &copy(41, 0, 20, 30))
        .copy(6, &copy(50, 0, 30, 40));
    let ev = j.chunk(5, &e.chunk(0), S);
    let stacks: Vec<Option<u32>> = ev
        .iter()
        .map(|e| e.sample.as_ref().and_then(|s| s.stack))
        .collect();
    assert_eq!(stacks, vec![Some(300), Some(400), None]);
    assert!(matches!(
        ev[0].op,
        Op::Memcpy {
            kind: 1,
            bytes: 4096
        }
    ));
    assert!(matches!(ev[2].op, Op::Memset { bytes: 4096 }));
}

#[test]
fn times_move_onto_the_monotonic_clock() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    // CUPTI's clock 1000 read when CLOCK_MONOTONIC said 5000.
    e.status(&status(1))
        .clock(1000, 5000)
        .kernel(&kernel(1, 2, 0, 2000, 2500));
    let ev = j.chunk(5, &e.chunk(0), S);
    assert_eq!((ev[0].start, ev[0].end), (6000, 6500));
    // A later clock (another tool's timestamp callback) moves later records only.
    e.clock(10_000, 5000)
        .kernel(&kernel(2, 2, 0, 12_000, 12_100));
    let ev = j.chunk(5, &e.chunk(1), S);
    assert_eq!((ev[0].start, ev[0].end), (7000, 7100));
}

#[test]
fn one_in_n_weights_keep_totals_unbiased() {
    // Kernels of three sizes launched in a repeating pattern (as a training step does); each
    // launch sampled with probability 1/8 at geometric gaps, like the library.
    let n = 8u32;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut gap = || 1 + (uniform().max(1e-300).ln() / (1.0 - 1.0 / f64::from(n)).ln()) as u64;
    let mut j: Joiner<u8> = Joiner::default();
    let mut e = Enc::default();
    e.status(&status(n));
    let mut countdown = gap();
    let mut truth = [0u64; 3];
    let mut t = 0;
    let mut seq = 0;
    let mut estimate = [0f64; 3];
    for i in 0..60_000u32 {
        let size = (i % 3) as usize;
        let dur = [100u64, 1_000, 10_000][size];
        truth[size] += dur;
        let corr = i + 1;
        countdown -= 1;
        if countdown == 0 {
            countdown = gap();
            e.launch(&launch(corr, 1, n, 0));
            j.stack(9, 1, corr, size as u8, 1, S);
        }
        e.kernel(&kernel(corr, 2, 0, t, t + dur));
        t += dur;
        if i % 40 == 39 {
            for ev in j.chunk(9, &e.chunk(seq), S) {
                if let Some(s) = &ev.sample {
                    estimate[usize::from(s.stack.unwrap())] +=
                        f64::from(s.weight) * ev.duration() as f64;
                }
            }
            seq += 1;
        }
    }
    for k in 0..3 {
        let err = (estimate[k] - truth[k] as f64).abs() / truth[k] as f64;
        assert!(
            err < 0.05,
            "size {k}: {} vs {} ({err:.3})",
            estimate[k],
            truth[k]
        );
    }
    assert_eq!(j.stats().chunks_lost, 0);
}

#[test]
fn missing_stacks_and_notes_are_told_apart() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    // 1: sampled, its stack lost. 2: its stack arrived, its LAUNCH record did not (the
    // library's queue was full): the status's N is its weight.
    e.status(&status(16)).launch(&launch(1, 3, 16, 0));
    j.stack(8, 3, 2, 22, 1, S);
    e.kernel(&kernel(1, 2, 0, 0, 10))
        .kernel(&kernel(2, 2, 0, 10, 20));
    let ev = j.chunk(8, &e.chunk(0), S);
    let a = ev[0].sample.as_ref().unwrap();
    assert_eq!((a.weight, a.stack), (16, None));
    let b = ev[1].sample.as_ref().unwrap();
    assert_eq!((b.weight, b.stack, b.tid), (16, Some(22), Some(3)));
    assert_eq!(j.stats().stacks_missing, 1);
}

#[test]
fn gaps_broken_chunks_and_floods_are_counted() {
    let mut j: Joiner<u32> = Joiner::new(Limits {
        chunks_per_second: 2,
        ..Limits::default()
    });
    let mut e = Enc::default();
    j.chunk(1, &e.status(&status(1)).chunk(0), S);
    j.chunk(1, &e.alias(1, 2).chunk(4), S);
    assert_eq!(j.stats().chunks_lost, 3);
    let mut bad = e.alias(1, 2).chunk(5);
    bad[18] = 3; // a record length of 3
    j.chunk(1, &bad, S);
    assert_eq!(j.stats().chunks_refused, 1);
    // The third valid chunk within the second is over the rate; the next second is fine again.
    assert!(
        j.chunk(1, &e.kernel(&kernel(1, 2, 0, 0, 1)).chunk(6), S)
            .is_empty()
    );
    assert_eq!(j.stats().chunks_rate_limited, 1);
    assert_eq!(
        j.chunk(1, &e.kernel(&kernel(1, 2, 0, 0, 1)).chunk(7), 2 * S)
            .len(),
        1
    );
}

#[test]
fn bounds_hold_against_a_flooding_process() {
    let mut j: Joiner<u32> = Joiner::new(Limits {
        processes: 2,
        strings: 4,
        pending: 8,
        chunks_per_second: u32::MAX,
        ..Limits::default()
    });
    let mut e = Enc::default();
    for id in 1..=10 {
        e.string(id, 1, "k");
    }
    for c in 1..=20 {
        e.launch(&launch(c, 1, 1, 0)).alias(c + 100, c);
    }
    j.chunk(1, &e.chunk(0), S);
    for c in 1..=20 {
        j.stack(1, 1, c, c, 1, S);
    }
    let p = &j.procs[&1];
    assert_eq!(
        (
            p.strings.len(),
            p.notes.len(),
            p.stacks.len(),
            p.aliases.len()
        ),
        (4, 8, 8, 8)
    );
    assert_eq!(j.stats().kept_refused, 6 + 12 + 12 + 12);
    j.chunk(2, &e.alias(1, 2).chunk(0), S);
    j.chunk(3, &e.alias(1, 2).chunk(0), S);
    j.stack(4, 1, 1, 1, 1, S);
    assert_eq!(j.stats().processes_refused, 2);
    // Nonsense times are refused.
    let ev = j.chunk(1, &e.kernel(&kernel(1, 2, 0, 50, 10)).chunk(1), S);
    assert!(ev.is_empty());
    assert_eq!(j.stats().records_refused, 1);
}

#[test]
fn old_entries_expire_and_unclaimed_stacks_are_counted() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    j.chunk(
        1,
        &e.status(&status(1)).launch(&launch(5, 1, 1, 0)).chunk(0),
        S,
    );
    j.stack(1, 1, 5, 50, 1, S);
    j.stack(1, 1, 6, 60, 1, S);
    j.chunk(1, &e.kernel(&kernel(5, 2, 0, 0, 1)).chunk(1), S);
    j.expire(S + 61 * S);
    assert_eq!(j.stats().stacks_unclaimed, 1);
    assert!(j.procs[&1].stacks.is_empty() && j.procs[&1].notes.is_empty());
    j.expire(S + 700 * S);
    assert!(j.procs.is_empty());
}

#[test]
fn library_counters_add_up_across_statuses() {
    let mut j: Joiner<u32> = Joiner::default();
    let mut e = Enc::default();
    let mut s = status(8);
    s.launches = 100;
    s.sampled = 12;
    s.cupti_dropped = 5;
    e.string(4, 3, "CUPTI for Nsight Systems");
    j.chunk(1, &e.status(&s).chunk(0), S);
    s.launches = 250;
    s.sampled = 30;
    s.cupti_dropped = 7;
    s.other = 4;
    s.last = true;
    j.chunk(1, &e.status(&s).chunk(1), S);
    let st = j.stats();
    assert_eq!(
        (st.lib_launches, st.lib_sampled, st.cupti_dropped),
        (250, 30, 7)
    );
    let (pid, ps) = &j.statuses()[0];
    assert_eq!(*pid, 1);
    assert_eq!(ps.other_tool.as_deref(), Some("CUPTI for Nsight Systems"));
    assert!(ps.ended);
    assert_eq!(ps.sample_every, 8);
}
