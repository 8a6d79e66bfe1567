//! Fetching a Debian kernel without installing it. Each suite gets a private apt
//! configuration under `target/kernels/apt/SUITE/` (its own sources list, lists, cache and an
//! empty dpkg status, read through APT_CONFIG), so the machine's apt sources and state are
//! neither read nor changed. `apt-get download` fetches the packages, `dpkg-deb -x` unpacks
//! them into a scratch tree and `depmod -b` writes the modules.dep Debian's packages leave to
//! their postinst. What a boot needs is kept in `target/kernels/NAME/kernel/`: vmlinuz, and
//! the virtio/9p modules in load order, decompressed for busybox's insmod. Once that exists
//! no network is needed (remove the directory to fetch the suite's newest kernel again).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::Kernel;

/// Debian's archive; PYROMETER_DEBIAN_MIRROR points the matrix at another mirror.
const MIRROR: &str = "http://deb.debian.org/debian";
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Modules the initramfs needs to mount the 9p shares, before their dependencies are added
/// from modules.dep. Any of them may be built in (6.12 builds in virtio_pci).
const NEEDED_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Outside our code: the archive cannot be reached or no longer has the kernel.
    #[error("{0}")]
    Unavailable(String),
    #[error("cannot run {cmd}: {source} (run `cargo xtask deps`)")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("{cmd} failed: {detail}")]
    Command { cmd: String, detail: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Layout(String),
}

/// A kernel ready to boot.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub vmlinuz: PathBuf,
    /// Decompressed modules, dependencies first.
    pub modules: Vec<PathBuf>,
    /// The kernel's release (`uname -r`), e.g. 6.1.0-50-amd64.
    pub release: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The cached kernel `kernel`, fetched and unpacked first when absent or of another series
/// than the table pins (a cache made before the table moved).
pub fn prepare(kernel: &Kernel, root: &Path) -> Result<Prepared, FetchError> {
    let mirror = std::env::var("PYROMETER_DEBIAN_MIRROR").unwrap_or_else(|_| MIRROR.into());
    prepare_from(kernel, root, &mirror)
}

fn prepare_from(kernel: &Kernel, root: &Path, mirror: &str) -> Result<Prepared, FetchError> {
    let dir = root.join(kernel.name).join("kernel");
    if let Some(p) = cached(&dir).filter(|p| p.release.starts_with(kernel.series)) {
        return Ok(p);
    }
    let apt = Apt::new(root, kernel.suite, mirror)?;
    apt.update()?;
    let image = apt.newest_image()?;
    if !image
        .strip_prefix("linux-image-")
        .is_some_and(|v| v.starts_with(kernel.series))
    {
        return Err(FetchError::Unavailable(format!(
            "{}'s linux-image-amd64 now points at {image}, not the pinned {} series: update \
             KERNELS in tests/src/kernels/mod.rs",
            kernel.suite,
            kernel.series.trim_end_matches('.')
        )));
    }
    let packages = apt.packages_of(&image)?;
    let debs = root.join(kernel.name).join("debs");
    let _ = fs::remove_dir_all(&debs);
    fs::create_dir_all(&debs).map_err(io(&debs))?;
    apt.download(&packages, &debs)?;
    let tree = root.join(kernel.name).join("unpacked");
    let _ = fs::remove_dir_all(&tree);
    fs::create_dir_all(&tree).map_err(io(&tree))?;
    for entry in fs::read_dir(&debs).map_err(io(&debs))? {
        let deb = entry.map_err(io(&debs))?.path();
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
    }
    let prepared = keep_what_boots(&tree, &dir)?;
    // The debs and the unpacked tree are ~0.5 GB a kernel, the suite's lists and apt's caches
    // ~100 MB; the kept part is ~15 MB. A later fetch updates the lists anyway.
    let _ = fs::remove_dir_all(&tree);
    let _ = fs::remove_dir_all(&debs);
    let _ = fs::remove_dir_all(root.join("apt").join(kernel.suite));
    Ok(prepared)
}

/// The prepared kernel in `dir`, if a complete one is there (`release` is written last).
fn cached(dir: &Path) -> Option<Prepared> {
    let release = fs::read_to_string(dir.join("release")).ok()?;
    let order = fs::read_to_string(dir.join("modules.load")).ok()?;
    Some(Prepared {
        vmlinuz: dir.join("vmlinuz"),
        modules: order.lines().map(|m| dir.join("modules").join(m)).collect(),
        release: release.trim().to_string(),
    })
}

/// Copies vmlinuz and the modules the initramfs loads out of the unpacked `tree` into `dir`.
fn keep_what_boots(tree: &Path, dir: &Path) -> Result<Prepared, FetchError> {
    // bookworm's packages use /lib/modules and /boot, forky's only /usr/lib/modules/RELEASE
    // (vmlinuz there too); bookworm's depmod only looks under BASE/lib/modules.
    if !tree.join("lib").exists() && tree.join("usr/lib/modules").exists() {
        std::os::unix::fs::symlink("usr/lib", tree.join("lib")).map_err(io(tree))?;
    }
    let modules_dir = tree.join("lib/modules");
    let release = fs::read_dir(&modules_dir)
        .map_err(io(&modules_dir))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .ok_or_else(|| FetchError::Layout(format!("no kernel under {}", modules_dir.display())))?;
    let base = modules_dir.join(&release);
    let vmlinuz = [
        tree.join("boot").join(format!("vmlinuz-{release}")),
        base.join("vmlinuz"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| FetchError::Layout(format!("no vmlinuz for {release} in the packages")))?;
    run(Command::new("depmod").arg("-b").arg(tree).arg(&release))?;
    let dep_path = base.join("modules.dep");
    let deps = fs::read_to_string(&dep_path).map_err(io(&dep_path))?;
    let builtin = fs::read_to_string(base.join("modules.builtin")).ok();
    let order = load_order(&deps, builtin.as_deref(), NEEDED_MODULES)?;

    let _ = fs::remove_dir_all(dir);
    let kept = dir.join("modules");
    fs::create_dir_all(&kept).map_err(io(&kept))?;
    fs::copy(&vmlinuz, dir.join("vmlinuz")).map_err(io(&vmlinuz))?;
    let mut names = Vec::new();
    for rel in &order {
        let name = format!("{}.ko", module_name(rel));
        decompress(&base.join(rel), &kept.join(&name))?;
        names.push(name);
    }
    fs::write(dir.join("modules.load"), names.join("\n")).map_err(io(dir))?;
    fs::write(dir.join("release"), &release).map_err(io(dir))?;
    cached(dir).ok_or_else(|| FetchError::Layout(format!("{} is incomplete", dir.display())))
}

/// `kernel/fs/9p/9p.ko.xz` → `9p`; modprobe treats `-` and `_` alike.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// The modules.dep paths to load, each after its dependencies, for `wanted`. A wanted module
/// missing from modules.dep must be built in (modules.builtin says so where the package has
/// one: forky's has none, and then the mount tells).
fn load_order(
    deps: &str,
    builtin: Option<&str>,
    wanted: &[&str],
) -> Result<Vec<String>, FetchError> {
    let table: Vec<(String, Vec<String>)> = deps
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(m, d)| {
            (
                m.trim().to_string(),
                d.split_whitespace().map(str::to_string).collect(),
            )
        })
        .collect();
    let mut order: Vec<String> = Vec::new();
    for want in wanted {
        let Some((path, needs)) = table.iter().find(|(m, _)| module_name(m) == *want) else {
            let known_builtin = builtin.is_none_or(|b| b.lines().any(|l| module_name(l) == *want));
            if known_builtin {
                continue;
            }
            return Err(FetchError::Layout(format!(
                "the kernel has no {want} module, built in or not (a -cloud flavour has no 9p)"
            )));
        };
        // modules.dep lists the whole closure, most basic last.
        for p in needs.iter().rev().chain(std::iter::once(path)) {
            if !order.contains(p) {
                order.push(p.clone());
            }
        }
    }
    Ok(order)
}

/// Copies a module, decompressing .xz/.zst/.gz ones with the Debian tools.
fn decompress(from: &Path, to: &Path) -> Result<(), FetchError> {
    let tool = match from.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => {
            fs::copy(from, to).map_err(io(from))?;
            return Ok(());
        }
    };
    let out = output(Command::new(tool).arg("-dc").arg(from))?;
    fs::write(to, out).map_err(io(to))
}

/// A private apt configuration for one suite.
struct Apt {
    config: PathBuf,
    suite: String,
    mirror: String,
}

impl Apt {
    fn new(root: &Path, suite: &str, mirror: &str) -> Result<Apt, FetchError> {
        let dir = root.join("apt").join(suite);
        for sub in ["lists/partial", "cache/archives/partial", "empty"] {
            fs::create_dir_all(dir.join(sub)).map_err(io(&dir))?;
        }
        let d = dir.display();
        fs::write(
            dir.join("sources.list"),
            format!("deb [signed-by={KEYRING}] {mirror} {suite} main\n"),
        )
        .map_err(io(&dir))?;
        fs::write(dir.join("status"), "").map_err(io(&dir))?;
        // Every Dir:: apt reads points inside `dir` (empty: no /etc/apt/apt.conf.d, no machine
        // sources). The testing suite's Release outlives its Valid-Until on this clock.
        let config = format!(
            "Dir::Etc::Main \"{d}/empty/apt.conf\";\n\
             Dir::Etc::Parts \"{d}/empty\";\n\
             Dir::Etc::SourceList \"{d}/sources.list\";\n\
             Dir::Etc::SourceParts \"{d}/empty\";\n\
             Dir::Etc::Preferences \"{d}/empty/preferences\";\n\
             Dir::Etc::PreferencesParts \"{d}/empty\";\n\
             Dir::State::Lists \"{d}/lists\";\n\
             Dir::State::Status \"{d}/status\";\n\
             Dir::Cache \"{d}/cache\";\n\
             Acquire::Check-Valid-Until \"false\";\n\
             Acquire::Languages \"none\";\n\
             APT::Sandbox::User \"root\";\n"
        );
        let path = dir.join("apt.conf");
        fs::write(&path, config).map_err(io(&path))?;
        Ok(Apt {
            config: path,
            suite: suite.to_string(),
            mirror: mirror.to_string(),
        })
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("APT_CONFIG", &self.config);
        c
    }

    fn update(&self) -> Result<(), FetchError> {
        let out = self
            .cmd("apt-get")
            .args(["-q", "update"])
            .output()
            .map_err(|source| FetchError::Spawn {
                cmd: "apt-get update".into(),
                source,
            })?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        // apt-get update exits 0 even when a source failed; "W:"/"E:" lines say so.
        if !out.status.success() || text.lines().any(|l| l.starts_with("E:")) || {
            text.lines()
                .any(|l| l.starts_with("W:") && l.contains("Failed to fetch"))
        } {
            let why = text
                .lines()
                .filter(|l| l.starts_with("E:") || l.starts_with("W:") || l.starts_with("Err:"))
                .collect::<Vec<_>>()
                .join(" / ");
            return Err(FetchError::Unavailable(format!(
                "cannot fetch the {} index from {}: {why}",
                self.suite, self.mirror
            )));
        }
        Ok(())
    }

    /// `Depends:` of `package` in this suite.
    fn depends(&self, package: &str) -> Result<Vec<String>, FetchError> {
        let out = self
            .cmd("apt-cache")
            .args(["depends", package])
            .output()
            .map_err(|source| FetchError::Spawn {
                cmd: "apt-cache depends".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(FetchError::Unavailable(format!(
                "{} has no package {package}: {}",
                self.suite,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .filter(|d| !d.starts_with('<'))
            .map(str::to_string)
            .collect())
    }

    /// The generic kernel the suite's meta-package depends on, e.g. linux-image-6.1.0-50-amd64.
    fn newest_image(&self) -> Result<String, FetchError> {
        self.depends("linux-image-amd64")?
            .into_iter()
            .find(|d| d.starts_with("linux-image-") && d.ends_with("-amd64"))
            .ok_or_else(|| {
                FetchError::Unavailable(format!(
                    "{}'s linux-image-amd64 names no kernel package",
                    self.suite
                ))
            })
    }

    /// The packages holding the image's files: itself, or (forky) the linux-binary-* and
    /// linux-modules-* packages it depends on.
    fn packages_of(&self, image: &str) -> Result<Vec<String>, FetchError> {
        let split: Vec<String> = self
            .depends(image)?
            .into_iter()
            .filter(|d| d.starts_with("linux-binary-") || d.starts_with("linux-modules-"))
            .collect();
        Ok(if split.is_empty() {
            vec![image.to_string()]
        } else {
            split
        })
    }

    fn download(&self, packages: &[String], into: &Path) -> Result<(), FetchError> {
        let out = self
            .cmd("apt-get")
            .args(["-q", "download"])
            .args(packages)
            .current_dir(into)
            .output()
            .map_err(|source| FetchError::Spawn {
                cmd: "apt-get download".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(FetchError::Unavailable(format!(
                "cannot download {} from {}: {}",
                packages.join(" "),
                self.suite,
                last_line(&out.stderr)
            )));
        }
        Ok(())
    }
}

fn last_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_string()
}

fn output(cmd: &mut Command) -> Result<Vec<u8>, FetchError> {
    let name = format!("{:?}", cmd.get_program());
    let out = cmd.output().map_err(|source| FetchError::Spawn {
        cmd: name.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(FetchError::Command {
            cmd: format!("{cmd:?}"),
            detail: last_line(&out.stderr),
        });
    }
    Ok(out.stdout)
}

fn run(cmd: &mut Command) -> Result<(), FetchError> {
    output(cmd).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_order_puts_dependencies_first_and_skips_builtins() {
        let deps = "kernel/fs/9p/9p.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/fs/netfs/netfs.ko.xz\n\
                    kernel/net/9p/9pnet.ko.xz:\n\
                    kernel/fs/netfs/netfs.ko.xz:\n\
                    kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko.xz\n";
        let order = load_order(deps, None, &["virtio_pci", "9pnet_virtio", "9p"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/net/9p/9pnet.ko.xz",
                "kernel/net/9p/9pnet_virtio.ko.xz",
                "kernel/fs/netfs/netfs.ko.xz",
                "kernel/fs/9p/9p.ko.xz"
            ]
        );
    }

    /// An archive that cannot be reached is a skip with apt's reason, not a failure.
    #[test]
    fn an_unreachable_archive_is_unavailable() {
        let root = std::env::temp_dir().join(format!("pyrometer-kernels-{}", std::process::id()));
        let kernel = &crate::kernels::KERNELS[0];
        // Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
        let err = prepare_from(kernel, &root, "http://127.0.0.1:9/debian").unwrap_err();
        let _ = fs::remove_dir_all(&root);
        match err {
            FetchError::Unavailable(why) => {
                assert!(why.contains("cannot fetch the bookworm index"), "{why}")
            }
            other => panic!("want Unavailable, got {other}"),
        }
    }

    /// A cached kernel of another series than the table's is fetched again, not booted.
    #[test]
    fn a_cached_kernel_of_another_series_is_not_used() {
        let root =
            std::env::temp_dir().join(format!("pyrometer-kernels-old-{}", std::process::id()));
        let kernel = &crate::kernels::KERNELS[0];
        let dir = root.join(kernel.name).join("kernel");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("release"), "5.10.0-30-amd64").unwrap();
        fs::write(dir.join("modules.load"), "").unwrap();
        let err = prepare_from(kernel, &root, "http://127.0.0.1:9/debian").unwrap_err();
        let _ = fs::remove_dir_all(&root);
        assert!(
            matches!(err, FetchError::Unavailable(ref why) if why.contains("cannot fetch")),
            "{err}"
        );
        // The same cache with the pinned series is used without the archive.
        let root = root.with_extension("pinned");
        let dir = root.join(kernel.name).join("kernel");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("release"), format!("{}0-99-amd64", kernel.series)).unwrap();
        fs::write(dir.join("modules.load"), "").unwrap();
        let cached = prepare_from(kernel, &root, "http://127.0.0.1:9/debian");
        let _ = fs::remove_dir_all(&root);
        assert_eq!(
            cached.unwrap().release,
            format!("{}0-99-amd64", kernel.series)
        );
    }

    #[test]
    fn a_kernel_without_9p_is_named() {
        let err = load_order("", Some("kernel/fs/ext4/ext4.ko\n"), &["9p"]).unwrap_err();
        assert!(err.to_string().contains("no 9p module"), "{err}");
    }
}
