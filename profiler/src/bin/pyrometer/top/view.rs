//! What `top` shows: the functions of the last few seconds by their own share of the samples
//! (the function was the leaf) and their total share (it was anywhere on the stack), kept as
//! one table per second so the window slides, and the screen drawn from them.

use std::collections::{HashMap, HashSet, VecDeque};

use pyrometer::model::{FrameKind, LabelValue, Profile};

/// One row's identity: the function and, so the toggles can split rows without losing the
/// window, the process and thread it ran in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    function: String,
    pid: u32,
    comm: String,
    thread: String,
}

/// Samples of one second: per key, samples where it was the leaf and where it was anywhere.
#[derive(Default)]
struct Second {
    samples: u64,
    rows: HashMap<Key, (u64, u64)>,
}

/// Sort orders, chosen with the keys 1, 2, 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sort {
    Own,
    Total,
    Name,
}

/// The sliding window and the display options.
pub struct View {
    seconds: VecDeque<Second>,
    window: usize,
    pub sort: Sort,
    /// Split rows by thread (key `t`) and by process (key `p`).
    pub by_thread: bool,
    pub by_process: bool,
    pub paused: bool,
}

/// A function's name as the view shows it: Python functions with their file, kernel
/// functions marked, native ones as symbolized.
fn function_name(frame: &pyrometer::model::Frame) -> String {
    match frame.kind {
        FrameKind::Python => match &frame.file {
            Some(file) => format!("{} ({file})", frame.function),
            None => frame.function.clone(),
        },
        FrameKind::Kernel => format!("{} [k]", frame.function),
        FrameKind::Gpu => format!("{} [gpu]", frame.function),
        FrameKind::Task => format!("{}{}", pyrometer_proto::naming::TASK_PREFIX, frame.function),
        _ => frame.function.clone(),
    }
}

fn label_str(labels: &pyrometer::model::Labels, key: &str) -> String {
    match labels.get(key) {
        Some(LabelValue::Str(s)) => s.clone(),
        Some(LabelValue::Num(n)) => n.to_string(),
        None => String::new(),
    }
}

impl View {
    /// A view over the last `window` seconds.
    pub fn new(window: usize) -> View {
        View {
            seconds: VecDeque::new(),
            window: window.max(1),
            sort: Sort::Own,
            by_thread: false,
            by_process: false,
            paused: false,
        }
    }

    /// Adds one second's profile (its first sample type counts samples); the oldest second
    /// leaves the window.
    pub fn push(&mut self, profile: &Profile, samples_type: usize) {
        let mut second = Second::default();
        for sample in &profile.samples {
            let n = u64::try_from(sample.values[samples_type]).unwrap_or(0);
            if n == 0 {
                continue;
            }
            second.samples += n;
            let key = |function: String| Key {
                function,
                pid: u32::try_from(match sample.labels.get("pid") {
                    Some(LabelValue::Num(p)) => *p,
                    _ => 0,
                })
                .unwrap_or(0),
                comm: label_str(&sample.labels, "comm"),
                thread: label_str(&sample.labels, "thread"),
            };
            let mut seen = HashSet::new();
            for (depth, frame) in profile.stack_frames(sample.stack).enumerate() {
                let name = function_name(frame);
                if depth == 0 {
                    second.rows.entry(key(name.clone())).or_default().0 += n;
                }
                // Recursion counts once per sample in the total.
                if seen.insert(name.clone()) {
                    second.rows.entry(key(name)).or_default().1 += n;
                }
            }
        }
        self.seconds.push_back(second);
        while self.seconds.len() > self.window {
            self.seconds.pop_front();
        }
    }

    /// Samples in the window.
    pub fn samples(&self) -> u64 {
        self.seconds.iter().map(|s| s.samples).sum()
    }

    /// Rows of the window as (function, process, thread, own, total), in the chosen order;
    /// process and thread are empty unless their toggle is on.
    pub fn rows(&self) -> Vec<(String, String, String, u64, u64)> {
        let mut merged: HashMap<(String, String, String), (u64, u64)> = HashMap::new();
        for second in &self.seconds {
            for (k, &(own, total)) in &second.rows {
                let process = if self.by_process {
                    format!("{} {}", k.pid, k.comm)
                } else {
                    String::new()
                };
                let thread = if self.by_thread {
                    k.thread.clone()
                } else {
                    String::new()
                };
                let e = merged
                    .entry((k.function.clone(), process, thread))
                    .or_default();
                e.0 += own;
                e.1 += total;
            }
        }
        let mut rows: Vec<_> = merged
            .into_iter()
            .map(|((f, p, t), (own, total))| (f, p, t, own, total))
            .collect();
        rows.sort_by(|a, b| match self.sort {
            Sort::Own => (b.3, b.4).cmp(&(a.3, a.4)).then_with(|| a.0.cmp(&b.0)),
            Sort::Total => (b.4, b.3).cmp(&(a.4, a.3)).then_with(|| a.0.cmp(&b.0)),
            Sort::Name => (&a.0, &a.1, &a.2).cmp(&(&b.0, &b.1, &b.2)),
        });
        rows
    }

    /// The screen: a header of `status` lines, the column titles, then as many rows as fit.
    pub fn render(&self, status: &[String], height: usize) -> Vec<String> {
        let total = self.samples();
        let mut lines = status.to_vec();
        let sort = match self.sort {
            Sort::Own => "own",
            Sort::Total => "total",
            Sort::Name => "name",
        };
        lines.push(format!(
            "sort: {sort}{}{}{}   keys: 1 own  2 total  3 name  t threads  p processes  space pause  q quit",
            if self.by_thread { ", by thread" } else { "" },
            if self.by_process { ", by process" } else { "" },
            if self.paused { "   PAUSED" } else { "" },
        ));
        lines.push(String::new());
        let mut title = String::from("  OWN%  TOTAL%     OWN   TOTAL  ");
        if self.by_process {
            title.push_str(&format!("{:<24}", "PROCESS"));
        }
        if self.by_thread {
            title.push_str(&format!("{:<18}", "THREAD"));
        }
        title.push_str("FUNCTION");
        lines.push(title);
        let pct = |n: u64| {
            if total == 0 {
                0.0
            } else {
                100.0 * n as f64 / total as f64
            }
        };
        for (function, process, thread, own, total_n) in self.rows() {
            if lines.len() >= height {
                break;
            }
            let mut line = format!(
                "{:>6.1}  {:>6.1}  {:>6}  {:>6}  ",
                pct(own),
                pct(total_n),
                own,
                total_n
            );
            if self.by_process {
                line.push_str(&format!("{process:<24.23}"));
            }
            if self.by_thread {
                line.push_str(&format!("{thread:<18.17}"));
            }
            line.push_str(&function);
            lines.push(line);
        }
        lines
    }

    /// Applies one key; returns true when it asks to quit (q, Q, Ctrl-C, Ctrl-D).
    pub fn key(&mut self, key: u8) -> bool {
        match key {
            b'q' | b'Q' | 0x03 | 0x04 => return true,
            b'1' => self.sort = Sort::Own,
            b'2' => self.sort = Sort::Total,
            b'3' => self.sort = Sort::Name,
            b't' => self.by_thread = !self.by_thread,
            b'p' => self.by_process = !self.by_process,
            b' ' => self.paused = !self.paused,
            _ => {}
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyrometer::model::{Frame, Labels};

    fn profile(stacks: &[(&[&str], u32, &str, i64)]) -> Profile {
        let mut p = Profile::cpu(10);
        for (frames, pid, thread, n) in stacks {
            let ids: Vec<u32> = frames
                .iter()
                .map(|f| p.intern_frame(Frame::named(*f, FrameKind::Native)))
                .collect();
            let stack = p.intern_stack(ids);
            let labels = Labels::new()
                .with("pid", LabelValue::Num(i64::from(*pid)))
                .with("comm", LabelValue::Str("prog".into()))
                .with("thread", LabelValue::Str((*thread).into()));
            p.add(stack, labels, &[*n, *n * 10]);
        }
        p
    }

    #[test]
    fn shares_over_a_sliding_window() {
        let mut v = View::new(2);
        // Leaf first: a under work under main; recursion of `rec` counts once in total.
        v.push(
            &profile(&[
                (&["a", "work", "main"], 1, "t1", 6),
                (&["b", "work", "main"], 1, "t2", 3),
                (&["rec", "rec", "main"], 1, "t1", 1),
            ]),
            0,
        );
        let rows = v.rows();
        assert_eq!(v.samples(), 10);
        assert_eq!(rows[0], ("a".into(), "".into(), "".into(), 6, 6));
        let find = |rows: &[(String, String, String, u64, u64)], f: &str| {
            rows.iter().find(|r| r.0 == f).cloned().unwrap()
        };
        assert_eq!(find(&rows, "main").4, 10);
        assert_eq!(find(&rows, "work").3, 0);
        assert_eq!(find(&rows, "rec").4, 1);
        // Two more seconds: the first leaves the window.
        v.push(&profile(&[(&["b", "work", "main"], 1, "t2", 4)]), 0);
        v.push(&profile(&[(&["b", "work", "main"], 1, "t2", 4)]), 0);
        assert_eq!(v.samples(), 8);
        assert!(v.rows().iter().all(|r| r.0 != "a"));
    }

    #[test]
    fn keys_sort_and_split() {
        let mut v = View::new(5);
        v.push(
            &profile(&[
                (&["a", "main"], 1, "t1", 2),
                (&["a", "main"], 1, "t2", 2),
                (&["b", "main"], 2, "t3", 3),
            ]),
            0,
        );
        assert_eq!(v.rows()[0].0, "a");
        assert!(!v.key(b'2'));
        assert_eq!(v.rows()[0].0, "main");
        v.key(b'3');
        let names: Vec<String> = v.rows().into_iter().map(|r| r.0).collect();
        assert_eq!(names, ["a", "b", "main"]);
        v.key(b'1');
        v.key(b't');
        let rows = v.rows();
        assert_eq!(rows[0].0, "b");
        assert_eq!(rows[0].2, "t3");
        v.key(b'p');
        assert!(v.rows().iter().any(|r| r.1 == "2 prog"));
        let screen = v.render(&["status".into()], 40);
        assert!(screen[1].contains("by thread, by process"), "{screen:?}");
        assert!(screen[3].contains("PROCESS") && screen[3].contains("THREAD"));
        assert!(v.key(b'q') && v.key(0x03));
    }
}
