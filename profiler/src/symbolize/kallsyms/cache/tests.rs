use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::super::Kallsyms;
use super::*;

const TEXT: &str = "\
ffffffff81000000 T _stext
ffffffff81000100 T first
ffffffff81000200 t second
ffffffff81400000 D some_data
ffffffff81800000 T _etext
ffffffffc0001000 t mod_fn\t[nf_tables]
ffffffffc0100000 t bpf_prog_1234_handler\t[bpf]
ffffffffc0200000 t ftrace_trampoline\t[__builtin__ftrace]
";

/// nf_tables at 0xffffffffc0001000, 0x2000 bytes.
const MODULES: &str = "nf_tables 8192 3 - Live 0xffffffffc0001000\n";

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn setup(name: &str) -> (Dir, PathBuf, CacheSpec) {
    let dir = std::env::temp_dir().join(format!("pyrometer-ksym-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let text = dir.join("kallsyms");
    fs::write(&text, TEXT).unwrap();
    let spec = CacheSpec::new(dir.join("root/cache"), "0a1b-2c3d", "6.18.0", MODULES).unwrap();
    (Dir(dir), text, spec)
}

fn privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The first run reads the text and writes the file; the next answers from the file for the
/// core text and the modules, and reads the text only for an address outside them (a BPF
/// program), which it then names as the text does.
#[test]
fn the_second_run_reads_the_file_and_the_text_only_outside_what_it_covers() {
    let (_dir, text, spec) = setup("round");
    let first = Kallsyms::load(&text, Some(&spec));
    assert!(!first.came_from_cache());
    assert!(spec.path().exists(), "the file is written");
    // The cache root is shared with what other users must reach; this directory is root's.
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(spec.dir.parent().unwrap()), 0o755);
    assert_eq!(mode(&spec.dir), 0o700);

    let k = Kallsyms::load(&text, Some(&spec));
    assert!(k.came_from_cache());
    assert_eq!(k.lookup(0xffffffff81000150), Some("first"));
    assert_eq!(k.lookup(0xffffffff81000250), Some("second"));
    assert_eq!(k.lookup(0xffffffffc0001010), Some("mod_fn [nf_tables]"));
    assert!(!k.read_in_full(), "covered addresses need no read");
    assert_eq!(
        k.lookup(0xffffffffc0100010),
        Some("bpf_prog_1234_handler [bpf]")
    );
    assert!(k.read_in_full());
    assert_eq!(
        k.lookup(0xffffffffc0200004),
        Some("ftrace_trampoline [__builtin__ftrace]")
    );
    // Every address named the same as from the text itself.
    let plain = Kallsyms::parse(TEXT);
    for addr in [
        0xffffffff81000000,
        0xffffffff81000150,
        0xffffffffc0001ff0,
        0xffffffff80000000,
    ] {
        assert_eq!(k.lookup(addr), plain.lookup(addr), "{addr:x}");
    }
}

/// A module loaded or unloaded since, another release or another boot: the file is not used.
#[test]
fn another_module_set_release_or_boot_reads_the_text() {
    let (dir, text, spec) = setup("key");
    Kallsyms::load(&text, Some(&spec));
    let cache = dir.0.join("root/cache");
    let others = [
        CacheSpec::new(cache.clone(), "0a1b-2c3d", "6.18.0", "").unwrap(),
        CacheSpec::new(
            cache.clone(),
            "0a1b-2c3d",
            "6.18.0",
            "nf_tables 8192 3 - Live 0xffffffffc0003000\n",
        )
        .unwrap(),
        CacheSpec::new(cache.clone(), "0a1b-2c3d", "6.18.1", MODULES).unwrap(),
    ];
    for other in &others {
        assert!(other.read().is_none(), "{other:?}");
    }
    // The refcount column alone changes as modules are used: the file still holds.
    let used = CacheSpec::new(
        cache.clone(),
        "0a1b-2c3d",
        "6.18.0",
        "nf_tables 8192 9 - Live 0xffffffffc0001000\n",
    )
    .unwrap();
    assert!(used.read().is_some());
    // Another boot writes its own file and removes the earlier boot's.
    let next = CacheSpec::new(cache.clone(), "ffff-0000", "6.18.0", MODULES).unwrap();
    assert!(next.read().is_none());
    Kallsyms::load(&text, Some(&next));
    assert!(next.read().is_some() && !spec.path().exists());
    assert!(CacheSpec::new(cache, "../etc", "6.18.0", "").is_none());
}

/// A file cut short, with a byte changed anywhere, or unsorted is not used, and the text is
/// read instead; so is one others could have written, or a link.
#[test]
fn a_damaged_or_unsafe_file_is_not_used() {
    let (_dir, text, spec) = setup("bad");
    Kallsyms::load(&text, Some(&spec));
    let good = fs::read(spec.path()).unwrap();
    let (table, covered) = decode(&good, &spec.key).unwrap();
    assert_eq!(
        table.len(),
        5,
        "core and module code, no data or dynamic symbols"
    );
    assert_eq!(covered.len(), 2);
    for cut in [0, 7, 20, good.len() / 2, good.len() - 1] {
        assert!(decode(&good[..cut], &spec.key).is_none(), "cut at {cut}");
    }
    let mut longer = good.clone();
    longer.push(0);
    assert!(decode(&longer, &spec.key).is_none());
    // Every byte changed, one at a time: refused or still a well-formed table (a changed
    // address or name), never a panic or an out-of-bounds name.
    for i in 0..good.len() {
        let mut bad = good.clone();
        bad[i] ^= 0x80;
        if let Some((t, _)) = decode(&bad, &spec.key) {
            for j in 0..t.len() {
                let _ = t.name(j);
            }
        }
    }
    let unsorted = encode(
        &Table {
            addrs: vec![2, 1],
            ends: vec![1, 2],
            names: "ab".into(),
        },
        &[(0, 10)],
        &spec.key,
    );
    assert!(decode(&unsorted, &spec.key).is_none());

    fs::set_permissions(spec.path(), fs::Permissions::from_mode(0o666)).unwrap();
    assert!(spec.read().is_none(), "writable by others");
    fs::set_permissions(spec.path(), fs::Permissions::from_mode(0o600)).unwrap();
    assert!(spec.read().is_some());
    fs::set_permissions(&spec.dir, fs::Permissions::from_mode(0o777)).unwrap();
    assert!(spec.read().is_none(), "a directory others can write to");
    fs::set_permissions(&spec.dir, fs::Permissions::from_mode(0o700)).unwrap();
    if privileged() {
        std::os::unix::fs::chown(spec.path(), Some(65534), None).unwrap();
        assert!(spec.read().is_none(), "owned by another user");
    }
    fs::remove_file(spec.path()).unwrap();
    std::os::unix::fs::symlink(&text, spec.path()).unwrap();
    assert!(spec.read().is_none(), "a link");
    let k = Kallsyms::load(&text, Some(&spec));
    assert!(!k.came_from_cache());
    assert_eq!(k.lookup(0xffffffff81000150), Some("first"));
}

/// This machine's own kallsyms, through the file: the same names as read directly.
#[test]
fn the_hosts_symbols_through_the_file_are_those_of_kallsyms() {
    let host = Path::new("/proc/kallsyms");
    let direct = Kallsyms::load(host, None);
    if direct.is_empty() || direct.restricted {
        skip_ledger::skip(
            "kallsyms",
            "/proc/kallsyms shows no addresses here (not root, or kptr_restrict)",
        );
        return;
    }
    let (dir, _, _) = setup("host");
    let spec = CacheSpec::of_host(dir.0.join("cache")).expect("a boot id");
    Kallsyms::load(host, Some(&spec));
    let cached = Kallsyms::load(host, Some(&spec));
    assert!(cached.came_from_cache());
    let text = fs::read_to_string(host).unwrap();
    let mut checked = 0;
    for line in text.lines().step_by(97) {
        let Some(addr) = line.split_whitespace().next() else {
            continue;
        };
        let addr = u64::from_str_radix(addr, 16).unwrap() + 1;
        assert_eq!(cached.lookup(addr), direct.lookup(addr), "{line}");
        checked += 1;
    }
    assert!(checked > 100, "{checked} addresses checked");
}
