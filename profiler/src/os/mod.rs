//! The bottom layer: facts the operating system gives about processes and files, read
//! without the kernel programs. `/proc` (processes, their mappings and binaries, names,
//! descendants), ELF files (symbols, segments, needed libraries), privileges, the kernel's
//! process events, whether uprobes stay open after the agent drops its privileges, signals,
//! the monotonic clock, and starting a held command. Nothing here
//! imports from the layers above; the reading of files a profiled process controls belongs
//! here too, so every layer above reads them the same bounded way.

pub mod clock;
pub mod cpu_budget;
pub mod elfsyms;
pub mod mounts;
pub mod optout;
pub mod owned;
pub mod perf;
pub mod pids;
pub mod privileges;
pub mod procevents;
pub mod procs;
pub mod proctext;
pub mod seccomp;
pub mod shared_map;
pub mod signals;
pub mod spawn;
pub mod untrusted;
pub mod uprobe_access;
pub mod workers;
