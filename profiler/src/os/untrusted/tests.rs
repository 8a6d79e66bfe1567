use super::*;
use crate::symbolize::testutil::TempDir;
use std::os::unix::fs::symlink;

/// A root with `tmp/` in it, and a host directory beside it holding a canary file.
fn layout(tag: &str) -> (TempDir, Root, PathBuf) {
    let tmp = TempDir::new(tag);
    std::fs::create_dir_all(tmp.path().join("root/tmp")).unwrap();
    std::fs::create_dir_all(tmp.path().join("host")).unwrap();
    let canary = tmp.path().join("host/perf-1.map");
    std::fs::write(&canary, "1000 100 host_canary_symbol\n").unwrap();
    let root = Root::open(&tmp.path().join("root")).unwrap();
    (tmp, root, canary)
}

fn open_map(root: &Root) -> Result<UntrustedFile, UntrustedError> {
    UntrustedFile::open_in_root(root, Path::new("/tmp/perf-1.map"), Kind::PerfMap)
}

#[test]
fn a_regular_file_inside_the_root_is_read() {
    let (tmp, root, _) = layout("plain");
    std::fs::write(tmp.path().join("root/tmp/perf-1.map"), "1000 10 jit_fn\n").unwrap();
    let f = open_map(&root).unwrap();
    assert_eq!(f.read_text().unwrap(), "1000 10 jit_fn\n");
    assert!(
        open_map(&Root::open(&tmp.path().join("host")).unwrap())
            .unwrap_err()
            .is_not_found()
    );
}

#[test]
fn a_fifo_opens_at_once_and_is_refused() {
    let (tmp, root, _) = layout("fifo");
    let fifo = cstring(&tmp.path().join("root/tmp/perf-1.map")).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    // No writer ever opens it: a blocking open would never return.
    match open_map(&root) {
        Err(UntrustedError::NotRegular { what: "FIFO", .. }) => {}
        other => panic!("expected a FIFO refusal, got {other:?}"),
    }
}

#[test]
fn a_link_to_dev_zero_is_refused() {
    let (tmp, root, _) = layout("zero");
    symlink("/dev/zero", tmp.path().join("root/tmp/perf-1.map")).unwrap();
    assert!(matches!(open_map(&root), Err(UntrustedError::Link { .. })));
    // A device reached without a link (a bind mount, a device node) is no regular file.
    let dev = Root::open(Path::new("/dev")).unwrap();
    match UntrustedFile::open_in_root(&dev, Path::new("zero"), Kind::PerfMap) {
        Err(UntrustedError::NotRegular {
            what: "character device",
            ..
        }) => {}
        other => panic!("expected a device refusal, got {other:?}"),
    }
}

#[test]
fn absolute_and_dotdot_links_do_not_leave_the_root() {
    let (tmp, root, canary) = layout("escape");
    let map = tmp.path().join("root/tmp/perf-1.map");
    // The file itself a link, absolute or relative: refused.
    symlink(&canary, &map).unwrap();
    assert!(matches!(open_map(&root), Err(UntrustedError::Link { .. })));
    std::fs::remove_file(&map).unwrap();
    symlink("../../host/perf-1.map", &map).unwrap();
    assert!(matches!(open_map(&root), Err(UntrustedError::Link { .. })));
    // A directory on the way a link: resolved inside the root, where no canary is.
    std::fs::remove_file(&map).unwrap();
    std::fs::remove_dir(tmp.path().join("root/tmp")).unwrap();
    symlink(tmp.path().join("host"), tmp.path().join("root/tmp")).unwrap();
    // (The test's directory lies under /tmp, so inside the root the link meets itself.)
    let r = open_map(&root);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.is_not_found() || matches!(e, UntrustedError::Link { .. })),
        "{r:?}"
    );
    std::fs::remove_file(tmp.path().join("root/tmp")).unwrap();
    symlink("../../../../../../../../host", tmp.path().join("root/tmp")).unwrap();
    let r = open_map(&root);
    // A perf map is reached through no link at all.
    assert!(matches!(r, Err(UntrustedError::Link { .. })), "{r:?}");
    let r = UntrustedFile::open_in_root(&root, Path::new("/tmp/perf-1.map"), Kind::ProcText);
    assert!(r.as_ref().is_err_and(|e| e.is_not_found()), "{r:?}");
    // `..` in the path asked for is clamped at the root too.
    let dotdot = UntrustedFile::open_in_root(&root, Path::new("../host/perf-1.map"), Kind::PerfMap);
    assert!(dotdot.unwrap_err().is_not_found());
    // The same canary is readable from the host: the refusals above are the layer's doing.
    let host = Root::open(tmp.path()).unwrap();
    let f = UntrustedFile::open_in_root(&host, Path::new("host/perf-1.map"), Kind::PerfMap);
    assert!(
        f.unwrap()
            .read_text()
            .unwrap()
            .contains("host_canary_symbol")
    );
}

#[test]
fn files_over_the_cap_are_refused_before_reading() {
    let (tmp, root, _) = layout("big");
    let f = File::create(tmp.path().join("root/tmp/perf-1.map")).unwrap();
    f.set_len(Kind::PerfMap.cap() + 1).unwrap();
    assert!(matches!(
        open_map(&root),
        Err(UntrustedError::TooBig { size, .. }) if size == Kind::PerfMap.cap() + 1
    ));
    // A 4 GB sparse file named like libpython costs nothing to refuse.
    let lib = tmp.path().join("root/libpython3.12.so.1.0");
    File::create(&lib).unwrap().set_len(4 << 30).unwrap();
    for kind in [Kind::Elf, Kind::ElfWhole] {
        let r = UntrustedFile::open_in_root(&root, Path::new("libpython3.12.so.1.0"), kind);
        assert!(matches!(r, Err(UntrustedError::TooBig { .. })), "{kind:?}");
    }
}

#[test]
fn a_file_growing_past_the_cap_while_read_is_refused() {
    let (tmp, root, _) = layout("grow");
    let path = tmp.path().join("root/tmp/perf-1.map");
    std::fs::write(&path, "1000 10 f\n").unwrap();
    let f = open_map(&root).unwrap();
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(Kind::PerfMap.cap() + 10)
        .unwrap();
    assert!(matches!(f.read_bytes(), Err(UntrustedError::TooBig { .. })));
}

#[test]
fn proc_text_is_cut_at_the_cap() {
    let (tmp, _root, _) = layout("proc");
    let path = tmp.path().join("environ");
    std::fs::write(&path, vec![b'x'; Kind::ProcText.cap() as usize * 2]).unwrap();
    let f = UntrustedFile::open(&path, Kind::ProcText).unwrap();
    assert_eq!(f.read_bytes().unwrap().len() as u64, Kind::ProcText.cap());
    let cmdline = UntrustedFile::open(Path::new("/proc/self/cmdline"), Kind::ProcText).unwrap();
    assert!(!cmdline.read_bytes().unwrap().is_empty());
    // Magic links are refused even on the host side.
    let magic = UntrustedFile::open(Path::new("/proc/self/exe"), Kind::Elf);
    assert!(
        matches!(magic, Err(UntrustedError::Link { .. })),
        "{magic:?}"
    );
}

#[test]
fn a_file_replaced_after_it_was_mapped_is_not_believed() {
    let (tmp, root, _) = layout("replaced");
    let lib = tmp.path().join("root/libx.so");
    std::fs::write(&lib, b"original").unwrap();
    let meta = std::fs::metadata(&lib).unwrap();
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let first = UntrustedFile::open_in_root(&root, Path::new("/libx.so"), Kind::Elf).unwrap();
    first.expect_mapped(major, minor, meta.ino()).unwrap();
    // Replaced the way an attacker (or a package upgrade) would: a new file renamed over it.
    std::fs::write(tmp.path().join("root/new"), b"replaced").unwrap();
    std::fs::rename(tmp.path().join("root/new"), &lib).unwrap();
    let second = UntrustedFile::open_in_root(&root, Path::new("/libx.so"), Kind::Elf).unwrap();
    assert!(matches!(
        second.expect_mapped(major, minor, meta.ino()),
        Err(UntrustedError::Replaced { .. })
    ));
    // The held descriptor still opens the original.
    let held = first.into_file();
    let own = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
    let again = UntrustedFile::open_resolved(&own, Kind::Elf).unwrap();
    assert_eq!(again.read_bytes().unwrap(), b"original");
}

/// An ELF object of the machine's with CFI, copied to a file the test may truncate.
fn elf_fixture(dir: &Path) -> PathBuf {
    let src = ["/usr/bin/true", "/bin/true", "/usr/bin/ls"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .expect("a system binary");
    let dst = dir.join("victim");
    std::fs::copy(src, &dst).unwrap();
    dst
}

#[test]
fn a_file_truncated_while_parsed_is_an_error_not_a_sigbus() {
    let tmp = TempDir::new("truncate");
    let path = elf_fixture(tmp.path());
    let root = Root::open(tmp.path()).unwrap();
    let f = UntrustedFile::open_in_root(&root, Path::new("victim"), Kind::Elf).unwrap();
    // Another reader maps the file, as blazesym or a plain mmap reader would.
    // SAFETY: a read-only mapping of the test's own file, dropped before it is truncated.
    let mapped = unsafe { memmap2::Mmap::map(&File::open(&path).unwrap()).unwrap() };
    let copy = f
        .copy_elf_sections(&[".eh_frame", ".note.gnu.build-id"])
        .unwrap();
    let size = f.size();
    let eh_frame = |data: &[u8]| -> Vec<u8> {
        use object::{Object, ObjectSection};
        let obj = object::File::parse(data).unwrap();
        obj.section_by_name(".eh_frame")
            .unwrap()
            .data()
            .unwrap()
            .to_vec()
    };
    let before = eh_frame(&copy);
    assert!(!before.is_empty());
    assert_eq!(&before[..], {
        let obj = object::File::parse(&mapped[..]).unwrap();
        use object::{Object, ObjectSection};
        obj.section_by_name(".eh_frame").unwrap().data().unwrap()
    });
    drop(mapped);
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(200)
        .unwrap();
    // The copy is the profiler's: parsing it after the truncation still works; touching the
    // file's own pages now (a mapping of it) would raise SIGBUS.
    assert_eq!(eh_frame(&copy), before);
    assert_eq!(copy.len() as u64, size);
    // Copying from the truncated file is an error.
    let again = f.copy_elf_sections(&[".eh_frame"]);
    assert!(
        matches!(
            again,
            Err(UntrustedError::Truncated { .. } | UntrustedError::Malformed { .. })
        ),
        "{again:?}"
    );
    assert!(matches!(f.copy(), Err(UntrustedError::Truncated { .. })));
}

#[test]
fn a_sparse_copy_reads_only_the_sections_asked_for() {
    let tmp = TempDir::new("sparse");
    let path = elf_fixture(tmp.path());
    let f = UntrustedFile::open(&path, Kind::Elf).unwrap();
    let copy = f.copy_elf_sections(&[".eh_frame"]).unwrap();
    let whole = f.copy().unwrap();
    use object::{Object, ObjectSection};
    let sparse = object::File::parse(&copy[..]).unwrap();
    let full = object::File::parse(&whole[..]).unwrap();
    let data =
        |o: &object::File<'_>, n: &str| o.section_by_name(n).unwrap().data().unwrap().to_vec();
    assert_eq!(data(&sparse, ".eh_frame"), data(&full, ".eh_frame"));
    let text = data(&sparse, ".text");
    assert!(text.iter().all(|&b| b == 0), ".text was not asked for");
    assert!(data(&full, ".text").iter().any(|&b| b != 0));
}

/// A path below a held root (`/proc/self/fd/N/…`, as debug directories inside a container
/// are named) is resolved inside that root: an absolute link there does not reach the host.
#[test]
fn paths_below_a_held_root_stay_inside_it() {
    let (tmp, _, _) = layout("held");
    let root_dir = tmp.path().join("root");
    std::fs::create_dir_all(root_dir.join("usr/lib/debug")).unwrap();
    std::fs::create_dir_all(root_dir.join("sub")).unwrap();
    std::fs::write(root_dir.join("sub/inside"), b"inside").unwrap();
    std::fs::create_dir_all(tmp.path().join("hostdir")).unwrap();
    std::fs::write(tmp.path().join("hostdir/secret"), b"host").unwrap();
    symlink(
        tmp.path().join("hostdir"),
        root_dir.join("usr/lib/debug/abs"),
    )
    .unwrap();
    symlink("/sub", root_dir.join("usr/lib/debug/rel")).unwrap();
    let held = File::open(&root_dir).unwrap();
    let base = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
    let read = |p: &str| {
        UntrustedFile::open_resolved(&base.join(p), Kind::ProcText).and_then(|f| f.read_bytes())
    };
    assert_eq!(read("sub/inside").unwrap(), b"inside");
    assert_eq!(read("usr/lib/debug/rel/inside").unwrap(), b"inside");
    // The host directory's path, taken inside the root, is not there.
    let r = read("usr/lib/debug/abs/secret");
    assert!(r.as_ref().is_err_and(UntrustedError::is_not_found), "{r:?}");
}
