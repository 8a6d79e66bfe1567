//! Folded stacks (`root;caller;leaf count`), the input format of FlameGraph and inferno.
//!
//! Each line is one stack, root first, with the process name (the sample's `comm` label) as
//! the root frame when the profile has one. Lines are merged and sorted, so equal profiles
//! give equal text and diffs of folded files are readable.

use std::collections::BTreeMap;
use std::io::Write;

use crate::model::{Frame, FrameKind, LabelValue, Profile};
use crate::output::{OutputError, check_type};

pub use pyrometer_proto::naming::KERNEL_SUFFIX;

/// Makes a name safe for a folded line ([`pyrometer_proto::naming::clean`]).
pub fn sanitize(name: &str) -> String {
    pyrometer_proto::naming::clean(name).into_owned()
}

/// The name a frame gets in folded output (and in other name-based views such as `top`),
/// as the collector names it too ([`pyrometer_proto::naming::frame_name`]).
pub fn frame_name(frame: &Frame) -> String {
    let kind = match frame.kind {
        FrameKind::Python => pyrometer_proto::FrameKind::Python,
        FrameKind::Kernel => pyrometer_proto::FrameKind::Kernel,
        FrameKind::Task => pyrometer_proto::FrameKind::AsyncioTask,
        _ => pyrometer_proto::FrameKind::Native,
    };
    pyrometer_proto::naming::frame_name(kind, &frame.function, frame.file.as_deref(), frame.line)
        .into_owned()
}

/// `function (file:line)` for a Python frame (see [`pyrometer_proto::naming`]).
pub fn python_label(frame: &Frame) -> String {
    pyrometer_proto::naming::python_frame_name(&frame.function, frame.file.as_deref(), frame.line)
}

/// The root frame a sample gets from its process name, if it has one.
pub fn process_root(comm: Option<&LabelValue>) -> Option<String> {
    comm.map(|c| sanitize(&c.to_string()))
}

/// The stacks of one sample type as `(root;...;leaf, total)`, sorted by stack and merged.
/// Stacks whose total is not positive are left out: folded readers cannot represent them.
pub fn folded_stacks(
    profile: &Profile,
    type_index: usize,
) -> Result<Vec<(String, i64)>, OutputError> {
    fold(profile, type_index, true)
}

/// [`folded_stacks`] without the process-name root: code only, so two runs of one program
/// under different binary names (a baseline and a candidate build) line up frame by frame.
pub fn folded_code_stacks(
    profile: &Profile,
    type_index: usize,
) -> Result<Vec<(String, i64)>, OutputError> {
    fold(profile, type_index, false)
}

fn fold(
    profile: &Profile,
    type_index: usize,
    process_roots: bool,
) -> Result<Vec<(String, i64)>, OutputError> {
    check_type(profile, type_index)?;
    let names: Vec<String> = profile.frames.iter().map(frame_name).collect();
    let mut merged: BTreeMap<String, i64> = BTreeMap::new();
    let mut line = String::new();
    for sample in &profile.samples {
        let value = sample.values[type_index];
        if value == 0 {
            continue;
        }
        line.clear();
        if let Some(root) = process_root(sample.labels.get("comm")).filter(|_| process_roots) {
            line.push_str(&root);
        }
        for &frame in profile.stacks.get(sample.stack).iter().rev() {
            if !line.is_empty() {
                line.push(';');
            }
            line.push_str(&names[frame as usize]);
        }
        if line.is_empty() {
            // A sample with neither frames nor process: still counted, under a visible name.
            line.push_str("[unknown]");
        }
        match merged.get_mut(line.as_str()) {
            Some(total) => *total += value,
            None => {
                merged.insert(line.clone(), value);
            }
        }
    }
    Ok(merged.into_iter().filter(|&(_, v)| v > 0).collect())
}

/// The folded text of one sample type, one `stack count` line per stack.
pub fn to_folded(profile: &Profile, type_index: usize) -> Result<String, OutputError> {
    let mut text = String::new();
    for (stack, count) in folded_stacks(profile, type_index)? {
        text.push_str(&stack);
        text.push(' ');
        text.push_str(&count.to_string());
        text.push('\n');
    }
    Ok(text)
}

/// Writes one sample type as folded stacks.
pub fn write_folded(
    profile: &Profile,
    type_index: usize,
    out: &mut dyn Write,
) -> Result<(), OutputError> {
    out.write_all(to_folded(profile, type_index)?.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Labels, SampleType};
    use crate::output::fixture;

    #[test]
    fn fixture_folded() {
        let text = to_folded(&fixture::profile(), 0).unwrap();
        let expected = "\
python3;main;_PyEval_EvalFrameDefault;__libc_read;do_syscall_64_[k];copy_user_generic_string_[k] 3
python3;main;_PyEval_EvalFrameDefault;long_add;_PyLong_Add;PyLong_FromLong 7
ray::Train;main;[unknown] 2
ray::Train;main;fib;fib;fib 4
ray::Train;main;train_step;<[u8: 8] as Debug>::fmt 7
ray::Train;schedule_[k];finish_task_switch_[k] 1
";
        assert_eq!(text, expected);
        let cpu = to_folded(&fixture::profile(), 1).unwrap();
        assert!(cpu.contains(&format!(" {}\n", 7 * fixture::PERIOD_NS)));
    }

    #[test]
    fn no_comm_means_no_root_and_zero_samples_are_dropped() {
        let mut p = Profile::new(vec![SampleType::new("samples", "count")]);
        let a = p.intern_frame(Frame::named("a", FrameKind::Native));
        let b = p.intern_frame(Frame::named("b", FrameKind::Native));
        let ab = p.intern_stack(vec![b, a]);
        let ba = p.intern_stack(vec![a, b]);
        // Different labels, same folded line: merged.
        p.add(ab, Labels::new().with("tid", LabelValue::Num(1)), &[2]);
        p.add(ab, Labels::new().with("tid", LabelValue::Num(2)), &[3]);
        p.add(ba, Labels::new(), &[0]);
        assert_eq!(to_folded(&p, 0).unwrap(), "a;b 5\n");
    }

    #[test]
    fn names_are_sanitized() {
        assert_eq!(sanitize("a;b\nc\r\td "), "a:b c  d");
        assert_eq!(sanitize(" \n"), "[unknown]");
        let k = Frame::named("x_[k]", FrameKind::Kernel);
        assert_eq!(frame_name(&k), "x_[k]");
        assert_eq!(
            process_root(Some(&LabelValue::Str("ray::A;B".into()))),
            Some("ray::A:B".to_string())
        );
    }
}
