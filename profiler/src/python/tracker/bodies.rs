//! Module bodies: a module's body runs once, at its import, and is freed when it ends, often
//! before the sampling loop reads the samples taken in it; bodies of the same size then take
//! its address one after another, all starting on line 1. Read at that address, the code
//! object is another module's body (every one passes the first-line check), or nothing. The
//! kernel walker keeps, for each address, the globals of the last bodies it met there and
//! when (`py_bodies` in python.h); a module's dict outlives its body. A sample's body is the
//! one read last at or before the sample: the code object read now names it when it belongs
//! to that module's file, and `<module>` of the module's `__file__` (without a line: the line
//! table went with the body) names it when not.

use super::*;
use crate::os::clock::monotonic_now_ns;

/// Bodies and histories kept per process.
const MAX_BODIES: usize = 256;

/// What a module body is called (its `co_name`).
const MODULE_BODY: &str = "<module>";

/// What the kernel's history says of a sample's module body.
enum Body {
    /// Nothing kept for the address: the frame is named as any other.
    Unknown,
    /// The address changed modules more often since the sample than the history keeps.
    Gone,
    /// The module, `None` when its globals have no `__file__` (`exec` in a namespace of
    /// its own): then the frame is named as any other; and whether another module was met
    /// at the address after the sample.
    Module(Option<Arc<BodyModule>>, bool),
}

/// The module a body ran in: its `__file__` and `__name__`.
pub(super) struct BodyModule {
    file: Arc<str>,
    name: Option<String>,
}

/// A process's module bodies: the kernel's history of each address, as fetched at a time
/// (CLOCK_MONOTONIC ns; it holds every read of the samples taken before), and the module of
/// each (address, globals).
#[derive(Default)]
pub(super) struct Bodies {
    histories: HashMap<u64, (u64, Option<pyrometer_ebpf::PyBody>)>,
    modules: HashMap<(u64, u64), Option<Arc<BodyModule>>>,
}

impl PyTracker {
    /// Hands the tracker the kernel walker's module bodies.
    pub fn set_bodies(&mut self, bodies: crate::bpf::PyBodies) {
        self.bodies = Some(bodies);
    }

    /// Names a frame whose code object starts on line 1 (a module body, or a function
    /// defined on a file's first line) in a sample taken at `sample_ns`. `None` when the
    /// kernel kept no module for it (the `bodies` map is not there, the body ran in a
    /// namespace without `__file__`, as `exec` code does): then it is named as any frame.
    pub(super) fn resolve_body(
        &mut self,
        pid: u32,
        frame: RawPyFrame,
        sample_ns: u64,
    ) -> Option<PyFrameName> {
        let (module, changed) = match self.body_module(pid, frame.code, sample_ns) {
            Body::Unknown => return None,
            // Whatever the address holds now is not the sample's.
            Body::Gone => {
                self.stats.bad_codes += 1;
                return Some(unreadable());
            }
            Body::Module(None, _) => return None,
            Body::Module(Some(module), changed) => (module, changed),
        };
        let read = self.resolve_code(pid, frame)?;
        // The module's own code; or, where no other module was met at the address since,
        // a function that starts on line 1 of code `exec` ran in the module's namespace
        // (dataclasses' generated functions): its file is not the module's.
        let own = read.file.as_deref().is_some_and(|f| module.holds(f));
        let exec_function = !changed
            && read.file.is_some()
            && &*read.function != MODULE_BODY
            && !read.function.starts_with('<');
        if own || exec_function {
            // The module's own body read without a line for the sample's instruction: its
            // line table was read as the address changed hands (torn). What is shown is the
            // module's `<module>` without a line, as for a freed body, and counted as one.
            if own
                && read.line.is_none()
                && &*read.function == MODULE_BODY
                && frame.addr != pyrometer_ebpf::PY_ADDR_UNKNOWN
            {
                self.stats.freed_bodies += 1;
            }
            return Some(read);
        }
        self.stats.freed_bodies += 1;
        Some(PyFrameName {
            function: Arc::from(MODULE_BODY),
            file: Some(module.file.clone()),
            line: None,
            task: false,
        })
    }

    /// The module of the body the kernel met last at `code` at or before `sample_ns`.
    fn body_module(&mut self, pid: u32, code: u64, sample_ns: u64) -> Body {
        let (Some(map), Some(t)) = (self.bodies.as_ref(), self.procs.get_mut(&pid)) else {
            return Body::Unknown;
        };
        let b = &mut t.bodies;
        let fresh = b
            .histories
            .get(&code)
            .is_some_and(|(fetched, _)| *fetched >= sample_ns);
        if !fresh {
            if b.histories.len() >= MAX_BODIES {
                b.histories.clear();
            }
            let key = pyrometer_ebpf::PyBodyKey {
                code,
                tgid: pid,
                firstline: 1,
            };
            let fetched = monotonic_now_ns();
            b.histories.insert(code, (fetched, map.get(&key, 0).ok()));
        }
        let Some((_, Some(history))) = b.histories.get(&code) else {
            return Body::Unknown;
        };
        // None at or before the sample: more changes since than the history keeps.
        let Some(read) = history
            .reads
            .iter()
            .filter(|r| r.read_ns != 0 && r.read_ns <= sample_ns)
            .max_by_key(|r| r.read_ns)
        else {
            return Body::Gone;
        };
        let globals = read.globals;
        let changed = history.reads.iter().any(|r| r.read_ns > sample_ns);
        if let Some(module) = b.modules.get(&(code, globals)) {
            return Body::Module(module.clone(), changed);
        }
        if b.modules.len() >= MAX_BODIES {
            b.modules.clear();
        }
        let mem = ProcessMemory::new(pid);
        let found = crate::python::names::with_reader(&mem, &t.runtime, &t.layout, |r| {
            let dict = r.dict(globals)?;
            Ok((r.get(&dict, "__file__")?, r.get(&dict, "__name__")?))
        });
        let walker = Walker::new(&mem, &t.layout, &t.runtime);
        let module = match found {
            Ok((Some(file), name)) => walker.string(file).ok().map(|file| {
                Arc::new(BodyModule {
                    file: Arc::from(file.as_str()),
                    name: name.and_then(|n| walker.string(n).ok()),
                })
            }),
            _ => None,
        };
        b.modules.insert((code, globals), module.clone());
        Body::Module(module, changed)
    }
}

impl BodyModule {
    /// Whether a code object of `file` belongs to this module: its `__file__`, or the
    /// `<frozen NAME>` a frozen module's code says.
    fn holds(&self, file: &str) -> bool {
        file == &*self.file
            || self.name.as_deref().is_some_and(|name| {
                file.strip_prefix("<frozen ")
                    .and_then(|f| f.strip_suffix('>'))
                    == Some(name)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::BodyModule;

    #[test]
    fn a_body_belongs_to_its_modules_file_or_frozen_name() {
        let m = BodyModule {
            file: "/usr/lib/python3.11/os.py".into(),
            name: Some("os".into()),
        };
        assert!(m.holds("/usr/lib/python3.11/os.py"));
        assert!(m.holds("<frozen os>"));
        assert!(!m.holds("<frozen posixpath>"));
        assert!(!m.holds("/usr/lib/python3.11/shutil.py"));
        let unnamed = BodyModule {
            file: "/srv/app/main.py".into(),
            name: None,
        };
        assert!(!unnamed.holds("<frozen main>"));
    }
}
