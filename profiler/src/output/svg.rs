//! Interactive flame graph SVG, rendered by inferno from our folded stacks.

use std::io::Write;

use inferno::flamegraph::{self, Options, Palette, color::MultiPalette};

use crate::model::{Profile, SampleType};
use crate::output::{OutputError, folded};

/// What the flame graph calls one unit of a sample type ("7 samples", "1,200 ns").
pub fn count_name(sample_type: &SampleType) -> String {
    match sample_type.unit.as_str() {
        "count" if sample_type.name.ends_with("_objects") => "objects".to_string(),
        "count" => "samples".to_string(),
        "nanoseconds" => "ns".to_string(),
        unit => unit.to_string(),
    }
}

/// Inferno options shared by every flame graph we draw.
fn options(title: &str, sample_type: &SampleType) -> Options<'static> {
    let mut opt = Options::default();
    opt.title = title.to_string();
    opt.count_name = count_name(sample_type);
    // Of inferno's palettes, Java's gives `_[k]` frames their own hue (orange) without
    // language-specific guesses taking over the rest: C++/Rust paths yellow, others red/green.
    opt.colors = Palette::Multi(MultiPalette::Java);
    // Colour by name hash rather than at random: equal profiles give byte-identical SVGs and
    // a function keeps its colour across graphs.
    opt.hash = true;
    opt
}

/// Writes the flame graph of one sample type. An empty profile is an error: inferno would
/// otherwise draw an SVG that only says "no valid input".
pub fn write_svg(
    profile: &Profile,
    type_index: usize,
    title: &str,
    out: &mut dyn Write,
) -> Result<(), OutputError> {
    let stacks = folded::folded_stacks(profile, type_index)?;
    let sample_type = &profile.sample_types[type_index];
    if stacks.is_empty() {
        return Err(OutputError::Empty(sample_type.name.clone()));
    }
    let lines: Vec<String> = stacks
        .iter()
        .map(|(stack, count)| format!("{stack} {count}"))
        .collect();
    let mut opt = options(title, sample_type);
    // The lines are already sorted by stack, the order inferno's merge needs.
    opt.no_sort = true;
    flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), out)
        .map_err(OutputError::Flamegraph)
}

/// Writes the differential flame graph of [`pyrometer_diff::write_differential_svg`]: the
/// shape of `new` without process-name roots, coloured by the change from `base`.
pub fn write_differential_svg(
    base: &Profile,
    base_type: usize,
    new: &Profile,
    new_type: usize,
    title: &str,
    out: &mut dyn Write,
) -> Result<(), OutputError> {
    // Without process roots: the baseline and candidate binaries may be named differently.
    let to_text = |p: &Profile, t: usize| -> Result<String, OutputError> {
        let stacks = folded::folded_code_stacks(p, t)?;
        if stacks.is_empty() {
            return Err(OutputError::Empty(p.sample_types[t].name.clone()));
        }
        Ok(stacks.iter().map(|(s, n)| format!("{s} {n}\n")).collect())
    };
    let before = to_text(base, base_type)?;
    let after = to_text(new, new_type)?;
    let mut opt = options(title, &new.sample_types[new_type]);
    pyrometer_diff::write_differential_svg(&before, &after, &mut opt, out)
        .map_err(OutputError::Flamegraph)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, FrameKind, Labels};
    use crate::output::fixture;

    fn render(p: &Profile, type_index: usize) -> String {
        let mut out = Vec::new();
        write_svg(p, type_index, "Fixture CPU", &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// The `fill` colour of the frame whose tooltip starts with `name`.
    fn fill_of(svg: &str, name: &str) -> (u8, u8, u8) {
        let at = svg
            .find(&format!("<title>{name} ("))
            .unwrap_or_else(|| panic!("no frame {name}"));
        let rest = &svg[at..];
        let start = rest.find("fill=\"rgb(").unwrap() + "fill=\"rgb(".len();
        let rgb: Vec<u8> = rest[start..rest[start..].find(')').unwrap() + start]
            .split(',')
            .map(|c| c.parse().unwrap())
            .collect();
        (rgb[0], rgb[1], rgb[2])
    }

    #[test]
    fn kernel_frames_get_their_own_colour() {
        let svg = render(&fixture::profile(), 0);
        assert!(svg.contains("Fixture CPU"));
        // inferno's Java palette draws `_[k]` frames orange, whose blue component is 0; every
        // other hue it picks has blue >= 50.
        for kernel in ["do_syscall_64", "schedule", "finish_task_switch"] {
            assert_eq!(fill_of(&svg, kernel).2, 0, "{kernel} not orange");
        }
        for user in ["train_step", "__libc_read", "long_add", "fib"] {
            assert!(fill_of(&svg, user).2 >= 50, "{user} coloured as kernel");
        }
    }

    #[test]
    fn counts_are_named_after_the_unit_and_output_is_deterministic() {
        let p = fixture::profile();
        let samples = render(&p, 0);
        assert!(
            samples.contains("<title>all (24 samples, 100%)</title>"),
            "{samples}"
        );
        let cpu = render(&p, 1);
        assert!(cpu.contains(" ns, 100%)</title>"));
        assert_eq!(render(&p, 1), cpu);
        assert_eq!(
            count_name(&SampleType::new("alloc_space", "bytes")),
            "bytes"
        );
        assert_eq!(
            count_name(&SampleType::new("inuse_objects", "count")),
            "objects"
        );
    }

    #[test]
    fn differential_marks_growth_red_and_shrinkage_blue() {
        let base =
            crate::input::read_folded("main;grow 100\nmain;shrink 300\nmain;same 100\n").unwrap();
        // Twice the samples, grow 20 % -> 50 %, shrink 60 % -> 30 %.
        let new =
            crate::input::read_folded("main;grow 500\nmain;shrink 300\nmain;same 200\n").unwrap();
        let mut out = Vec::new();
        write_differential_svg(&base, 0, &new, 0, "diff", &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        let (r, g, b) = fill_of(&svg, "grow");
        assert!(r > g && r > b, "grow not red: {r},{g},{b}");
        let (r, g, b) = fill_of(&svg, "shrink");
        assert!(b > r && b > g, "shrink not blue: {r},{g},{b}");
        let (r, _, b) = fill_of(&svg, "same");
        assert_eq!(r, b, "unchanged frame is coloured");
        // inferno puts the change in the tooltip.
        assert!(svg.contains("<title>grow (500 samples, 50.00%; +30.00%)</title>"));
    }

    #[test]
    fn empty_profile_is_an_error() {
        let mut p = Profile::cpu(10);
        assert_eq!(
            write_svg(&p, 1, "t", &mut Vec::new())
                .unwrap_err()
                .to_string(),
            "no samples of type 'cpu' to draw"
        );
        // Samples that carry nothing for the chosen type are as good as none.
        let f = p.intern_frame(Frame::named("f", FrameKind::Native));
        let s = p.intern_stack(vec![f]);
        p.add(s, Labels::new(), &[1, 0]);
        assert!(matches!(
            write_svg(&p, 1, "t", &mut Vec::new()),
            Err(OutputError::Empty(_))
        ));
        assert!(write_svg(&p, 0, "t", &mut Vec::new()).is_ok());
    }
}
