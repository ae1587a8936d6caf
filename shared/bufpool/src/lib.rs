//! Buffers lent out as [`Bytes`] and recycled once the last `Bytes` cut from them is dropped.
//!
//! A data path that reads (or copies) into large buffers and hands them to HTTP/2 as `Bytes`
//! would otherwise allocate one buffer per chunk; with glibc's allocator a 256 KiB buffer is an
//! `mmap`/trim and 64 page faults each time. A [`BufPool`] keeps at most `keep` buffers:
//! [`BufPool::take`] pops one (or allocates), [`BufPool::lend`] turns a filled buffer into
//! `Bytes` without a copy, and the buffer comes back to the pool when h2 has written and dropped
//! the last `Bytes` referring to it.
//!
//! Layout: one type, [`BufPool`] (a cheap clone of a shared free list), and the private `Lent`
//! owner behind each lent `Bytes`. A pool can be *released* ([`BufPool::release`]): its free
//! buffers are dropped and buffers returning afterwards are freed rather than kept, until the
//! next [`BufPool::take`] — the tunnel pump's idle streams hold no buffer. A buffer whose pool is
//! gone is simply freed.
//!
//! Used by `tether-tunnel`'s `TcpChunkReader` (socket reads on broker and agent) and
//! `tether-client`'s `ChunkPool` (the SDK's writes and `tetherctl proxy connect`'s reads).

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// A small free list of buffers, shared by the buffers it lent out.
#[derive(Clone)]
pub struct BufPool {
    inner: Arc<Mutex<State>>,
}

struct State {
    free: Vec<Vec<u8>>,
    /// Buffers kept for reuse at most.
    keep: usize,
    /// False once released (until the next `take`): returning buffers are freed, not kept.
    active: bool,
}

/// A buffer lent out as `Bytes`; returns to its pool when the last `Bytes` cut from it drops.
struct Lent {
    buf: Vec<u8>,
    pool: Weak<Mutex<State>>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade()
            && let Ok(mut p) = pool.lock()
            && p.active
            && p.free.len() < p.keep
        {
            let mut buf = std::mem::take(&mut self.buf);
            buf.clear();
            p.free.push(buf);
        }
    }
}

impl BufPool {
    /// A pool that keeps at most `keep` free buffers.
    pub fn new(keep: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(State {
                free: Vec::new(),
                keep,
                active: false,
            })),
        }
    }

    /// An empty buffer: a recycled one, or a new one with `capacity` (not zeroed). Makes the
    /// pool active again after [`BufPool::release`].
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        let pooled = self.inner.lock().ok().and_then(|mut p| {
            p.active = true;
            p.free.pop()
        });
        pooled.unwrap_or_else(|| Vec::with_capacity(capacity))
    }

    /// `buf`'s bytes as `Bytes` without a copy; the buffer returns to this pool when the last
    /// `Bytes` cut from it is dropped.
    pub fn lend(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Lent {
            buf,
            pool: Arc::downgrade(&self.inner),
        })
    }

    /// Frees the free buffers; buffers returning from now on are freed too, until the next
    /// [`BufPool::take`].
    pub fn release(&self) {
        if let Ok(mut p) = self.inner.lock() {
            p.active = false;
            p.free = Vec::new();
        }
    }

    /// Whether buffers were taken since the pool was made or last released.
    pub fn is_active(&self) -> bool {
        self.inner.lock().is_ok_and(|p| p.active)
    }

    /// Buffers waiting for reuse.
    pub fn free(&self) -> usize {
        self.inner.lock().map_or(0, |p| p.free.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: usize = 256 * 1024;
    const KEEP: usize = 4;

    #[test]
    fn lent_buffers_come_back_once_the_last_slice_drops() {
        let pool = BufPool::new(KEEP);
        assert!(!pool.is_active());
        let mut a = pool.take(CAP);
        assert!(pool.is_active());
        assert!(a.capacity() >= CAP && a.is_empty());
        a.extend_from_slice(&[7u8; 100_000]);
        let ptr = a.as_ptr();
        let lent = pool.lend(a);
        assert_eq!(lent.len(), 100_000);
        let part = lent.slice(10..20);
        drop(lent);
        assert_eq!(pool.free(), 0, "a slice still holds the buffer");
        assert_eq!(&part[..], &[7u8; 10]);
        drop(part);
        assert_eq!(pool.free(), 1, "returned once the last slice dropped");
        let again = pool.take(CAP);
        assert_eq!(again.as_ptr(), ptr, "the same allocation is reused");
        assert!(again.is_empty());
    }

    #[test]
    fn keeps_at_most_keep_and_nothing_once_released() {
        let pool = BufPool::new(KEEP);
        let lend_many = |n: usize| -> Vec<Bytes> {
            (0..n)
                .map(|_| {
                    let mut b = pool.take(CAP);
                    b.push(1);
                    pool.lend(b)
                })
                .collect()
        };
        drop(lend_many(KEEP + 3));
        assert_eq!(pool.free(), KEEP);
        let out = lend_many(2);
        pool.release();
        assert_eq!(pool.free(), 0);
        assert!(!pool.is_active());
        drop(out);
        assert_eq!(pool.free(), 0, "returns after a release are freed");
        // Buffers lent by a pool that is gone are simply freed.
        let orphan = {
            let p = BufPool::new(KEEP);
            let mut b = p.take(CAP);
            b.push(1);
            p.lend(b)
        };
        drop(orphan);
    }
}
