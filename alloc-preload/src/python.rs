//! CPython's object allocator. pymalloc serves blocks of up to 512 bytes (256 before 3.8)
//! from its own arenas, which it maps directly, so those allocations never reach `malloc`.
//! In a process that has CPython (3.5+) linked in, a helper thread waits until the interpreter
//! is initialised, takes the GIL, and wraps the allocators of the `PyMem_*` and `PyObject_*`
//! domains with [`PyMem_SetAllocator`]: each wrapper forwards to the allocator it replaces and
//! counts the small blocks down the same per-thread countdown as `malloc` (larger ones reach
//! `malloc`, which counts them). `PYTHONMALLOC=malloc*` sends everything to `malloc`: nothing
//! is wrapped then.
//!
//! [`PyMem_SetAllocator`]: https://docs.python.org/3/c-api/memory.html#customize-memory-allocators

use core::cell::UnsafeCell;
use core::ffi::{CStr, c_char, c_int, c_void};
use core::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// `PyMemAllocatorEx` (Include/cpython/pymem.h, unchanged since 3.5).
#[repr(C)]
#[derive(Clone, Copy)]
struct Allocator {
    ctx: *mut c_void,
    malloc: Option<unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void>,
    calloc: Option<unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void>,
    realloc: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void>,
    free: Option<unsafe extern "C" fn(*mut c_void, *mut c_void)>,
}

const EMPTY: Allocator = Allocator {
    ctx: core::ptr::null_mut(),
    malloc: None,
    calloc: None,
    realloc: None,
    free: None,
};

/// `PyMemAllocatorDomain`: PYMEM_DOMAIN_MEM and PYMEM_DOMAIN_OBJ.
const DOMAINS: [c_int; 2] = [1, 2];

struct Wrapped(UnsafeCell<[Allocator; 2]>);
// SAFETY: written once, by the helper thread holding the GIL, before the wrappers that read
// it are installed.
unsafe impl Sync for Wrapped {}
static WRAPPED: Wrapped = Wrapped(UnsafeCell::new([EMPTY; 2]));

/// Largest block pymalloc serves itself (larger ones go to `malloc`, counted there).
static SMALL: AtomicUsize = AtomicUsize::new(512);

type GetAllocator = unsafe extern "C" fn(c_int, *mut Allocator);
type SetAllocator = unsafe extern "C" fn(c_int, *mut Allocator);
type IsInitialized = unsafe extern "C" fn() -> c_int;
type GilEnsure = unsafe extern "C" fn() -> c_int;
type GilRelease = unsafe extern "C" fn(c_int);
type GetVersion = unsafe extern "C" fn() -> *const c_char;

/// CPython's functions, when the process has them.
struct Api {
    get: GetAllocator,
    set: SetAllocator,
    initialized: IsInitialized,
    ensure: GilEnsure,
    release: GilRelease,
    version: GetVersion,
}

fn lookup(name: &CStr) -> *mut c_void {
    // SAFETY: dlsym with a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

fn api() -> Option<Api> {
    let names = [
        c"PyMem_GetAllocator",
        c"PyMem_SetAllocator",
        c"Py_IsInitialized",
        c"PyGILState_Ensure",
        c"PyGILState_Release",
        c"Py_GetVersion",
    ];
    let mut p = [core::ptr::null_mut(); 6];
    for (slot, name) in p.iter_mut().zip(names) {
        *slot = lookup(name);
        if slot.is_null() {
            return None;
        }
    }
    // SAFETY: each symbol is CPython's function of that name, with the C signature its
    // type states (stable API since 3.5).
    unsafe {
        Some(Api {
            get: core::mem::transmute::<*mut c_void, GetAllocator>(p[0]),
            set: core::mem::transmute::<*mut c_void, SetAllocator>(p[1]),
            initialized: core::mem::transmute::<*mut c_void, IsInitialized>(p[2]),
            ensure: core::mem::transmute::<*mut c_void, GilEnsure>(p[3]),
            release: core::mem::transmute::<*mut c_void, GilRelease>(p[4]),
            version: core::mem::transmute::<*mut c_void, GetVersion>(p[5]),
        })
    }
}

/// Called by the library's constructor: starts the helper in a process with CPython.
pub fn start() {
    let Some(api) = api() else { return };
    if std::env::var_os("PYTHONMALLOC").is_some_and(|v| v.to_string_lossy().starts_with("malloc")) {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("pyrometer-py".into())
        .stack_size(64 * 1024)
        .spawn(move || install_when_ready(&api));
}

/// Waits (up to a minute) for the interpreter, then wraps its allocators.
fn install_when_ready(api: &Api) {
    let started = Instant::now();
    // SAFETY: Py_IsInitialized may be called at any time.
    while unsafe { (api.initialized)() } == 0 {
        if started.elapsed() > Duration::from_secs(60) {
            return;
        }
        let pause = if started.elapsed() < Duration::from_millis(200) {
            1
        } else {
            20
        };
        std::thread::sleep(Duration::from_millis(pause));
    }
    // SAFETY: the interpreter is initialised, so a foreign thread may take the GIL.
    let gil = unsafe { (api.ensure)() };
    // SAFETY: Py_GetVersion returns a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr((api.version)()) }.to_bytes();
    if version.starts_with(b"2.") || is_before_3_8(version) {
        SMALL.store(256, Ordering::Relaxed);
    }
    // SAFETY: with the GIL held; WRAPPED[i] is written before the wrapper that reads it is
    // installed, and never again.
    unsafe {
        let wrapped = &mut *WRAPPED.0.get();
        for (i, &domain) in DOMAINS.iter().enumerate() {
            (api.get)(domain, &mut wrapped[i]);
            if wrapped[i].malloc.is_none() {
                continue;
            }
            let mut ours = Allocator {
                ctx: (&mut wrapped[i] as *mut Allocator).cast(),
                malloc: Some(py_malloc),
                calloc: Some(py_calloc),
                realloc: Some(py_realloc),
                free: Some(py_free),
            };
            (api.set)(domain, &mut ours);
        }
        (api.release)(gil);
    }
}

/// "3.7.x" and older 3.x: pymalloc's small blocks end at 256 bytes.
fn is_before_3_8(version: &[u8]) -> bool {
    let Some(rest) = version.strip_prefix(b"3.") else {
        return false;
    };
    let minor: u32 = rest
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .fold(0, |n, &c| n * 10 + u32::from(c - b'0'));
    minor < 8
}

#[inline(always)]
fn small(size: usize) -> bool {
    size <= SMALL.load(Ordering::Relaxed)
}

unsafe extern "C" fn py_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: ctx is the wrapped domain's saved allocator.
    let a = unsafe { &*ctx.cast::<Allocator>() };
    // SAFETY: forwarded as called; installed only where malloc was set.
    let p = unsafe { (a.malloc.unwrap_unchecked())(a.ctx, size) };
    if !small(size) {
        return p;
    }
    crate::account(p, size)
}

unsafe extern "C" fn py_calloc(ctx: *mut c_void, n: usize, size: usize) -> *mut c_void {
    // SAFETY: as in py_malloc.
    let a = unsafe { &*ctx.cast::<Allocator>() };
    // SAFETY: forwarded as called.
    let p = unsafe { (a.calloc.unwrap_unchecked())(a.ctx, n, size) };
    let bytes = n.saturating_mul(size);
    if !small(bytes) {
        return p;
    }
    crate::account(p, bytes)
}

unsafe extern "C" fn py_realloc(ctx: *mut c_void, ptr: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: as in py_malloc.
    let a = unsafe { &*ctx.cast::<Allocator>() };
    if ptr.is_null() {
        // SAFETY: forwarded as called (a malloc).
        let p = unsafe { (a.realloc.unwrap_unchecked())(a.ctx, ptr, size) };
        return if small(size) {
            crate::account(p, size)
        } else {
            p
        };
    }
    let was_sampled = crate::SAMPLED.remove(ptr as usize);
    // SAFETY: forwarded as called.
    let p = unsafe { (a.realloc.unwrap_unchecked())(a.ctx, ptr, size) };
    // A block that outgrows pymalloc is made by malloc, counted there.
    crate::resized(ptr, was_sampled, p, size, small(size))
}

unsafe extern "C" fn py_free(ctx: *mut c_void, ptr: *mut c_void) {
    // SAFETY: as in py_malloc.
    let a = unsafe { &*ctx.cast::<Allocator>() };
    if !ptr.is_null() {
        crate::forget(ptr);
    }
    // SAFETY: forwarded as called.
    unsafe { (a.free.unwrap_unchecked())(a.ctx, ptr) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_block_limit_by_version() {
        assert!(is_before_3_8(b"3.7.17 (default)"));
        assert!(!is_before_3_8(b"3.11.7 (main)"));
        assert!(!is_before_3_8(b"3.13.0"));
        assert!(!is_before_3_8(b"2.7.18"), "2.x has no PyMem_SetAllocator");
    }
}
