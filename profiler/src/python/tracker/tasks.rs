//! asyncio with `--async`: telling the kernel where a process's asyncio objects are, and
//! naming the task frames its walk writes.

use super::*;

impl PyTracker {
    /// With `--async`, tells the kernel where a registered process's asyncio objects are once
    /// they exist (`asyncio` imported, a TaskGroup made), looking again with a back-off until
    /// all are known. Called as its samples arrive.
    pub fn refresh_async(&mut self, pid: u32) {
        if !self.asyncio {
            return;
        }
        let Some(t) = self.procs.get_mut(&pid) else {
            return;
        };
        if t.aio_complete {
            return;
        }
        t.aio_asked = Instant::now();
        let since = t.aio_checked.elapsed();
        let due =
            since >= t.aio_wait || (t.aio_loop_seen && !t.aio_found && since >= ASYNC_RECHECK);
        if !due {
            return;
        }
        if crate::python::asyncio::unsupported(&t.runtime, &t.layout).is_some() {
            t.aio_complete = true;
            return;
        }
        t.aio_checked = Instant::now();
        t.aio_wait = (t.aio_wait * 2).clamp(ASYNC_RECHECK, ASYNC_RECHECK_MAX);
        if t.aio_debug.is_none() && t.runtime.version.minor >= 14 {
            t.aio_debug = crate::python::asyncio::find_debug(&self.proc_root, pid, &t.runtime);
        }
        let mem = ProcessMemory::new(pid);
        let found =
            crate::python::asyncio::discover(&mem, &t.runtime, &t.layout, t.aio_debug.as_ref());
        let Ok(Some(found)) = found else {
            return;
        };
        // 3.14+ futures say who awaits them; before, a TaskGroup's place is learnt too.
        t.aio_complete = found.taskgroup_type != 0 || found.fut_awaited_by != PY_ABSENT;
        if !t.aio_found {
            t.aio_found = true;
            t.aio_wait = ASYNC_RECHECK;
        }
        if let Some(map) = self.map.as_mut()
            && let Ok(mut entry) = map.get(&pid, 0)
            && entry.aio != found
        {
            entry.aio = found;
            let _ = map.insert(pid, entry, 0);
        }
    }

    /// When a sampling loop that reads in batches should read again so that a look at a
    /// process's asyncio objects is not late: the earliest look due within `ASYNC_PROMPT` of
    /// the last, at a process sampled within `ASYNC_PROMPT`. Samples taken before the look
    /// have no task chain (or, 3.11–3.13, none above a TaskGroup's tasks), and a look
    /// waiting for a one-second batch cost a second of them; the back-off bounds the extra
    /// reads to a few for each process.
    pub fn next_async_look(&self) -> Option<Instant> {
        if !self.asyncio {
            return None;
        }
        self.procs
            .values()
            .filter(|t| {
                !t.aio_complete && t.aio_wait < ASYNC_PROMPT && t.aio_asked.elapsed() < ASYNC_PROMPT
            })
            .map(|t| {
                let wait = if t.aio_loop_seen && !t.aio_found {
                    t.aio_wait.min(ASYNC_RECHECK)
                } else {
                    t.aio_wait
                };
                t.aio_checked + wait
            })
            .min()
    }

    /// The name a task frame shows: the task's name, or its coroutine's qualified name for
    /// an automatic `Task-N` (or a name not read).
    pub(super) fn task_frame(&mut self, pid: u32, name_obj: u64, code: u64) -> Option<PyFrameName> {
        let t = self.procs.get_mut(&pid)?;
        let mem = ProcessMemory::new(pid);
        let read = Walker::new(&mem, &t.layout, &t.runtime).string(name_obj);
        let given = match read {
            Ok(name) if !crate::python::asyncio::automatic_name(&name) => {
                let name: Arc<str> = Arc::from(name.as_str());
                if t.task_names.len() >= MAX_TASK_NAMES {
                    t.task_names.clear();
                }
                t.task_names.insert((name_obj, code), name.clone());
                Some(name)
            }
            Ok(_) => None,
            // The process is gone (or the name changed under the read): the name read last.
            Err(_) => t.task_names.get(&(name_obj, code)).cloned(),
        };
        let function = match given {
            Some(name) => name,
            None if code != 0 => {
                let coro = RawPyFrame {
                    code,
                    addr: PY_ADDR_UNKNOWN,
                    first_line: 0,
                    entry: false,
                    task_name: None,
                };
                self.resolve_code(pid, coro)?.function
            }
            None => Arc::from("Task"),
        };
        Some(PyFrameName {
            function,
            file: None,
            line: None,
            task: true,
        })
    }
}
