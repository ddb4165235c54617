//! One moment of a writable volume where the image's filesystem cannot share
//! extents (ext4): copy-before-write. The queues are held once, with no
//! request inside, to begin the moment; from then on a copier thread copies
//! the image into the new file chunk by chunk, and a write to a chunk not yet
//! copied first copies it itself, so the new file holds every write completed
//! before the moment and none after, without holding I/O for the copy.
//!
//! Each chunk's state is the only thing the queues and the copier share while
//! a copy runs: one atomic byte per chunk, claimed with a compare-exchange so
//! a chunk is copied exactly once, before any write of it. Outside a copy the
//! queues share nothing (the moment is `None` in their config). The copy of
//! a chunk runs on the queue's thread, so the first write to a chunk, and
//! every request of its queue behind it, waits for that chunk's read and
//! write; a request over k chunks not yet copied (a large WRITE_ZEROES)
//! waits for k. That is the cost to writes while the copy runs. A DISCARD
//! changes nothing then (`io`): it promises nothing of the data.
//!
//! A chunk that cannot be kept (the new file's disk full, an I/O error)
//! abandons the moment rather than fail the volume's write: the copy ends
//! `failed`, the control plane removes its file, and the write goes on.

use std::alloc::Layout;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

/// Bytes copied at a time: what a first write to a chunk waits for.
pub(crate) const CHUNK: u64 = 1 << 20;

/// Alignment of reads from an `O_DIRECT` image.
const ALIGN: usize = 4096;

const TODO: u8 = 0;
const COPYING: u8 = 1;
const KEPT: u8 = 2;

/// A moment being copied into its file.
pub(crate) struct Moment {
    /// The image, as the data path reads it.
    src: File,
    /// The new file, as long as the image.
    dest: File,
    /// The new file takes `O_DIRECT`: chunks bypass the page cache, so a
    /// copy leaves no dirty pages for writeback to wait on (this worker
    /// serves a device that writeback may be flushing).
    dest_direct: bool,
    size: u64,
    chunks: Box<[AtomicU8]>,
    /// A chunk of zeros, to tell a chunk of zeros with one `memcmp`.
    zeros: Box<[u8]>,
    /// Writes stop keeping chunks: the copy failed or was cancelled.
    abandoned: AtomicBool,
    cancelled: AtomicBool,
    error: Mutex<Option<String>>,
}

impl Moment {
    /// A moment of an image of `size` bytes, nothing of it copied yet.
    pub fn new(src: File, dest: File, size: u64) -> Self {
        let n = size.div_ceil(CHUNK) as usize;
        let dest_direct = rustix::fs::fcntl_getfl(&dest)
            .and_then(|f| rustix::fs::fcntl_setfl(&dest, f | rustix::fs::OFlags::DIRECT))
            .is_ok();
        Self {
            src,
            dest,
            dest_direct,
            size,
            chunks: (0..n).map(|_| AtomicU8::new(TODO)).collect(),
            zeros: vec![0; CHUNK as usize].into_boxed_slice(),
            abandoned: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
            error: Mutex::new(None),
        }
    }

    /// Before a write of `[off, off + len)`: copies each chunk of it that
    /// the copy has not kept yet (a queue thread's side; blocks the thread
    /// for each chunk's copy, or while another thread copies it).
    pub fn keep(&self, off: u64, len: u64, buf: &mut ChunkBuf) {
        let end = (off + len).min(self.size);
        let mut at = off - off % CHUNK;
        while at < end {
            if self.abandoned.load(Ordering::Acquire) {
                return;
            }
            self.claim((at / CHUNK) as usize, buf);
            at += CHUNK;
        }
    }

    /// Copies chunk `i` unless it is kept; waits while another thread copies
    /// it. Returns once it is kept (or the moment abandoned).
    fn claim(&self, i: usize, buf: &mut ChunkBuf) {
        let state = &self.chunks[i];
        loop {
            match state.compare_exchange(TODO, COPYING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    if let Err(e) = self.copy_chunk(i, buf) {
                        self.abandon(format!(
                            "keeping bytes {}..{} of the moment failed: {e}",
                            i as u64 * CHUNK,
                            (i as u64 + 1) * CHUNK
                        ));
                    }
                    // After the abandon (if any): whoever waits for this
                    // chunk sees the moment lost before the chunk released.
                    state.store(KEPT, Ordering::Release);
                    return;
                }
                Err(KEPT) => return,
                Err(_) => {
                    if self.abandoned.load(Ordering::Acquire) {
                        return;
                    }
                    // Another thread copies it: at most one chunk's I/O.
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    /// Copies chunk `i` from the image into the new file: holes and zeros
    /// are left as holes.
    fn copy_chunk(&self, i: usize, buf: &mut ChunkBuf) -> std::io::Result<()> {
        let off = i as u64 * CHUNK;
        let n = (self.size - off).min(CHUNK) as usize;
        match rustix::fs::seek(&self.src, rustix::fs::SeekFrom::Data(off)) {
            Ok(data) if data >= off + n as u64 => return Ok(()),
            Err(rustix::io::Errno::NXIO) => return Ok(()),
            _ => {}
        }
        // O_DIRECT reads whole blocks; only at the end does one come back
        // short (then it is not a multiple of the block).
        let want = n.next_multiple_of(ALIGN);
        let bytes = buf.bytes();
        let mut got = 0;
        while got < n {
            match self.src.read_at(&mut bytes[got..want], off + got as u64) {
                Ok(0) => break,
                Ok(r) if (got + r) % ALIGN != 0 => {
                    got += r;
                    break;
                }
                Ok(r) => got += r,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let got = got.min(n);
        if bytes[..got] == self.zeros[..got] {
            return Ok(());
        }
        // Past the image's end reads as zeros; an O_DIRECT write is whole
        // blocks, trimmed back to the image's size at the end.
        bytes[got..want].fill(0);
        let len = if self.dest_direct { want } else { n };
        self.dest.write_all_at(&bytes[..len], off)
    }

    /// Gives the moment up: writes stop keeping chunks.
    fn abandon(&self, why: String) {
        self.error
            .lock()
            .expect("moment poisoned")
            .get_or_insert(why);
        self.abandoned.store(true, Ordering::Release);
    }

    /// Asks the copy to stop ([`Moment::run`] ends `Ok(false)`).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.abandoned.store(true, Ordering::Release);
    }

    /// The copier's side: copies every chunk the writes have not, reporting
    /// bytes done to `progress`, pausing `pace` after each chunk (a test
    /// fault) and while `gate` exists (a test fault: a copy held mid-way
    /// until a test lets it go). Then flushes the new file. `Ok(true)`:
    /// the file holds the moment; `Ok(false)`: cancelled.
    pub fn run(
        &self,
        pace: Duration,
        gate: Option<&PathBuf>,
        mut progress: impl FnMut(u64),
    ) -> Result<bool, String> {
        let mut buf = ChunkBuf::new();
        for i in 0..self.chunks.len() {
            if self.abandoned.load(Ordering::Acquire) {
                break;
            }
            self.claim(i, &mut buf);
            progress(((i as u64 + 1) * CHUNK).min(self.size));
            std::thread::sleep(pace);
            while gate.is_some_and(|g| g.exists()) && !self.abandoned.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if self.cancelled.load(Ordering::Acquire) {
            return Ok(false);
        }
        if self.abandoned.load(Ordering::Acquire) {
            let why = self.error.lock().expect("moment poisoned").clone();
            return Err(why.unwrap_or_else(|| "the moment was abandoned".into()));
        }
        if self.dest_direct {
            self.dest
                .set_len(self.size)
                .map_err(|e| format!("trim the moment's file to the image's size: {e}"))?;
        }
        self.dest
            .sync_data()
            .map_err(|e| format!("fdatasync the moment's file: {e}"))?;
        Ok(true)
    }
}

/// One chunk's buffer, aligned for `O_DIRECT`: each queue thread allocates
/// one the first time a write keeps a chunk, never one per request.
pub(crate) struct ChunkBuf(std::ptr::NonNull<u8>);

impl ChunkBuf {
    fn layout() -> Layout {
        Layout::from_size_align(CHUNK as usize, ALIGN).expect("valid layout")
    }

    /// A zeroed buffer.
    pub fn new() -> Self {
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        Self(
            std::ptr::NonNull::new(p)
                .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout())),
        )
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `CHUNK` bytes allocated in `new`, owned by this buffer and
        // borrowed mutably through it alone.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), CHUNK as usize) }
    }
}

impl Drop for ChunkBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.0.as_ptr(), Self::layout()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;

    fn image(size: u64, fill: impl Fn(u64) -> u8) -> (tempfile::TempDir, File, File) {
        let dir = tempfile::tempdir().unwrap();
        let mut f = File::create(dir.path().join("img")).unwrap();
        let bytes: Vec<u8> = (0..size).map(&fill).collect();
        f.write_all(&bytes).unwrap();
        let src = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join("img"))
            .unwrap();
        let dest = File::create(dir.path().join("moment")).unwrap();
        dest.set_len(size).unwrap();
        (dir, src, dest)
    }

    #[test]
    fn writes_during_the_copy_never_reach_the_moment_and_its_zeros_stay_holes() {
        // Not a whole block at the end: the last chunk is 512 bytes.
        let size = 5 * CHUNK + 512;
        let (dir, src, dest) = image(size, |i| {
            if i < 2 * CHUNK {
                0
            } else {
                (i % 251) as u8 + 1
            }
        });
        let writer = src.try_clone().unwrap();
        let m = Arc::new(Moment::new(src, dest, size));
        let gate = dir.path().join("gate");
        File::create(&gate).unwrap();
        let copier = {
            let (m, gate) = (m.clone(), gate.clone());
            std::thread::spawn(move || m.run(Duration::ZERO, Some(&gate), |_| {}))
        };
        // The copier waits at its gate after chunk 0; writes land everywhere.
        let mut buf = ChunkBuf::new();
        for off in [CHUNK / 2, 3 * CHUNK + 7, size - 10] {
            m.keep(off, 4096.min(size - off), &mut buf);
            writer
                .write_all_at(&[0xee; 4096][..4096.min((size - off) as usize)], off)
                .unwrap();
        }
        std::fs::remove_file(&gate).unwrap();
        assert_eq!(copier.join().unwrap(), Ok(true));
        let got = std::fs::read(dir.path().join("moment")).unwrap();
        let want: Vec<u8> = (0..size)
            .map(|i| {
                if i < 2 * CHUNK {
                    0
                } else {
                    (i % 251) as u8 + 1
                }
            })
            .collect();
        assert!(
            got == want,
            "the moment's file differs from the image before the writes"
        );
        let blocks = rustix::fs::stat(dir.path().join("moment"))
            .unwrap()
            .st_blocks as u64
            * 512;
        assert!(
            blocks <= size - 2 * CHUNK + 4096,
            "the zero chunks were written: {blocks} bytes allocated"
        );
    }

    #[test]
    fn a_cancel_stops_the_copy_and_writes_stop_keeping_chunks() {
        let size = 4 * CHUNK;
        let (dir, src, dest) = image(size, |_| 7);
        let m = Moment::new(src, dest, size);
        m.cancel();
        assert_eq!(m.run(Duration::ZERO, None, |_| {}), Ok(false));
        let mut buf = ChunkBuf::new();
        m.keep(0, size, &mut buf);
        let got = std::fs::read(dir.path().join("moment")).unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "a cancelled moment copied a chunk"
        );
    }
}
