//! idemproxy's global allocator: mimalloc, asked for an alignment only
//! when a request needs more than every block already has.
//!
//! The `mimalloc` crate's `GlobalAlloc` passes every request, with its
//! alignment, to `mi_malloc_aligned`. mimalloc serves that from its fast
//! path only when the size is at most 1 KiB and the next free block
//! happens to be aligned. Anything larger takes its generic aligned path,
//! which allocates plainly only when the rounded block size is a power of
//! two up to 4 KiB; otherwise it over-allocates, asking for size +
//! alignment − 1 bytes, which can land in the next size class (1,280
//! bytes at alignment 8 took a 1,536-byte block). For an alignment of 1
//! or 8 (a `Vec<u8>`, most boxes) all of that is wasted: every block
//! mimalloc hands out is aligned to a word, its size classes being whole
//! words and its pages starting 16-aligned. A pass-through request spent
//! about 1,150 instructions of its 41,000 in those aligned paths
//! (bench/instructions; BENCHMARKS.md, issue #15's twentieth pass).
//!
//! So a request whose alignment is at most a word goes to `mi_malloc`
//! (`mi_zalloc`, `mi_realloc`), as the standard library's own allocator
//! calls `malloc` when the alignment is one `malloc` guarantees; a larger
//! alignment (tokio's task cells ask for 128) still goes to the aligned
//! functions. Freeing is `mi_free` either way.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment of every block mimalloc returns: its size classes are
/// whole words, and a page's first block is aligned to 16 bytes.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc, without its aligned paths for alignments it always meets.
/// `#[global_allocator] static A: idemproxy_alloc::Mimalloc = idemproxy_alloc::Mimalloc;`
#[derive(Debug, Clone, Copy, Default)]
pub struct Mimalloc;

/// Whether a plain mimalloc block meets `layout`'s alignment.
#[inline]
fn plain(layout: &Layout) -> bool {
    layout.align() <= WORD
}

// SAFETY: every function returns memory from mimalloc of at least the
// size asked for, aligned as `layout` asks (`plain`, or the aligned
// functions), or null; `dealloc` and `realloc` are given only pointers
// this allocator returned, which `mi_free` and `mi_realloc*` accept
// whichever function allocated them.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = if plain(&layout) {
            // SAFETY: a plain allocation; no precondition.
            unsafe { mi::mi_malloc(layout.size()) }
        } else {
            // SAFETY: `Layout` guarantees a power-of-two alignment.
            unsafe { mi::mi_malloc_aligned(layout.size(), layout.align()) }
        };
        p.cast()
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = if plain(&layout) {
            // SAFETY: as in `alloc`.
            unsafe { mi::mi_zalloc(layout.size()) }
        } else {
            // SAFETY: as in `alloc`.
            unsafe { mi::mi_zalloc_aligned(layout.size(), layout.align()) }
        };
        p.cast()
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a pointer this allocator returned.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = if plain(&layout) {
            // SAFETY: the caller passes a pointer this allocator returned
            // with `layout`; any block meets a word's alignment.
            unsafe { mi::mi_realloc(ptr.cast::<c_void>(), new_size) }
        } else {
            // SAFETY: as above, keeping the alignment it was given.
            unsafe { mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()) }
        };
        p.cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes around mimalloc's boundaries: the word, the small fast path
    /// (1 KiB), power-of-two and other block sizes up to 4 KiB and past
    /// it, a medium and a large block.
    const SIZES: &[usize] = &[
        1,
        7,
        8,
        9,
        24,
        48,
        100,
        1000,
        1024,
        1025,
        1500,
        4096,
        5000,
        70_000,
        1 << 20,
    ];
    const ALIGNS: &[usize] = &[1, 2, 4, 8, 16, 32, 64, 128, 4096];

    fn aligned(p: *mut u8, align: usize) -> bool {
        (p as usize).is_multiple_of(align)
    }

    #[test]
    fn every_allocation_meets_its_alignment_and_size() {
        let a = Mimalloc;
        for &align in ALIGNS {
            for &size in SIZES {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; the block is written within
                // its size and freed once, with its layout.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null(), "{size} bytes at {align}");
                    assert!(aligned(p, align), "{size} bytes at {align}: {p:p}");
                    assert!(mi::mi_usable_size(p.cast()) >= size);
                    p.write_bytes(0xa5, size);
                    a.dealloc(p, layout);
                }
            }
        }
    }

    #[test]
    fn zeroed_allocations_are_zero_and_aligned() {
        let a = Mimalloc;
        for &align in ALIGNS {
            for &size in SIZES {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: as above; the block is read within its size.
                unsafe {
                    // Dirty a block of the same size class first, so
                    // that a zeroed one is not merely fresh memory.
                    let dirty = a.alloc(layout);
                    dirty.write_bytes(0xff, size);
                    a.dealloc(dirty, layout);
                    let p = a.alloc_zeroed(layout);
                    assert!(aligned(p, align), "{size} bytes at {align}: {p:p}");
                    let bytes = std::slice::from_raw_parts(p, size);
                    assert!(bytes.iter().all(|&b| b == 0), "{size} bytes at {align}");
                    a.dealloc(p, layout);
                }
            }
        }
    }

    #[test]
    fn reallocation_keeps_the_contents_and_the_alignment() {
        let a = Mimalloc;
        for &align in ALIGNS {
            for &from in SIZES {
                for &to in &[1usize, 1000, 1025, 5000, 70_000] {
                    let layout = Layout::from_size_align(from, align).unwrap();
                    // SAFETY: as above; `realloc` gets the block's own
                    // layout, and the new block is freed with its size.
                    unsafe {
                        let p = a.alloc(layout);
                        for i in 0..from {
                            *p.add(i) = i as u8;
                        }
                        let q = a.realloc(p, layout, to);
                        assert!(!q.is_null());
                        assert!(aligned(q, align), "{from} → {to} bytes at {align}: {q:p}");
                        for i in 0..from.min(to) {
                            assert_eq!(*q.add(i), i as u8, "{from} → {to} at {align}, byte {i}");
                        }
                        a.dealloc(q, Layout::from_size_align(to, align).unwrap());
                    }
                }
            }
        }
    }

    /// The point of this allocator: a word-aligned request larger than
    /// mimalloc's small fast path gets the block `mi_malloc` would give.
    /// Through `mi_malloc_aligned`, a size that is exactly a size class
    /// (other than a power of two) was over-allocated into the next one.
    #[test]
    fn word_aligned_requests_get_the_plain_size_class() {
        let a = Mimalloc;
        // The exact size classes between 1 KiB and 64 KiB that are not
        // powers of two: there the over-allocation showed.
        let exact: Vec<usize> = (1025..=65_536)
            // SAFETY: a pure function of its argument.
            .filter(|&n| unsafe { mi::mi_good_size(n) } == n && !n.is_power_of_two())
            .collect();
        assert!(exact.len() > 10, "size classes found: {exact:?}");
        for size in exact {
            let layout = Layout::from_size_align(size, WORD).unwrap();
            // SAFETY: as above.
            unsafe {
                let p = a.alloc(layout);
                assert_eq!(mi::mi_usable_size(p.cast()), size, "{size} bytes");
                a.dealloc(p, layout);
            }
        }
    }
}
