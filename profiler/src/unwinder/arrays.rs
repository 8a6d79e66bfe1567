//! The unwinder's BPF arrays as the agent writes them: mapped a window at a time, and their
//! free ranges.

use std::os::fd::{AsFd, OwnedFd};

use aya::maps::MapData;

use super::UnwinderError;
use crate::os::shared_map::{SharedMap, page_size};

/// A BPF_F_MMAPABLE array, mapped only while something is written into it: a mapping kept
/// open holds all its pages in the agent's resident set, though the data lives in the map's
/// kernel memory either way.
pub(super) struct MmapArray {
    fd: OwnedFd,
    /// Bytes per element (the kernel rounds values up to 8 bytes).
    slot: usize,
}

impl MmapArray {
    pub(super) fn new(map: MapData, slot: usize) -> Result<Self, UnwinderError> {
        // The duplicate keeps the map alive after `map` closes its own descriptor.
        let fd = map
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(UnwinderError::Mmap)?;
        drop(map);
        let array = Self { fd, slot };
        // Fails here, at load, if the array cannot be mapped at all.
        array.window(0, 1)?;
        Ok(array)
    }

    /// Elements `first..first + count`, mapped read-write until the window is dropped.
    pub(super) fn window(&self, first: u32, count: u32) -> Result<Window, UnwinderError> {
        let page = page_size();
        let start = first as usize * self.slot;
        let end = start + count as usize * self.slot;
        let offset = start / page * page;
        let len = end.div_ceil(page) * page - offset;
        // Pages of a BPF array created with BPF_F_MMAPABLE, within its size (the allocators
        // only hand out elements below capacity); unmapped on drop.
        let map =
            SharedMap::new(self.fd.as_fd(), len, offset, true).map_err(UnwinderError::Mmap)?;
        Ok(Window {
            map,
            skip: start - offset,
            count: count as usize,
            slot: self.slot,
        })
    }
}

/// Some elements of an [`MmapArray`], mapped.
pub(super) struct Window {
    map: SharedMap,
    /// Offset of the first element from `base` (the mapping starts on a page boundary).
    skip: usize,
    count: usize,
    slot: usize,
}

impl Window {
    /// Writes `values` into the window's elements, in order (at most its count).
    pub(super) fn write<T: Copy>(&self, values: &[T]) {
        debug_assert!(size_of::<T>() <= self.slot);
        for (i, &v) in values.iter().take(self.count).enumerate() {
            // SAFETY: element i < count lies inside the window; elements are 8-byte aligned
            // (the window starts on a page and slots are multiples of 8) and `slot` bytes
            // long, at least size_of::<T>().
            unsafe {
                let at = self.map.base().add(self.skip + i * self.slot);
                std::ptr::write(at.cast::<T>(), v);
            }
        }
    }
}

impl Window {
    /// Element `i` of the window (None past its count).
    pub(super) fn read<T: Copy>(&self, i: usize) -> Option<T> {
        debug_assert!(size_of::<T>() <= self.slot);
        if i >= self.count {
            return None;
        }
        // SAFETY: element i < count lies inside the window, 8-byte aligned and `slot` bytes
        // long (see `write`); T is plain data the agent wrote there itself.
        Some(unsafe {
            std::ptr::read(
                self.map
                    .base()
                    .add(self.skip + i * self.slot)
                    .cast::<T>()
                    .cast_const(),
            )
        })
    }
}

/// Free ranges of an array, (first, count) sorted by first; first fit.
pub(super) struct Ranges(pub(super) Vec<(u32, u32)>);

impl Ranges {
    pub(super) fn take(&mut self, count: u32) -> Option<u32> {
        let i = self.0.iter().position(|&(_, len)| len >= count)?;
        let (first, len) = self.0[i];
        if len == count {
            self.0.remove(i);
        } else {
            self.0[i] = (first + count, len - count);
        }
        Some(first)
    }

    pub(super) fn give_back(&mut self, first: u32, count: u32) {
        let i = self.0.partition_point(|&(f, _)| f < first);
        self.0.insert(i, (first, count));
        // Merge with neighbours so large tables can fit again.
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(self.0.len());
        for &(f, l) in &self.0 {
            if let Some(last) = merged.last_mut()
                && last.0 + last.1 == f
            {
                last.1 += l;
                continue;
            }
            merged.push((f, l));
        }
        self.0 = merged;
    }
}
