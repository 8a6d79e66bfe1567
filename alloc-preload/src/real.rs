//! The allocator this library wraps: the next definitions of the allocator functions after
//! it in the lookup order (`dlsym(RTLD_NEXT)`), so a jemalloc or tcmalloc that the program
//! links or preloads after this library keeps serving its blocks; glibc's otherwise.
//!
//! `dlsym` itself may allocate (its error state) while the functions are being looked up:
//! those few calls are served from a static bump arena whose blocks are never freed.

use core::ffi::c_void;
use core::sync::atomic::{AtomicPtr, AtomicU8, AtomicUsize, Ordering};

pub type Malloc = unsafe extern "C" fn(usize) -> *mut c_void;
pub type Calloc = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub type Realloc = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
pub type Free = unsafe extern "C" fn(*mut c_void);
pub type Memalign = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub type PosixMemalign = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> i32;
pub type Valloc = unsafe extern "C" fn(usize) -> *mut c_void;

/// The wrapped functions, looked up once.
pub struct Real {
    pub malloc: Malloc,
    pub calloc: Calloc,
    pub realloc: Realloc,
    pub free: Free,
    pub memalign: Memalign,
    pub aligned_alloc: Memalign,
    pub posix_memalign: PosixMemalign,
    pub valloc: Valloc,
    pub pvalloc: Valloc,
}

const UNRESOLVED: u8 = 0;
const RESOLVING: u8 = 1;
const READY: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);
static SLOTS: [AtomicPtr<c_void>; 9] = [const { AtomicPtr::new(core::ptr::null_mut()) }; 9];
const NAMES: [&core::ffi::CStr; 9] = [
    c"malloc",
    c"calloc",
    c"realloc",
    c"free",
    c"memalign",
    c"aligned_alloc",
    c"posix_memalign",
    c"valloc",
    c"pvalloc",
];

// glibc's own entry points, for a process in which nothing follows this library (it cannot
// happen with a dynamically linked libc, but the library must never call a null pointer).
unsafe extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_free(ptr: *mut c_void);
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    fn __libc_valloc(size: usize) -> *mut c_void;
    fn __libc_pvalloc(size: usize) -> *mut c_void;
}

unsafe extern "C" fn fallback_posix_memalign(
    out: *mut *mut c_void,
    align: usize,
    size: usize,
) -> i32 {
    if !align.is_power_of_two() || !align.is_multiple_of(size_of::<usize>()) {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a writable out pointer, as posix_memalign requires.
    unsafe {
        let p = __libc_memalign(align, size);
        if p.is_null() {
            return libc::ENOMEM;
        }
        *out = p;
    }
    0
}

/// The wrapped allocator, or None while it is being looked up (the caller uses the arena).
#[inline(always)]
pub fn get() -> Option<&'static Real> {
    ready().or_else(resolve)
}

/// The wrapped allocator once looked up; None before (the caller then takes a slow path that
/// calls [`get`]). Kept apart from `get` so the fast paths hold no call to the lookup, whose
/// saved registers the compiler would otherwise hoist into every call.
#[inline(always)]
pub fn ready() -> Option<&'static Real> {
    if STATE.load(Ordering::Acquire) == READY {
        // SAFETY: READY is stored after REAL is written, once.
        return Some(unsafe { &*REAL.as_ptr() });
    }
    None
}

struct RealCell(core::cell::UnsafeCell<core::mem::MaybeUninit<Real>>);
// SAFETY: written once by the thread that wins RESOLVING, read only after READY.
unsafe impl Sync for RealCell {}
impl RealCell {
    fn as_ptr(&self) -> *mut Real {
        self.0.get().cast()
    }
}
static REAL: RealCell = RealCell(core::cell::UnsafeCell::new(core::mem::MaybeUninit::uninit()));

#[cold]
#[inline(never)]
fn resolve() -> Option<&'static Real> {
    if STATE
        .compare_exchange(UNRESOLVED, RESOLVING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // Another thread (or this one, inside dlsym) is resolving.
        return ready();
    }
    for (slot, name) in SLOTS.iter().zip(NAMES) {
        // SAFETY: dlsym with a NUL-terminated name.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
        slot.store(p, Ordering::Relaxed);
    }
    let at = |i: usize| SLOTS[i].load(Ordering::Relaxed);
    // SAFETY: each non-null pointer is the named allocator function, whose C signature the
    // type states; null falls back to glibc's own.
    let real = unsafe {
        Real {
            malloc: pick(at(0), __libc_malloc as Malloc),
            calloc: pick(at(1), __libc_calloc as Calloc),
            realloc: pick(at(2), __libc_realloc as Realloc),
            free: pick(at(3), __libc_free as Free),
            memalign: pick(at(4), __libc_memalign as Memalign),
            aligned_alloc: pick(at(5), __libc_memalign as Memalign),
            posix_memalign: pick(at(6), fallback_posix_memalign as PosixMemalign),
            valloc: pick(at(7), __libc_valloc as Valloc),
            pvalloc: pick(at(8), __libc_pvalloc as Valloc),
        }
    };
    // SAFETY: only the thread that won RESOLVING writes, before READY.
    unsafe { REAL.as_ptr().write(real) };
    STATE.store(READY, Ordering::Release);
    // SAFETY: as in `ready`.
    Some(unsafe { &*REAL.as_ptr() })
}

/// # Safety
/// `p`, when not null, must be a function of type `F`.
unsafe fn pick<F: Copy>(p: *mut c_void, fallback: F) -> F {
    if p.is_null() {
        fallback
    } else {
        // SAFETY: F is a function pointer type, the size of a data pointer.
        unsafe { core::mem::transmute_copy(&p) }
    }
}

/// The bootstrap arena: 64 KiB, 16-byte aligned blocks with their size just before them.
const ARENA_BYTES: usize = 64 * 1024;
#[repr(C, align(64))]
struct Arena(core::cell::UnsafeCell<[u8; ARENA_BYTES]>);
// SAFETY: blocks are handed out by an atomic bump, each to one caller.
unsafe impl Sync for Arena {}
static ARENA: Arena = Arena(core::cell::UnsafeCell::new([0; ARENA_BYTES]));
static ARENA_USED: AtomicUsize = AtomicUsize::new(0);

/// A zeroed block from the arena (null when it is exhausted); `align` a power of two.
pub fn arena_alloc(size: usize, align: usize) -> *mut c_void {
    let align = align.max(16);
    let base = ARENA.0.get() as usize;
    loop {
        let used = ARENA_USED.load(Ordering::Relaxed);
        // The size word sits in the 16 bytes before the aligned block.
        let start = (base + used + 16).next_multiple_of(align);
        let Some(end) = start.checked_add(size) else {
            return core::ptr::null_mut();
        };
        if end > base + ARENA_BYTES {
            return core::ptr::null_mut();
        }
        if ARENA_USED
            .compare_exchange(used, end - base, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: [start - 8, end) lies in the arena and belongs to this caller alone.
            unsafe { ((start - 8) as *mut usize).write(size) };
            return start as *mut c_void;
        }
    }
}

/// Whether `p` came from the arena (frees of it are ignored).
#[inline(always)]
pub fn in_arena(p: *mut c_void) -> bool {
    let base = ARENA.0.get() as usize;
    (p as usize).wrapping_sub(base) < ARENA_BYTES
}

/// The size an arena block was allocated with.
pub fn arena_size(p: *mut c_void) -> usize {
    // SAFETY: arena blocks carry their size in the word before them.
    unsafe { ((p as usize - 8) as *const usize).read() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_blocks_are_aligned_sized_and_recognised() {
        let a = arena_alloc(24, 16);
        let b = arena_alloc(100, 64);
        assert!(!a.is_null() && !b.is_null());
        assert_eq!(a as usize % 16, 0);
        assert_eq!(b as usize % 64, 0);
        assert!(in_arena(a) && in_arena(b));
        assert_eq!((arena_size(a), arena_size(b)), (24, 100));
        assert!(b as usize >= a as usize + 24, "no overlap");
        let heap = Box::new(1u64);
        assert!(!in_arena(&*heap as *const u64 as *mut c_void));
        assert!(arena_alloc(ARENA_BYTES, 16).is_null(), "exhaustion is null");
    }

    #[test]
    fn resolves_the_next_allocator() {
        let r = get().expect("resolved");
        // SAFETY: the resolved functions are the allocator's.
        unsafe {
            let p = (r.malloc)(64);
            assert!(!p.is_null());
            (r.free)(p);
        }
    }
}
