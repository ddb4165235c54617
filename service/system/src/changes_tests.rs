//! Every answer checked against a byte comparison of the same files, on
//! real xfs (reflinked snapshots) and ext4 (full copies) on loop devices.

use super::*;
use crate::extent::testfs::{TestFs, run};
use std::fs::OpenOptions;
use std::path::Path;

const MIB: u64 = 1 << 20;

/// Bytes that differ from block to block and from call to call.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn open_rw(p: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(p)
        .unwrap()
}

fn write(f: &File, offset: u64, bytes: &[u8]) {
    f.write_all_at(bytes, offset).unwrap();
}

fn punch(f: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain fallocate on an fd this test owns.
    let rc = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    assert_eq!(rc, 0, "punch: {}", io::Error::last_os_error());
}

/// A copy of `src` at `dst`: reflinked where the filesystem can.
fn snapshot(src: &Path, dst: &Path, reflink: bool) {
    // cp keeps holes with --sparse=always, which it takes only without
    // --reflink.
    let how = if reflink {
        "--reflink=always"
    } else {
        "--sparse=always"
    };
    run("cp", &[how, src.to_str().unwrap(), dst.to_str().unwrap()]);
}

/// The blocks of the device whose bytes differ, merged: the answer every
/// `delta` must equal.
fn by_comparison(a: &File, a_start: u64, b: &File, layout: Layout) -> Vec<Range> {
    let mut out = Pages::new(usize::MAX - 1);
    let mut x = vec![0; BLOCK as usize];
    let mut y = vec![0; BLOCK as usize];
    let mut at = 0;
    while at < layout.size {
        let n = (layout.size - at).min(BLOCK) as usize;
        read_full(a, a_start + at, &mut x[..n]).unwrap();
        read_full(b, layout.data_start + at, &mut y[..n]).unwrap();
        if x[..n] != y[..n] {
            out.push(Range {
                offset: at,
                length: n as u64,
            });
        }
        at += BLOCK;
    }
    out.finish(Cost::default()).ranges
}

/// The blocks holding a byte other than zero: every one must lie inside an
/// allocated range.
fn nonzero_blocks(f: &File, layout: Layout) -> Vec<u64> {
    let mut buf = vec![0; BLOCK as usize];
    let mut out = Vec::new();
    let mut at = 0;
    while at < layout.size {
        read_full(f, layout.data_start + at, &mut buf).unwrap();
        if buf.iter().any(|&b| b != 0) {
            out.push(at);
        }
        at += BLOCK;
    }
    out
}

/// Every page of an answer, one `max` at a time, joined.
fn all_pages(max: usize, mut page: impl FnMut(u64) -> Ranges) -> (Vec<Range>, Cost) {
    let mut out: Vec<Range> = Vec::new();
    let mut cost = Cost::default();
    let mut from = 0;
    loop {
        let p = page(from);
        assert!(p.ranges.len() <= max, "a page holds at most max ranges");
        cost.mapped_bytes += p.cost.mapped_bytes;
        cost.compared_bytes += p.cost.compared_bytes;
        // A range may go on where the last page stopped: one range.
        for r in p.ranges {
            match out.last_mut() {
                Some(last) if last.end() == r.offset => last.length += r.length,
                _ => out.push(r),
            }
        }
        match p.next {
            Some(n) => {
                assert!(n > from, "pages advance");
                from = n;
            }
            None => return (out, cost),
        }
    }
}

/// An image with data at 0..4 MiB and 16..20 MiB, holes elsewhere, and its
/// second generation: 3 blocks rewritten with new bytes, one rewritten
/// with the bytes it held, one zeroed, 1 MiB punched, and 8 KiB written in
/// a hole.
struct Generations {
    first: File,
    second: File,
    layout: Layout,
    // Last: fields drop in order, and the files must close before unmount.
    _fs: TestFs,
}

fn generations(fs: &str, reflink: bool, data_start: u64) -> Generations {
    let tfs = TestFs::new(fs);
    let dir = Path::new(&tfs.mnt()).to_path_buf();
    let size = 32 * MIB;
    let live = dir.join("live.raw");
    let f = open_rw(&live);
    f.set_len(data_start + size).unwrap();
    write(&f, data_start, &pattern(1, 4 * MIB as usize));
    write(&f, data_start + 16 * MIB, &pattern(2, 4 * MIB as usize));
    f.sync_all().unwrap();
    snapshot(&live, &dir.join("first.raw"), reflink);

    write(&f, data_start + 12 * 1024, &pattern(3, 3 * BLOCK as usize));
    let same = pattern(1, 4 * MIB as usize);
    write(
        &f,
        data_start + MIB,
        &same[MIB as usize..(MIB + BLOCK) as usize],
    );
    write(&f, data_start + 2 * MIB, &[0; BLOCK as usize]);
    punch(&f, data_start + 17 * MIB, MIB);
    write(&f, data_start + 9 * MIB, &pattern(4, 2 * BLOCK as usize));
    f.sync_all().unwrap();
    snapshot(&live, &dir.join("second.raw"), reflink);

    Generations {
        first: File::open(dir.join("first.raw")).unwrap(),
        second: File::open(dir.join("second.raw")).unwrap(),
        layout: Layout { data_start, size },
        _fs: tfs,
    }
}

fn expected_delta() -> Vec<Range> {
    vec![
        Range {
            offset: 12 * 1024,
            length: 3 * BLOCK,
        },
        Range {
            offset: 2 * MIB,
            length: BLOCK,
        },
        Range {
            offset: 9 * MIB,
            length: 2 * BLOCK,
        },
        Range {
            offset: 17 * MIB,
            length: MIB,
        },
    ]
}

fn check(g: &Generations) -> Cost {
    let want = by_comparison(&g.first, g.layout.data_start, &g.second, g.layout);
    assert_eq!(want, expected_delta(), "the test's own comparison");
    let got = delta(
        &g.first,
        &g.second,
        g.layout.data_start,
        g.layout,
        0,
        usize::MAX - 1,
    )
    .unwrap();
    assert_eq!(got.ranges, want);
    assert_eq!(got.next, None);
    assert_eq!(
        got.cost.mapped_bytes + got.cost.compared_bytes,
        g.layout.size
    );

    // Page by page, one range at a time and three at a time: the same.
    for max in [1, 3] {
        let (paged, _) = all_pages(max, |from| {
            delta(
                &g.first,
                &g.second,
                g.layout.data_start,
                g.layout,
                from,
                max,
            )
            .unwrap()
        });
        assert_eq!(paged, want, "paged by {max}");
    }

    // A page that may compare only 8 KiB: pages end early (some with no
    // range), and together they are the same answer.
    let (budgeted, cost) = all_pages(usize::MAX - 1, |from| {
        delta_within(
            &g.first,
            &g.second,
            g.layout.data_start,
            g.layout,
            from,
            usize::MAX - 1,
            8192,
        )
        .unwrap()
    });
    assert_eq!(budgeted, want, "paged by the compare budget");
    assert!(cost.compared_bytes >= got.cost.compared_bytes);

    // Allocated: every block with a byte other than zero lies in a range.
    let (alloc, _) = all_pages(2, |from| allocated(&g.second, g.layout, from, 2).unwrap());
    for b in nonzero_blocks(&g.second, g.layout) {
        assert!(
            alloc.iter().any(|r| r.offset <= b && b < r.end()),
            "block at {b} holds data outside every allocated range {alloc:?}"
        );
    }
    let held: u64 = alloc.iter().map(|r| r.length).sum();
    assert!(
        held <= 8 * MIB + 2 * BLOCK,
        "allocated {held} bytes: more than was written ({alloc:?})"
    );
    got.cost
}

#[test]
fn reflinked_snapshots_on_xfs_compare_only_what_was_written() {
    let g = generations("xfs", true, 0);
    let cost = check(&g);
    // The rewritten, zeroed and new blocks, and the punched MiB against
    // its old extent: a few MiB at most, never the whole image.
    assert!(
        cost.compared_bytes <= 2 * MIB,
        "compared {} bytes of {}",
        cost.compared_bytes,
        g.layout.size
    );
}

#[test]
fn full_copies_on_ext4_are_compared_where_either_holds_data() {
    let g = generations("ext4", false, 0);
    let cost = check(&g);
    assert!(
        cost.compared_bytes >= 8 * MIB,
        "compared only {} bytes",
        cost.compared_bytes
    );
}

#[test]
fn an_encrypted_images_ranges_are_its_payloads() {
    // A header of 16 MiB before the device's bytes, as LUKS2 lays out.
    let g = generations("xfs", true, 16 * MIB);
    check(&g);
}

#[test]
fn a_shorter_base_reads_as_zeroes_past_its_end() {
    let g = generations("xfs", true, 0);
    let grown = Layout {
        data_start: 0,
        size: g.layout.size + 2 * MIB,
    };
    let got = delta(&g.first, &g.second, 0, grown, 0, 100).unwrap();
    assert_eq!(got.ranges, expected_delta());
    let past = delta(&g.first, &g.second, 0, grown, 40 * MIB, 100).unwrap();
    assert_eq!(past.ranges, vec![]);
    assert_eq!(past.next, None);
}

/// Drops every clean page from the page cache (the test filesystem's
/// loop device caches its backing file's pages too), so that the next
/// read comes from the disk.
fn uncache() {
    run("sync", &[]);
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

/// Reads a whole file, as a backup tool without changed-block tracking
/// must.
fn read_all(f: &File, size: u64) -> u64 {
    let mut buf = vec![0; READ_STEP];
    let mut at = 0;
    while at < size {
        let n = (size - at).min(READ_STEP as u64) as usize;
        read_full(f, at, &mut buf[..n]).unwrap();
        at += n as u64;
    }
    at
}

/// The delta of two reflinked snapshots of a 1 GiB image (1% changed
/// between them, in 160 writes of 64 KiB spread over it) against reading
/// both, cold, in the same run; and the same two generations as full
/// copies on ext4, where the delta must read both. Prints one line per
/// case. Run: `cargo test -p blockplane-system --release --lib --
/// --ignored snapshot_delta_against_reading_both --nocapture`.
#[test]
#[ignore = "benchmark: run on purpose, prints figures"]
fn snapshot_delta_against_reading_both_benchmark() {
    for (fs, reflink) in [("xfs", true), ("ext4", false)] {
        let tfs = TestFs::sized(fs, 4 << 30);
        let dir = Path::new(&tfs.mnt()).to_path_buf();
        let size = 1 << 30;
        let live = dir.join("live.raw");
        let f = open_rw(&live);
        for i in 0..size / (16 * MIB) {
            write(&f, i * 16 * MIB, &pattern(i + 1, 16 * MIB as usize));
        }
        f.sync_all().unwrap();
        snapshot(&live, &dir.join("a.raw"), reflink);
        let step = (size / 160) & !(BLOCK - 1);
        for i in 0..160 {
            write(&f, i * step + 4096, &pattern(1000 + i, 64 << 10));
        }
        f.sync_all().unwrap();
        snapshot(&live, &dir.join("b.raw"), reflink);
        drop(f);
        let (a, b) = (
            File::open(dir.join("a.raw")).unwrap(),
            File::open(dir.join("b.raw")).unwrap(),
        );
        let layout = Layout {
            data_start: 0,
            size,
        };

        uncache();
        let t = std::time::Instant::now();
        let d = delta(&a, &b, 0, layout, 0, usize::MAX - 1).unwrap();
        let delta_s = t.elapsed().as_secs_f64();
        let changed: u64 = d.ranges.iter().map(|r| r.length).sum();
        assert_eq!(changed, 160 * (64 << 10), "the delta is the writes");

        uncache();
        let t = std::time::Instant::now();
        let read = read_all(&a, size) + read_all(&b, size);
        let both_s = t.elapsed().as_secs_f64();
        println!(
            "SNAPSHOT-DELTA fs={fs} reflinked={reflink} image=1024MiB changed={}KiB ranges={} \
             compared={}MiB delta={delta_s:.3}s read_both={}MiB in {both_s:.3}s ratio={:.4}",
            changed >> 10,
            d.ranges.len(),
            d.cost.compared_bytes >> 20,
            read >> 20,
            delta_s / both_s
        );
        drop((a, b));
        drop(tfs);
    }
}
