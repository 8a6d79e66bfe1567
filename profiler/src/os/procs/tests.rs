use super::*;
use crate::symbolize::testutil::{TempDir, compile_c};
use std::process::{Command, Stdio};

#[test]
fn parses_maps_lines() {
    let m = parse_maps_line(
        "7f1c2a428000-7f1c2a57d000 r-xp 00026000 fd:01 1835043                    /usr/lib/x86_64-linux-gnu/libc.so.6",
    )
    .unwrap();
    assert!(m.executable);
    let m = m.mapping;
    assert_eq!(
        (m.start, m.end, m.offset),
        (0x7f1c2a428000, 0x7f1c2a57d000, 0x26000)
    );
    assert_eq!((m.major, m.minor, m.inode), (0xfd, 1, 1835043));
    assert_eq!(m.path, "/usr/lib/x86_64-linux-gnu/libc.so.6");
    assert_eq!(m.kind, MappingKind::File);
    assert_eq!(m.basename(), "libc.so.6");

    let anon = parse_maps_line("7f00-8f00 rwxp 00000000 00:00 0 ").unwrap();
    assert_eq!(
        (anon.mapping.kind, anon.mapping.path.as_str()),
        (MappingKind::Anon, "[anon]")
    );
    let vdso = parse_maps_line("7ffd1000-7ffd3000 r-xp 00000000 00:00 0  [vdso]").unwrap();
    assert_eq!(vdso.mapping.kind, MappingKind::Vdso);
    let spaced = parse_maps_line("1000-2000 r-xp 00000000 08:01 12 /opt/my lib.so (deleted)")
        .unwrap()
        .mapping;
    assert_eq!(spaced.path, "/opt/my lib.so (deleted)");
    assert!(spaced.deleted);
    assert!(
        !parse_maps_line("1000-2000 r--p 00000000 08:01 12 /x")
            .unwrap()
            .executable
    );
    assert!(parse_maps_line("garbage").is_none());
    assert_eq!(parse_ns_pid("Name:\tx\nNSpid:\t4242\t7\n"), Some(7));
}

#[test]
fn unknown_pid_is_no_such_process() {
    // pid_max itself is never a valid pid (pids are below it).
    let pid_max: u32 = fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut reg = ProcessRegistry::new();
    let err = reg.observe(pid_max).unwrap_err();
    assert!(matches!(err, ProcError::NoSuchProcess(p) if p == pid_max));
    assert_eq!(err.to_string(), format!("no such process: {pid_max}"));
    assert!(reg.get(pid_max).is_none());
}

#[test]
fn live_child_libc_mapping_has_build_id_and_survives_exit() {
    let mut child = Command::new("sleep")
        .arg("5")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // The exec may not have happened yet; wait until the maps show sleep's libc.
    let mut reg = ProcessRegistry::new();
    reg.set_refresh_interval(Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        reg.refresh(pid).unwrap();
        let p = reg.get(pid).unwrap();
        if p.mappings().iter().any(|m| m.path.contains("libc.so")) {
            break;
        }
        assert!(Instant::now() < deadline, "no libc in {:?}", p.mappings());
        std::thread::sleep(Duration::from_millis(10));
    }
    let p = reg.get(pid).unwrap();
    let libc = p
        .mappings()
        .iter()
        .find(|m| m.path.contains("libc.so"))
        .unwrap()
        .clone();
    assert_eq!(libc.kind, MappingKind::File);
    let id = libc.build_id().expect("libc has a build-id");
    assert!(
        id.len() >= 16 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    let (found, off) = reg.find(pid, libc.start + 0x10).unwrap();
    assert_eq!(found.start, libc.start);
    assert_eq!(off, libc.offset + 0x10);
    assert!(reg.find(pid, 1).is_none());

    // Our own libc is the same file: one shared Binary.
    let me = reg.observe(std::process::id()).unwrap();
    let mine = me
        .mappings()
        .iter()
        .find(|m| m.path.contains("libc.so"))
        .unwrap();
    assert!(Arc::ptr_eq(mine.binary().unwrap(), libc.binary().unwrap()));

    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!reg.refresh(pid).unwrap());
    let p = reg.get(pid).unwrap();
    assert!(p.exited());
    assert!(
        reg.find(pid, libc.start).is_some(),
        "mappings kept after exit"
    );
}

/// A fake /proc with one process whose maps we control.
fn fake_proc(tmp: &TempDir, pid: u32, maps: &str) -> PathBuf {
    let dir = tmp.path().join("proc").join(pid.to_string());
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("maps"), maps).unwrap();
    fs::write(dir.join("comm"), "fake\n").unwrap();
    tmp.path().join("proc")
}

#[test]
fn refresh_is_rate_limited_and_keeps_unloaded_mappings() {
    let tmp = TempDir::new("procs-refresh");
    let root = fake_proc(&tmp, 7, "1000-2000 r-xp 00000000 00:00 0 \n");
    let mut reg = ProcessRegistry::with_proc_root(&root);
    reg.set_refresh_interval(Duration::from_secs(3600));
    let p = reg.observe(7).unwrap();
    assert_eq!(p.comm, "fake");
    assert_eq!(p.mappings().len(), 1);
    // Past its young phase, whose short interval a slow machine would otherwise outlast.
    if let Some(aged) = Instant::now().checked_sub(YOUNG * 2) {
        reg.processes.get_mut(&7).unwrap().first_read = aged;
    }
    fs::write(root.join("7/maps"), "3000-4000 r-xp 00000000 00:00 0 \n").unwrap();
    assert!(!reg.refresh(7).unwrap(), "rate limited");
    assert!(reg.find(7, 0x3000).is_none());
    reg.set_refresh_interval(Duration::ZERO);
    assert!(reg.refresh(7).unwrap());
    assert!(reg.find(7, 0x3500).is_some());
    assert!(reg.find(7, 0x1500).is_some(), "vanished mapping kept");
    fs::remove_dir_all(root.join("7")).unwrap();
    assert!(!reg.refresh(7).unwrap());
    assert!(reg.get(7).unwrap().exited());
}

/// A process read at its exec maps only its program and the dynamic loader until the loader
/// has mapped its libraries; a static program, or one with its libraries, is not loading.
#[test]
fn loading_is_the_loader_alone_beside_the_program() {
    let tmp = TempDir::new("procs-loading");
    let program = "1000-2000 r-xp 00000000 08:01 11 /usr/bin/prog\n";
    let loader =
        "5000-6000 r-xp 00001000 08:01 12 /usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2\n";
    let vdso = "7000-8000 r-xp 00000000 00:00 0  [vdso]\n";
    let libc = "9000-a000 r-xp 00028000 08:01 13 /usr/lib/x86_64-linux-gnu/libc.so.6\n";
    let root = fake_proc(&tmp, 9, &format!("{program}{loader}{vdso}"));
    std::os::unix::fs::symlink("/usr/bin/prog", root.join("9/exe")).unwrap();
    let mut reg = ProcessRegistry::with_proc_root(&root);
    reg.set_refresh_interval(Duration::ZERO);
    assert!(reg.observe(9).unwrap().loading(), "at exec");
    fs::write(
        root.join("9/maps"),
        format!("{program}{loader}{vdso}{libc}"),
    )
    .unwrap();
    if let Some(aged) = Instant::now().checked_sub(YOUNG * 2) {
        reg.processes.get_mut(&9).unwrap().first_read = aged;
    }
    assert!(reg.refresh(9).unwrap());
    assert!(!reg.get(9).unwrap().loading(), "with its libc");
    let root = fake_proc(&tmp, 10, program);
    std::os::unix::fs::symlink("/usr/bin/prog", root.join("10/exe")).unwrap();
    assert!(!reg.observe(10).unwrap().loading(), "a static program");
}

#[test]
fn forget_exited_drops_gone_processes_and_their_binaries() {
    let tmp = TempDir::new("procs-forget");
    let root = fake_proc(&tmp, 7, "1000-2000 r-xp 00000000 fd:07 11 /opt/a\n");
    fake_proc(&tmp, 8, "1000-2000 r-xp 00000000 fd:07 12 /opt/b\n");
    fs::write(root.join("7/stat"), "7 (fake) S 1 7 7").unwrap();
    // A zombie has exited too.
    fs::write(root.join("8/stat"), "8 (fake) Z 1 8 8").unwrap();
    let mut reg = ProcessRegistry::with_proc_root(&root);
    reg.observe(7).unwrap();
    reg.observe(8).unwrap();
    assert_eq!(reg.binaries.len(), 2);
    assert_eq!(reg.forget_exited(), 1);
    assert!(reg.get(7).is_some());
    assert!(reg.get(8).is_none());
    assert_eq!(
        reg.binaries.len(),
        1,
        "the binary only pid 8 mapped is forgotten"
    );
    assert!(reg.find(7, 0x1000).is_some());
    // A pid reused later is read afresh.
    fs::write(root.join("8/stat"), "8 (fake) S 1 8 8").unwrap();
    fs::write(root.join("8/maps"), "5000-6000 r-xp 00000000 00:00 0 \n").unwrap();
    assert!(reg.observe(8).unwrap().find(0x5000).is_some());
}

#[test]
fn binary_resolves_through_process_root() {
    let tmp = TempDir::new("procs-root");
    let prog = compile_c(
        &tmp,
        "p",
        "int main(void) { return 0; }",
        &["-Wl,--build-id"],
    );
    // The file only exists inside the "container" root, at a path absent on the host.
    let rootfs = tmp.path().join("rootfs");
    fs::create_dir_all(rootfs.join("opt/app")).unwrap();
    fs::copy(&prog, rootfs.join("opt/app/p")).unwrap();
    let maps = format!(
        "1000-2000 r-xp 00001000 {} /opt/app/p\n",
        identity(&rootfs.join("opt/app/p"))
    );
    let proc_root = fake_proc(&tmp, 9, &maps);
    std::os::unix::fs::symlink(&rootfs, proc_root.join("9/root")).unwrap();
    let mut reg = ProcessRegistry::with_proc_root(&proc_root);
    reg.observe(9).unwrap();
    let (m, off) = reg.find(9, 0x1010).unwrap();
    assert_eq!(off, 0x1010);
    assert_eq!(m.path, "/opt/app/p");
    assert_eq!(m.build_id(), read_build_id(&prog).as_deref());
    assert!(m.build_id().is_some());
    // Its debug files are looked for in its own root first, then the host's.
    fs::create_dir_all(rootfs.join("usr/lib/debug/.build-id")).unwrap();
    let dirs = m
        .binary()
        .unwrap()
        .debug_dirs(&[PathBuf::from("/usr/lib/debug")]);
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    assert!(dirs[0].join(".build-id").is_dir(), "{dirs:?}");
    assert_eq!(dirs[2], Path::new("/usr/lib/debug"));
    // A chroot's mappings carry its root's path in front: debuglinks are looked up by
    // the path inside.
    let inside = format!("{}/opt/app/p", rootfs.display());
    assert_eq!(m.binary().unwrap().seen_path(&inside), "/opt/app/p");
    assert_eq!(m.binary().unwrap().seen_path("/opt/app/p"), "/opt/app/p");
    // Still readable once the root is gone (the process exited).
    fs::remove_file(proc_root.join("9/root")).unwrap();
    let b = m.binary().unwrap();
    assert!(fs::metadata(b.path()).is_ok(), "{}", b.path().display());
    assert!(
        b.debug_dirs(&[])[0].join(".build-id").is_dir(),
        "root held open"
    );

    // Without a readable root the plain path is used.
    let maps = format!(
        "1000-2000 r-xp 00000000 {} {}\n",
        identity(&prog),
        prog.display()
    );
    let proc_root2 = tmp.path().join("proc2");
    fs::create_dir_all(proc_root2.join("5")).unwrap();
    fs::write(proc_root2.join("5/maps"), maps).unwrap();
    let mut reg = ProcessRegistry::with_proc_root(&proc_root2);
    reg.observe(5).unwrap();
    let (m, _) = reg.find(5, 0x1000).unwrap();
    assert_eq!(m.binary().unwrap().path(), prog.as_path());
}

/// A file's `major:minor inode` as a maps line carries them.
fn identity(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(path).unwrap();
    format!(
        "{:02x}:{:02x} {}",
        libc::major(m.dev()),
        libc::minor(m.dev()),
        m.ino()
    )
}

/// A library replaced after the process mapped it (renamed over, as an attacker or an
/// upgrade would), or a link planted at its path, is not read: the binary has no readable
/// path and no build-id.
#[test]
fn a_binary_replaced_after_mapping_is_not_read() {
    let tmp = TempDir::new("procs-replaced");
    let prog = compile_c(
        &tmp,
        "p",
        "int main(void) { return 0; }",
        &["-Wl,--build-id"],
    );
    let rootfs = tmp.path().join("rootfs");
    fs::create_dir_all(rootfs.join("opt/app")).unwrap();
    let lib = rootfs.join("opt/app/p");
    fs::copy(&prog, &lib).unwrap();
    let maps = format!("1000-2000 r-xp 00000000 {} /opt/app/p\n", identity(&lib));
    let other = compile_c(
        &tmp,
        "q",
        "int other(void) { return 1; }",
        &["-shared", "-Wl,--build-id"],
    );
    fs::copy(&other, rootfs.join("opt/app/q")).unwrap();
    fs::rename(rootfs.join("opt/app/q"), &lib).unwrap();
    let proc_root = fake_proc(&tmp, 9, &maps);
    std::os::unix::fs::symlink(&rootfs, proc_root.join("9/root")).unwrap();
    let mut reg = ProcessRegistry::with_proc_root(&proc_root);
    reg.observe(9).unwrap();
    let (m, _) = reg.find(9, 0x1010).unwrap();
    assert_eq!(
        m.build_id(),
        None,
        "the replacement's build-id was believed"
    );
    assert_eq!(m.binary().unwrap().path(), Path::new(""));

    // A link where the library was: not followed, even to the very file mapped.
    fs::remove_file(&lib).unwrap();
    std::os::unix::fs::symlink(&prog, &lib).unwrap();
    let maps = format!("1000-2000 r-xp 00000000 {} /opt/app/p\n", identity(&prog));
    fs::write(proc_root.join("9/maps"), maps).unwrap();
    reg.forget(9);
    let mut reg = ProcessRegistry::with_proc_root(&proc_root);
    reg.observe(9).unwrap();
    let (m, _) = reg.find(9, 0x1010).unwrap();
    assert_eq!(m.build_id(), None);
}

#[test]
fn exe_key_is_the_running_program_without_reading_the_whole_map() {
    let reg = ProcessRegistry::new();
    let exe = std::env::current_exe().unwrap();
    assert_eq!(
        reg.exe_key(std::process::id()),
        Some(BinaryKey::of_file(&exe).unwrap())
    );
    // Only the first line is read: a map whose first mapping is anonymous names nothing.
    let tmp = TempDir::new("exe-key");
    let root = fake_proc(
        &tmp,
        7,
        "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n\
         55d000000000-55d000001000 r-xp 00000000 08:01 42 /usr/bin/prog\n",
    );
    assert_eq!(ProcessRegistry::with_proc_root(&root).exe_key(7), None);
    assert_eq!(ProcessRegistry::with_proc_root(&root).exe_key(8), None);
}
