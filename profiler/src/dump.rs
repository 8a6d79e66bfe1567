//! `dump`: the current Python stack of every thread of a process, read from its memory
//! without stopping it (with native frames: each thread stopped for as long as reading its
//! registers takes), like `py-spy dump`.

pub use crate::python::threads::ThreadState;
pub use crate::python::walk::PyFrame;
pub use crate::python::{BINARY_DEADLINE, ProcessDump, PythonError, ThreadDump, dump, dump_with};
