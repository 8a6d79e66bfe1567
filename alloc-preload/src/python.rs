//! CPython's object allocator. pymalloc serves blocks of up to 512 bytes (256 before 3.8)
//! from its own arenas, which it maps directly, so those allocations never reach `malloc`.
//! In a process that has CPython (3.5+) linked in, a helper thread waits until the interpreter
//! is initialised, takes the GIL, and wraps the allocators of the `PyMem_*` and `PyObject_*`
//! domains with [`PyMem_SetAllocator`]: each wrapper counts the small blocks down the same
//! per-thread countdown as `malloc` (larger ones reach `malloc`, which counts them) and
//! forwards to the allocator it replaces. `PYTHONMALLOC=malloc*` (or any allocator that sends
//! small blocks to `malloc`) sends everything to `malloc`: nothing is wrapped then.
//!
//! Under pymalloc, the standard allocator, nothing wraps `free`: a sampled small block is
//! made by the C allocator instead of pymalloc. pymalloc hands a block that is not in its
//! arenas to `PyMem_RawFree` (and `PyMem_RawRealloc`), as it does for its large blocks, which
//! reach this library's `free` (and `realloc`), where the table of sampled addresses is
//! checked. So a Python object's free costs nothing more than without the library, and an
//! unsampled allocation one countdown. Under any other allocator (the debug hooks, mimalloc,
//! an embedder's own), whose `free` must get back its own blocks, `free` is wrapped and checks
//! the table.
//!
//! [`PyMem_SetAllocator`]: https://docs.python.org/3/c-api/memory.html#customize-memory-allocators

use core::cell::UnsafeCell;
use core::ffi::{CStr, c_char, c_int, c_void};
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::countdown;

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

/// Largest block the wrapped allocator serves itself (larger ones go to `malloc`, counted
/// there).
static SMALL: AtomicUsize = AtomicUsize::new(512);

/// Sampled small blocks are made by the C allocator and their frees are not wrapped (see the
/// module's comment). Set before the wrappers are installed, never changed.
static REDIRECT: AtomicBool = AtomicBool::new(false);

type GetAllocator = unsafe extern "C" fn(c_int, *mut Allocator);
type SetAllocator = unsafe extern "C" fn(c_int, *mut Allocator);
type IsInitialized = unsafe extern "C" fn() -> c_int;
type GilEnsure = unsafe extern "C" fn() -> c_int;
type GilRelease = unsafe extern "C" fn(c_int);
type GetVersion = unsafe extern "C" fn() -> *const c_char;
type AllocatorName = unsafe extern "C" fn() -> *const c_char;

/// CPython's functions, when the process has them.
struct Api {
    get: GetAllocator,
    set: SetAllocator,
    initialized: IsInitialized,
    ensure: GilEnsure,
    release: GilRelease,
    version: GetVersion,
    /// `_PyMem_GetCurrentAllocatorName` (3.8+): "pymalloc", "pymalloc_debug", "malloc",
    /// "malloc_debug", "mimalloc", "mimalloc_debug", or NULL for an embedder's allocator.
    allocator_name: Option<AllocatorName>,
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
    let name = lookup(c"_PyMem_GetCurrentAllocatorName");
    // SAFETY: each symbol is CPython's function of that name, with the C signature its
    // type states (stable API since 3.5; the allocator's name since 3.8).
    unsafe {
        Some(Api {
            get: core::mem::transmute::<*mut c_void, GetAllocator>(p[0]),
            set: core::mem::transmute::<*mut c_void, SetAllocator>(p[1]),
            initialized: core::mem::transmute::<*mut c_void, IsInitialized>(p[2]),
            ensure: core::mem::transmute::<*mut c_void, GilEnsure>(p[3]),
            release: core::mem::transmute::<*mut c_void, GilRelease>(p[4]),
            version: core::mem::transmute::<*mut c_void, GetVersion>(p[5]),
            allocator_name: (!name.is_null())
                .then(|| core::mem::transmute::<*mut c_void, AllocatorName>(name)),
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

/// How the interpreter's allocator is wrapped, from its name.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Small blocks go to `malloc` already (counted there): nothing to wrap.
    Leave,
    /// pymalloc: sampled small blocks are made by the C allocator, `free` is not wrapped.
    Redirect,
    /// Any other allocator: `free` is wrapped; blocks larger than `small` reach `malloc`.
    WrapFree { small: usize },
}

fn plan(name: Option<&[u8]>, version: &[u8], libc_is_ours: bool) -> Plan {
    let pymalloc_small = if version.starts_with(b"2.") || is_before_3_8(version) {
        256
    } else {
        512
    };
    match name {
        Some(n) if n.starts_with(b"malloc") => Plan::Leave,
        Some(b"pymalloc") if libc_is_ours => Plan::Redirect,
        // mimalloc serves blocks of every size itself.
        Some(n) if n.starts_with(b"mimalloc") => Plan::WrapFree { small: usize::MAX },
        _ => Plan::WrapFree {
            small: pymalloc_small,
        },
    }
}

/// Whether the process's `free` and `realloc` are this library's (it was preloaded, not
/// loaded later with `dlopen`), so a block that pymalloc hands to them reaches the table.
fn libc_is_ours() -> bool {
    let base = |p: *mut c_void| {
        // SAFETY: dladdr only reads the loader's tables; info is written on success.
        unsafe {
            let mut info: libc::Dl_info = core::mem::zeroed();
            (!p.is_null() && libc::dladdr(p, &mut info) != 0).then_some(info.dli_fbase as usize)
        }
    };
    let ours = base(&SMALL as *const AtomicUsize as *mut c_void);
    ours.is_some() && base(lookup(c"free")) == ours && base(lookup(c"realloc")) == ours
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
    // SAFETY: Py_GetVersion returns a static NUL-terminated string; the allocator's name is
    // static or NULL, read with the GIL held.
    let (version, name) = unsafe {
        let name = api.allocator_name.map(|f| f()).filter(|p| !p.is_null());
        (
            CStr::from_ptr((api.version)()).to_bytes(),
            name.map(|p| CStr::from_ptr(p).to_bytes()),
        )
    };
    match plan(name, version, libc_is_ours()) {
        Plan::Leave => {
            // SAFETY: the state PyGILState_Ensure returned.
            unsafe { (api.release)(gil) };
            return;
        }
        Plan::Redirect => REDIRECT.store(true, Ordering::Relaxed),
        Plan::WrapFree { small } => SMALL.store(small, Ordering::Relaxed),
    }
    let redirect = REDIRECT.load(Ordering::Relaxed);
    // SAFETY: with the GIL held; WRAPPED[i] is written before the wrapper that reads it is
    // installed, and never again.
    unsafe {
        let wrapped = &mut *WRAPPED.0.get();
        for (i, &domain) in DOMAINS.iter().enumerate() {
            (api.get)(domain, &mut wrapped[i]);
            if wrapped[i].malloc.is_none() {
                continue;
            }
            let mut ours = if i == 0 {
                wrappers::<0>(&wrapped[i], redirect)
            } else {
                wrappers::<1>(&wrapped[i], redirect)
            };
            (api.set)(domain, &mut ours);
        }
        (api.release)(gil);
    }
}

/// The allocator installed in place of domain `D`'s: the wrapped one's context (the wrappers
/// find the wrapped functions in WRAPPED) and, when sampled blocks come from the C allocator,
/// its own `free`.
fn wrappers<const D: usize>(wrapped: &Allocator, redirect: bool) -> Allocator {
    Allocator {
        ctx: wrapped.ctx,
        malloc: Some(py_malloc::<D>),
        calloc: Some(py_calloc::<D>),
        realloc: Some(py_realloc::<D>),
        free: if redirect {
            wrapped.free
        } else {
            Some(py_free::<D>)
        },
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

#[inline(always)]
fn wrapped(domain: usize) -> &'static Allocator {
    // SAFETY: written before any wrapper was installed, never again.
    unsafe { &(*WRAPPED.0.get())[domain] }
}

/// Whether an allocation of `size` bytes (as the wrapped allocator sees it) is sampled here.
#[inline(always)]
fn sampled(size: usize) -> bool {
    small(size) && countdown::sample(size)
}

unsafe extern "C" fn py_malloc<const D: usize>(_ctx: *mut c_void, size: usize) -> *mut c_void {
    let a = wrapped(D);
    if !sampled(size) {
        // SAFETY: forwarded as called; installed only where malloc was set.
        return unsafe { (a.malloc.unwrap_unchecked())(a.ctx, size) };
    }
    // Out of line, so the unsampled path saves no registers; a tail call, so the probe
    // still returns into the interpreter.
    sampled_block(a, 1, size, false)
}

unsafe extern "C" fn py_calloc<const D: usize>(
    _ctx: *mut c_void,
    n: usize,
    size: usize,
) -> *mut c_void {
    let a = wrapped(D);
    let bytes = n.saturating_mul(size);
    if !sampled(bytes) {
        // SAFETY: forwarded as called.
        return unsafe { (a.calloc.unwrap_unchecked())(a.ctx, n, size) };
    }
    sampled_block(a, n, size, true)
}

/// A sampled allocation of `n` items of `size` bytes, zeroed (a calloc) or not (a malloc,
/// `n` = 1).
#[cold]
#[inline(never)]
fn sampled_block(a: &Allocator, n: usize, size: usize, zeroed: bool) -> *mut c_void {
    // SAFETY: an allocation as the caller was asked for, by the wrapped allocator or (under
    // pymalloc, below) the C allocator, to which pymalloc hands the block back.
    let own = || unsafe {
        if zeroed {
            (a.calloc.unwrap_unchecked())(a.ctx, n, size)
        } else {
            (a.malloc.unwrap_unchecked())(a.ctx, size)
        }
    };
    let p = if !REDIRECT.load(Ordering::Relaxed) {
        own()
    } else if let Some(r) = crate::real::get() {
        // SAFETY: as `own`, by the C allocator.
        unsafe {
            if zeroed {
                (r.calloc)(n.max(1), size.max(1))
            } else {
                (r.malloc)(size.max(1))
            }
        }
    } else {
        // Cannot happen (the C allocator is resolved before Python starts); a pymalloc
        // block in the table would never leave it, since free is not wrapped.
        return own();
    };
    crate::report(p, n.saturating_mul(size))
}

unsafe extern "C" fn py_realloc<const D: usize>(
    ctx: *mut c_void,
    ptr: *mut c_void,
    size: usize,
) -> *mut c_void {
    if ptr.is_null() {
        // SAFETY: realloc(NULL) is a malloc.
        return unsafe { py_malloc::<D>(ctx, size) };
    }
    let a = wrapped(D);
    // SAFETY: forwarded as called.
    let forward = || unsafe { (a.realloc.unwrap_unchecked())(a.ctx, ptr, size) };
    if REDIRECT.load(Ordering::Relaxed) {
        if crate::SAMPLED.contains(ptr as usize) {
            // A sampled block, made by the C allocator: pymalloc hands it to realloc(),
            // which counts the resize and moves its entry.
            return forward();
        }
        let p = forward();
        return crate::resized(ptr, false, p, size, small(size));
    }
    let was_sampled = crate::SAMPLED.remove(ptr as usize);
    let p = forward();
    // A block that outgrows pymalloc is made by malloc, counted there.
    crate::resized(ptr, was_sampled, p, size, small(size))
}

/// Only where sampled blocks come from the wrapped allocator itself (not pymalloc).
unsafe extern "C" fn py_free<const D: usize>(_ctx: *mut c_void, ptr: *mut c_void) {
    let a = wrapped(D);
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

    #[test]
    fn the_plan_follows_the_allocator() {
        let v311 = b"3.11.7 (main)".as_slice();
        assert_eq!(plan(Some(b"pymalloc"), v311, true), Plan::Redirect);
        // Loaded with dlopen: pymalloc's raw frees would bypass the table.
        assert_eq!(
            plan(Some(b"pymalloc"), v311, false),
            Plan::WrapFree { small: 512 }
        );
        // The debug hooks check their own header on every free.
        assert_eq!(
            plan(Some(b"pymalloc_debug"), v311, true),
            Plan::WrapFree { small: 512 }
        );
        assert_eq!(plan(Some(b"malloc"), v311, true), Plan::Leave);
        assert_eq!(plan(Some(b"malloc_debug"), v311, true), Plan::Leave);
        assert_eq!(
            plan(Some(b"mimalloc"), b"3.13.0", true),
            Plan::WrapFree { small: usize::MAX }
        );
        // An embedder's allocator (no name), and 3.7, which has no name function.
        assert_eq!(plan(None, v311, true), Plan::WrapFree { small: 512 });
        assert_eq!(plan(None, b"3.7.17", true), Plan::WrapFree { small: 256 });
    }
}
