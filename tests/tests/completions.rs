//! Shell completions and man pages, generated from the CLI definition by the real binaries.
//! No privileges needed.

use std::path::Path;
use std::process::Command;

use pyrometer_e2e::*;

/// What bash completes for `words` (the word under the cursor last), with the script loaded
/// as a user's shell would load it.
fn bash_complete(script: &Path, words: &[&str]) -> (String, Vec<String>) {
    let array = words
        .iter()
        .map(|w| format!("'{w}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let cword = words.len() - 1;
    let program = format!(
        "source '{}' || exit 9; complete -p pyrometer; COMP_WORDS=({array}); COMP_CWORD={cword}; \
         COMP_LINE='{}'; COMP_POINT=${{#COMP_LINE}}; _pyrometer pyrometer '{}' '{}'; \
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        words.join(" "),
        words[cword],
        words[cword.saturating_sub(1)],
    );
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", &program])
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "bash: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let spec = lines.next().unwrap_or_default().to_string();
    (
        spec,
        lines.filter(|l| !l.is_empty()).map(String::from).collect(),
    )
}

#[test]
fn bash_completion_loads_and_completes() {
    let dir = scratch("completions-bash");
    let out = pyrometer(&["completions", "bash"]);
    assert_ok(&out);
    let script = dir.join("pyrometer.bash");
    std::fs::write(&script, &out.stdout).unwrap();

    let (spec, words) = bash_complete(&script, &["pyrometer", "re"]);
    assert!(spec.contains("-F _pyrometer pyrometer"), "{spec}");
    assert_eq!(words, ["record", "report"]);
    let (_, words) = bash_complete(&script, &["pyrometer", "to"]);
    assert_eq!(words, ["top"]);
    let (_, words) = bash_complete(&script, &["pyrometer", "top", "--fr"]);
    assert_eq!(words, ["--frequency", "--frames"]);
    // The hidden man-page writer is not offered.
    let (_, words) = bash_complete(&script, &["pyrometer", "m"]);
    assert!(words.is_empty(), "{words:?}");
}

#[test]
fn zsh_and_fish_scripts_and_a_bad_shell() {
    let zsh = pyrometer(&["completions", "zsh"]);
    assert_ok(&zsh);
    let zsh = String::from_utf8_lossy(&zsh.stdout).into_owned();
    assert!(
        zsh.starts_with("#compdef pyrometer") && zsh.contains("'--frames=["),
        "{zsh:.200}"
    );
    let fish = pyrometer(&["completions", "fish"]);
    assert_ok(&fish);
    let fish = String::from_utf8_lossy(&fish.stdout).into_owned();
    assert!(
        fish.contains("complete -c pyrometer") && fish.contains("-a \"top\""),
        "{fish:.300}"
    );
    let bad = pyrometer(&["completions", "tcsh"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("possible values: bash, zsh, fish"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn man_pages_cover_every_command() {
    let dir = scratch("man-pages");
    assert_ok(&pyrometer(&["man", "--out-dir", dir.to_str().unwrap()]));
    let collector = Command::new(pyrometer_bin().with_file_name("pyrometer-collector"))
        .arg("--man-dir")
        .arg(&dir)
        .output()
        .expect("run pyrometer-collector");
    assert_ok(&collector);
    for page in [
        "pyrometer",
        "pyrometer-record",
        "pyrometer-report",
        "pyrometer-agent",
        "pyrometer-diff",
        "pyrometer-gpu",
        "pyrometer-dump",
        "pyrometer-top",
        "pyrometer-completions",
        "pyrometer-collector",
    ] {
        let text = std::fs::read_to_string(dir.join(format!("{page}.1")))
            .unwrap_or_else(|e| panic!("{page}.1: {e}"));
        assert!(
            text.contains(&format!(".TH {page} 1")),
            "{page}.1 has no title:\n{text:.300}"
        );
    }
    assert!(
        !dir.join("pyrometer-man.1").exists(),
        "the hidden command gets no page"
    );
    // Rendered as `man` would, the options are there.
    let groff = Command::new("groff")
        .args(["-man", "-Tascii", "-P", "-cbu"])
        .arg(dir.join("pyrometer-record.1"))
        .output();
    match groff {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                text.contains("--off-cpu") && text.contains("--frames"),
                "{text:.500}"
            );
        }
        _ => println!("groff is not installed: the pages were checked as roff source only"),
    }
}
