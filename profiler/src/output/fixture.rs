//! A small fixed profile the output tests and golden files share: two processes, kernel,
//! native, inlined, unknown and recursive frames, string and numeric labels.

use crate::model::{Frame, FrameKind, LabelValue, Labels, Profile};

pub const PERIOD_NS: i64 = 10_101_010;
const KERNEL: &str = "[kernel.kallsyms]";
const PYTHON: &str = "/usr/bin/python3.11";
const PYTHON_ID: &str = "0f3c6a2b9d11e4f5a6b7c8d9e0f1a2b3c4d5e6f7";
const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
const LIBC_ID: &str = "aa1b2c3d4e5f60718293a4b5c6d7e8f901234567";
const TRAIN: &str = "/opt/train/libtrain.so";

fn kernel(name: &str, address: u64) -> Frame {
    Frame {
        module: Some(KERNEL.into()),
        address,
        ..Frame::named(name, FrameKind::Kernel)
    }
}

fn native(name: &str, module: &str, build_id: Option<&str>, address: u64) -> Frame {
    Frame {
        module: Some(module.into()),
        build_id: build_id.map(String::from),
        address,
        ..Frame::named(name, FrameKind::Native)
    }
}

fn with_line(frame: Frame, file: &str, line: u32) -> Frame {
    Frame {
        file: Some(file.into()),
        line: Some(line),
        ..frame
    }
}

fn inlined(frame: Frame) -> Frame {
    Frame {
        inlined: true,
        ..frame
    }
}

fn labels(comm: &str, pid: i64, tid: i64, thread: &str) -> Labels {
    Labels::new()
        .with("comm", LabelValue::Str(comm.into()))
        .with("pid", LabelValue::Num(pid))
        .with("tid", LabelValue::Num(tid))
        .with("thread_name", LabelValue::Str(thread.into()))
}

fn add(p: &mut Profile, frames_leaf_first: Vec<Frame>, labels: Labels, samples: i64) {
    let ids = frames_leaf_first
        .into_iter()
        .map(|f| p.intern_frame(f))
        .collect();
    let stack = p.intern_stack(ids);
    p.add(stack, labels, &[samples, samples * PERIOD_NS]);
}

/// The fixture. Totals: 24 samples; python3 10 (3 in the kernel), ray::Train 14.
pub fn profile() -> Profile {
    let mut p = Profile::cpu(PERIOD_NS);
    p.time_nanos = 1_700_000_000_123_456_789;
    p.duration_nanos = 2_000_000_000;
    p.comments.push("pyrometer test fixture".into());

    let main_py = with_line(
        native("main", PYTHON, Some(PYTHON_ID), 0x2_1000),
        "Programs/python.c",
        15,
    );
    let eval = with_line(
        native(
            "_PyEval_EvalFrameDefault",
            PYTHON,
            Some(PYTHON_ID),
            0x8_2f10,
        ),
        "Python/ceval.c",
        4200,
    );
    let py_main = labels("python3", 100, 101, "MainThread");
    add(
        &mut p,
        vec![
            kernel("copy_user_generic_string", 0xffff_ffff_8123_4567),
            kernel("do_syscall_64", 0xffff_ffff_81a0_0123),
            native("__libc_read", LIBC, Some(LIBC_ID), 0x11_4a2c),
            eval.clone(),
            main_py.clone(),
        ],
        py_main.clone(),
        3,
    );
    // Two functions inlined into long_add at one address: one pprof Location, three Lines.
    let add_stack = vec![
        inlined(with_line(
            native("PyLong_FromLong", PYTHON, Some(PYTHON_ID), 0x1a_2b3c),
            "Objects/longobject.c",
            301,
        )),
        inlined(with_line(
            native("_PyLong_Add", PYTHON, Some(PYTHON_ID), 0x1a_2b3c),
            "Objects/longobject.c",
            152,
        )),
        with_line(
            native("long_add", PYTHON, Some(PYTHON_ID), 0x1a_2b3c),
            "Objects/longobject.c",
            3120,
        ),
        eval,
        main_py,
    ];
    add(&mut p, add_stack.clone(), py_main, 5);
    add(&mut p, add_stack, labels("python3", 100, 102, "worker"), 2);

    let ray =
        |tid| labels("ray::Train", 200, tid, "train").with("ray_job", LabelValue::Str("07".into()));
    let main_train = native("main", TRAIN, None, 0x900);
    add(
        &mut p,
        vec![
            // A name with ';' and a newline: folded output must keep its frame boundaries.
            native("<[u8; 8] as Debug>::fmt\n", TRAIN, None, 0x4410),
            native("train_step", TRAIN, None, 0x5000),
            main_train.clone(),
        ],
        ray(201),
        7,
    );
    add(
        &mut p,
        vec![
            kernel("finish_task_switch", 0xffff_ffff_810c_1000),
            kernel("schedule", 0xffff_ffff_81f0_2000),
        ],
        ray(202),
        1,
    );
    let fib = native("fib", TRAIN, None, 0x6000);
    add(
        &mut p,
        vec![fib.clone(), fib.clone(), fib, main_train.clone()],
        ray(201),
        4,
    );
    let unknown = Frame {
        module: Some(TRAIN.into()),
        address: 0xdead,
        ..Frame::named("[unknown]", FrameKind::Unknown)
    };
    add(&mut p, vec![unknown, main_train], ray(201), 2);
    p
}

/// Per-sample times for the fixture: profile sample `i` gets its samples one period apart
/// starting at `i * 100` periods, so each is one slice and equal threads leave gaps between.
pub fn timeline(p: &Profile) -> crate::capture::Timeline {
    let origin = 5_000_000_000;
    let period = PERIOD_NS as u64;
    let mut t = crate::capture::Timeline::new(1000, origin, period);
    for (i, s) in p.samples.iter().enumerate() {
        for k in 0..s.values[0] as u64 {
            t.events.push(crate::capture::TimelineEvent {
                timestamp_ns: origin + (i as u64 * 100 + k + 1) * period,
                sample: i as u32,
            });
        }
    }
    t
}
