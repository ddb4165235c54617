//! Standby images: a file restored from one backup, brought forward by
//! `apply` to each newer backup of its image; and what a crash, a cancel or
//! a torn journal leaves.

use super::*;
use crate::standby::{Applied, Delta, apply, recover};

/// A backup of the image at `path` as image `image` (so that backups taken
/// one after another are of one image, as a standby needs).
async fn take_of(env: &Env, image: Uuid, name: &str, path: &Path) -> Manifest {
    let size = std::fs::metadata(path).unwrap().len();
    let mut md = meta(name, size);
    md.image.id = image;
    md.image.name = "followed".to_string();
    backup(
        &env.target,
        md,
        File::open(path).unwrap(),
        Arc::new(AllocateJob::default()),
        Arc::new(Counters::default()),
    )
    .await
    .unwrap()
    .expect("not cancelled")
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap()
}

fn new_journal(env: &Env, name: &str) -> (PathBuf, File) {
    let path = env.images.join(name);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    (path, f)
}

/// Applies `next` onto the standby at `standby` with a new journal named
/// `journal`: the result and the journal's path.
async fn apply_onto(
    env: &Env,
    held: &Manifest,
    next: &Manifest,
    standby: &Path,
    journal: &str,
    job: Arc<AllocateJob>,
) -> (Result<Applied>, PathBuf) {
    let (path, j) = new_journal(env, journal);
    let r = apply(&env.target, held, next, open_rw(standby), j, job).await;
    (r, path)
}

fn recover_at(journal: &Path, standby: &Path) -> Result<Option<Manifest>> {
    recover(&File::open(journal).unwrap(), &open_rw(standby))
}

fn write_at(path: &Path, offset: u64, data: &[u8]) {
    let f = open_rw(path);
    f.write_all_at(data, offset).unwrap();
    f.sync_all().unwrap();
}

/// Makes `[offset, offset + len)` a hole.
fn punch(path: &Path, offset: u64, len: u64) {
    let f = open_rw(path);
    rustix::fs::fallocate(
        &f,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        offset,
        len,
    )
    .unwrap();
    f.sync_all().unwrap();
}

fn grow(path: &Path, size: u64) {
    let f = open_rw(path);
    assert!(f.metadata().unwrap().len() < size);
    f.set_len(size).unwrap();
    f.sync_all().unwrap();
}

/// Panics naming the first offset where the file at `path` is not `want`
/// (a plain `assert_eq!` would print megabytes).
fn assert_holds(path: &Path, want: &[u8], what: &str) {
    let got = std::fs::read(path).unwrap();
    if got.len() != want.len() {
        panic!(
            "{what}: the file is {} bytes, not {}",
            got.len(),
            want.len()
        );
    }
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: the file differs first at offset {at} (chunk {}): {} where {} was due",
            at as u64 / C,
            got[at],
            want[at]
        );
    }
}

/// A standby restored from backup 1 of an image follows backups 2 to 5,
/// each taken after the image changed: a chunk overwritten, one written
/// new, one punched out or written zeros, once the image grown by two
/// chunks. After each apply the standby is the image, byte for byte, and
/// only the changed chunks came from the target.
async fn follow_five_backups(env: &Env) {
    let id = Uuid::new_v4();
    let size = 6 * C + 5000;
    let src = image(
        env,
        "src",
        size,
        &[
            (0, pattern(1, C as usize)),
            // Chunk 1 a hole.
            (2 * C, pattern(2, C as usize)),
            // Chunk 3: data in its middle, holes around it.
            (3 * C + 4096 * 5, pattern(3, 100_000)),
            // Chunk 4 a hole.
            (5 * C, pattern(5, C as usize)),
            // The 5000-byte tail chunk.
            (6 * C, pattern(6, 5000)),
        ],
    );
    let mut held = take_of(env, id, "b1", &src).await;
    let standby = restore_to(env, &held, "standby").await.unwrap();
    assert_holds(
        &standby,
        &std::fs::read(&src).unwrap(),
        "the restored standby",
    );

    for step in 2..=5u8 {
        let seed = 10 * step;
        match step {
            2 => {
                write_at(&src, C / 2, &pattern(seed, 1000)); // chunk 0 changed
                write_at(&src, C, &pattern(seed + 1, C as usize)); // chunk 1 new
                punch(&src, 2 * C, C); // chunk 2 punched out
            }
            3 => {
                // Grown by two chunks: the old 5000-byte tail chunk becomes
                // a whole one (same data, more zeros: another hash), and a
                // chunk is written past the old end.
                grow(&src, 8 * C + 5000);
                write_at(&src, 7 * C, &pattern(seed, C as usize)); // chunk 7 new
                write_at(&src, 3 * C + 17, b"changed"); // chunk 3 changed
            }
            4 => {
                write_at(&src, 5 * C, &vec![0; C as usize]); // chunk 5 written zeros
                write_at(&src, 4 * C, &pattern(seed, C as usize)); // chunk 4 new
                write_at(&src, C + 99, &pattern(seed + 1, 10)); // chunk 1 changed
            }
            _ => {
                // Chunks 0 and 1 (adjacent) to zeros, one each way.
                punch(&src, 0, C);
                write_at(&src, C, &vec![0; C as usize]);
                write_at(&src, 8 * C, &pattern(seed, 5000)); // tail chunk 8 new
                write_at(&src, 7 * C + 1, &pattern(seed + 1, 3)); // chunk 7 changed
            }
        }
        let next = take_of(env, id, &format!("b{step}"), &src).await;
        let delta = Delta::between(&held, &next);
        let image_size = next.image.size_bytes;
        assert!(
            delta.zero_bytes() > 0 || step == 3,
            "step {step}: a chunk with data became zeros: {delta:?}"
        );
        let job = Arc::new(AllocateJob::default());
        let (r, journal) = apply_onto(
            env,
            &held,
            &next,
            &standby,
            &format!("journal-{step}"),
            Arc::clone(&job),
        )
        .await;
        let applied = r.unwrap();
        assert_holds(
            &standby,
            &std::fs::read(&src).unwrap(),
            &format!("the standby after backup {step}"),
        );
        assert_eq!(
            applied,
            Applied {
                chunks: delta.fetch.len() as u64,
                fetched_bytes: delta.fetch_bytes(),
                zeroed_bytes: delta.zero_bytes(),
                cancelled: false,
            },
            "step {step}"
        );
        assert!(
            applied.fetched_bytes <= 3 * C && applied.fetched_bytes < image_size / 2,
            "step {step}: only the changed chunks are fetched: {applied:?} of an image of {image_size}"
        );
        assert_eq!(
            (job.done_bytes.load(Relaxed), job.total_bytes.load(Relaxed)),
            (applied.fetched_bytes, applied.fetched_bytes)
        );
        // The cost: the fetched bytes once more, in the journal.
        let jlen = std::fs::metadata(&journal).unwrap().len();
        assert!(
            jlen > applied.fetched_bytes && jlen < applied.fetched_bytes + 64 * 1024,
            "step {step}: journal of {jlen} bytes for {applied:?}"
        );
        // A start before the caller deleted the journal replays it again,
        // changing nothing.
        let again = recover_at(&journal, &standby).unwrap();
        assert_eq!(again.as_ref(), Some(&next), "step {step}");
        assert_holds(
            &standby,
            &std::fs::read(&src).unwrap(),
            &format!("the standby replayed again after backup {step}"),
        );
        std::fs::remove_file(&journal).unwrap();
        held = next;
    }

    // Zeros are punched out: the standby is as sparse as a restore.
    let blocks = std::fs::metadata(&standby).unwrap().blocks() * 512;
    assert!(
        blocks <= held.stored_bytes + 64 * 1024,
        "the standby holds {blocks} bytes of blocks for {} bytes of data",
        held.stored_bytes
    );
    let fresh = restore_to(env, &held, "fresh").await.unwrap();
    assert_holds(
        &standby,
        &std::fs::read(&fresh).unwrap(),
        "a restore of the last backup",
    );
}

#[tokio::test]
async fn a_standby_follows_five_backups_of_a_changing_image_on_a_directory() {
    follow_five_backups(&env()).await;
}

#[tokio::test]
async fn a_standby_follows_five_backups_of_a_changing_image_on_s3() {
    follow_five_backups(&s3_env()).await;
}

/// Two backups of one image and a standby holding the first.
struct Pair {
    src: PathBuf,
    held: Manifest,
    next: Manifest,
    standby: PathBuf,
    held_bytes: Vec<u8>,
    next_bytes: Vec<u8>,
}

/// Between the two backups: chunks 0 and 2 change, chunk 1 is punched out,
/// and the image grows by two chunks of data; so the delta is four chunks
/// to fetch and one to zero, and the size changes.
async fn pair(env: &Env) -> Pair {
    let id = Uuid::new_v4();
    let src = image(
        env,
        "src",
        4 * C,
        &[
            (0, pattern(1, C as usize)),
            (C, pattern(2, C as usize)),
            (2 * C, pattern(3, C as usize)),
        ],
    );
    let held = take_of(env, id, "held", &src).await;
    let held_bytes = std::fs::read(&src).unwrap();
    let standby = restore_to(env, &held, "standby").await.unwrap();
    write_at(&src, 10, b"changed");
    punch(&src, C, C);
    write_at(&src, 2 * C + 10, b"changed");
    grow(&src, 6 * C);
    write_at(&src, 4 * C, &pattern(4, C as usize));
    write_at(&src, 5 * C, &pattern(5, C as usize));
    let next = take_of(env, id, "next", &src).await;
    let next_bytes = std::fs::read(&src).unwrap();
    let delta = Delta::between(&held, &next);
    assert_eq!(
        delta.fetch.iter().map(|c| c.index).collect::<Vec<_>>(),
        [0, 2, 4, 5]
    );
    assert_eq!(delta.zero, [(C, C)]);
    Pair {
        src,
        held,
        next,
        standby,
        held_bytes,
        next_bytes,
    }
}

/// A complete journal of `p.next` for `p.standby`, written by an apply onto
/// a copy of the standby, so the standby itself is as a crash right after
/// the journal's fsync leaves it: untouched.
async fn complete_journal(env: &Env, p: &Pair) -> PathBuf {
    let scratch = env.images.join("scratch");
    std::fs::copy(&p.standby, &scratch).unwrap();
    let (r, journal) = apply_onto(
        env,
        &p.held,
        &p.next,
        &scratch,
        "journal",
        Arc::new(AllocateJob::default()),
    )
    .await;
    assert!(!r.unwrap().cancelled);
    assert_holds(&scratch, &p.next_bytes, "the scratch copy");
    assert_holds(&p.standby, &p.held_bytes, "the standby");
    journal
}

/// A copy of the journal at `journal`, changed by `change`.
fn damaged(journal: &Path, name: &str, change: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(journal).unwrap();
    change(&mut bytes);
    let path = journal.with_file_name(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[tokio::test]
async fn a_cancelled_apply_leaves_the_standby_as_it_was_and_its_journal_incomplete() {
    let env = env();
    let p = pair(&env).await;
    // The gate holds the apply after its first chunk until the cancel.
    let gate = env.images.join("gate");
    std::fs::write(&gate, b"").unwrap();
    let job = Arc::new(AllocateJob {
        gate: Some(gate),
        ..AllocateJob::default()
    });
    let (journal, j) = new_journal(&env, "journal");
    let run = tokio::spawn({
        let (target, held, next, job) = (
            env.target.clone(),
            p.held.clone(),
            p.next.clone(),
            Arc::clone(&job),
        );
        let image = open_rw(&p.standby);
        async move { apply(&target, &held, &next, image, j, job).await }
    });
    for _ in 0..2000 {
        if job.done_bytes.load(Relaxed) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(job.done_bytes.load(Relaxed), C, "held after one chunk");
    job.cancel.store(true, Relaxed);
    let applied = run.await.unwrap().unwrap();
    assert_eq!(
        applied,
        Applied {
            chunks: 1,
            fetched_bytes: C,
            zeroed_bytes: 0,
            cancelled: true,
        }
    );
    assert_holds(&p.standby, &p.held_bytes, "the standby after a cancel");
    assert!(std::fs::metadata(&journal).unwrap().len() > C);
    assert_eq!(recover_at(&journal, &p.standby).unwrap(), None);
    assert_holds(
        &p.standby,
        &p.held_bytes,
        "the standby after recovering a cancelled apply's journal",
    );

    // The caller deletes that journal; the next apply, with a new one, ends.
    std::fs::remove_file(&journal).unwrap();
    let (r, _) = apply_onto(
        &env,
        &p.held,
        &p.next,
        &p.standby,
        "journal-2",
        Arc::new(AllocateJob::default()),
    )
    .await;
    assert_eq!(r.unwrap().chunks, 4);
    assert_holds(
        &p.standby,
        &p.next_bytes,
        "the standby after the next apply",
    );
}

#[tokio::test]
async fn a_truncated_journal_is_incomplete_and_the_standby_stays_as_it_was() {
    let env = env();
    let p = pair(&env).await;
    let journal = complete_journal(&env, &p).await;
    let len = std::fs::metadata(&journal).unwrap().len() as usize;
    // A crash loses the journal's end: the magic, the trailer's length, the
    // trailer, then records.
    for cut in [1, 8, 16, 17, 200, len / 2, len - 17, len - 1] {
        let torn = damaged(&journal, &format!("cut-{cut}"), |b| b.truncate(len - cut));
        assert_eq!(
            recover_at(&torn, &p.standby).unwrap(),
            None,
            "cut by {cut} bytes"
        );
        assert_holds(&p.standby, &p.held_bytes, &format!("cut by {cut} bytes"));
    }
    // Whole, it is complete.
    assert_eq!(
        recover_at(&journal, &p.standby).unwrap().map(|m| m.id),
        Some(p.next.id)
    );
    assert_holds(&p.standby, &p.next_bytes, "the standby replayed");
}

#[tokio::test]
async fn a_complete_journal_finishes_a_replay_a_crash_cut_short() {
    let env = env();
    let p = pair(&env).await;
    let journal = complete_journal(&env, &p).await;
    // A replay cut short: the length not yet set, chunk 0 written, chunk 2
    // half written (garbage in its place), chunk 1 not yet zeroed.
    write_at(&p.standby, 0, &p.next_bytes[..C as usize]);
    write_at(&p.standby, 2 * C, &pattern(99, C as usize / 2));
    let recovered = recover_at(&journal, &p.standby).unwrap();
    assert_eq!(recovered.as_ref(), Some(&p.next));
    assert_holds(&p.standby, &p.next_bytes, "the standby recovered");
    assert_holds(&p.standby, &std::fs::read(&p.src).unwrap(), "the image");

    // Once more with the length already set and garbage over every chunk
    // that changes (all but chunk 3, a hole in both): the same file.
    for i in [0, 1, 2, 4, 5] {
        write_at(&p.standby, i * C, &pattern(90 + i as u8, C as usize));
    }
    assert_eq!(
        recover_at(&journal, &p.standby).unwrap().as_ref(),
        Some(&p.next)
    );
    assert_holds(&p.standby, &p.next_bytes, "the standby recovered again");
}

#[tokio::test]
async fn a_torn_journal_is_incomplete() {
    let env = env();
    let p = pair(&env).await;
    let journal = complete_journal(&env, &p).await;
    let bytes = std::fs::read(&journal).unwrap();
    let len = bytes.len();
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[len - 16..len - 8]);
    let trailer_at = len - 16 - u64::from_le_bytes(word) as usize;
    let find = |what: &[u8]| {
        trailer_at
            + bytes[trailer_at..]
                .windows(what.len())
                .position(|w| w == what)
                .expect("in the trailer")
            + what.len()
    };
    let places = [
        ("the first record's kind", 0),
        ("the first record's offset", 3),
        ("the first record's data", 17 + 1000),
        ("the last chunk's data", trailer_at - 17 - 1),
        // The zero record is the last one: its offset.
        ("the zero record", trailer_at - 17 + 2),
        // Still JSON, but the manifest's checksum fails.
        ("the manifest in the trailer", find(b"\"followed") - 2),
        ("the trailer's record count", find(b"\"records\":")),
        ("the trailer's hash", find(b"\"blake3\":\"") + 10),
        ("the trailer's length", len - 12),
        ("the magic", len - 1),
    ];
    for (what, at) in places {
        let torn = damaged(&journal, &format!("torn-{at}"), |b| b[at] ^= 0x01);
        assert_eq!(recover_at(&torn, &p.standby).unwrap(), None, "{what}");
        assert_holds(&p.standby, &p.held_bytes, what);
    }
}

#[tokio::test]
async fn a_backup_of_another_image_an_older_one_or_one_cut_otherwise_is_refused() {
    let env = env();
    let p = pair(&env).await;
    let other_src = image(&env, "other", 2 * C, &[(0, pattern(7, C as usize))]);
    let other = take(&env, "other", &other_src).await;

    let refused = async |next: &Manifest, journal: &str, rule: &str| {
        let (r, path) = apply_onto(
            &env,
            &p.held,
            next,
            &p.standby,
            journal,
            Arc::new(AllocateJob::default()),
        )
        .await;
        let err = r.unwrap_err();
        match &err {
            Error::StandbyMismatch { held, next: n, .. } => {
                assert_eq!((held.id, n.id), (p.held.id, next.id), "{err}");
            }
            e => panic!("{e}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("'{}' ({})", p.held.name, p.held.id))
                && msg.contains(&format!("'{}' ({})", next.name, next.id))
                && msg.contains(rule),
            "{msg}"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "{msg}");
        assert_holds(&p.standby, &p.held_bytes, &msg);
    };
    refused(&other, "j-other", "different images").await;
    let mut halves = p.next.clone();
    halves.chunk_size = C / 2;
    refused(&halves, "j-halves", "chunks of").await;
    let mut older = p.next.clone();
    older.created_at = p.held.created_at - time::Duration::seconds(1);
    older.seal();
    refused(&older, "j-older", "only moves forward").await;

    // Itself: nothing to do, the journal untouched.
    let (r, path) = apply_onto(
        &env,
        &p.held,
        &p.held,
        &p.standby,
        "j-same",
        Arc::new(AllocateJob::default()),
    )
    .await;
    assert_eq!(r.unwrap(), Applied::default());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    assert_holds(&p.standby, &p.held_bytes, "the standby given itself");
}

#[tokio::test]
async fn an_apply_fails_before_the_standby_is_touched_on_a_missing_chunk_a_used_journal_or_a_wrong_file()
 {
    let env = env();
    let p = pair(&env).await;
    let job = || Arc::new(AllocateJob::default());

    // A journal that holds something is refused: it may be a crash's.
    let (used, j) = new_journal(&env, "used");
    j.write_all_at(b"a crashed apply's", 0).unwrap();
    let err = apply(&env.target, &p.held, &p.next, open_rw(&p.standby), j, job())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Journal { .. }) && err.to_string().contains("new, empty"),
        "{err}"
    );
    assert_eq!(std::fs::read(&used).unwrap(), b"a crashed apply's");

    // A standby file not of the held backup's size is refused.
    let short = env.images.join("short");
    std::fs::write(&short, b"short").unwrap();
    let (r, _) = apply_onto(&env, &p.held, &p.next, &short, "j-short", job()).await;
    let err = r.unwrap_err();
    assert!(
        matches!(&err, Error::Image { backup, .. } if backup.id == p.held.id),
        "{err}"
    );

    // A chunk lost from the target: the error names it, and the journal
    // is left incomplete.
    let lost = Delta::between(&p.held, &p.next).fetch[2].clone();
    std::fs::remove_file(chunk_file(&env, &lost.hash)).unwrap();
    let (r, journal) = apply_onto(&env, &p.held, &p.next, &p.standby, "j-lost", job()).await;
    let err = r.unwrap_err();
    assert!(
        matches!(&err, Error::ChunkMissing { backup, index, .. } if backup.id == p.next.id && *index == lost.index),
        "{err}"
    );
    assert_holds(&p.standby, &p.held_bytes, "after a missing chunk");
    assert_eq!(recover_at(&journal, &p.standby).unwrap(), None);
}

/// A manifest like `m` of an image of `size` bytes with `chunks` (index,
/// hash seed, length).
fn with_chunks(m: &Manifest, size: u64, chunks: &[(u64, u8, u64)]) -> Manifest {
    let mut m = m.clone();
    m.image.size_bytes = size;
    m.chunks = chunks
        .iter()
        .map(|&(index, seed, bytes)| ChunkRef {
            index,
            hash: blake3::hash(&[seed]).to_hex().to_string(),
            bytes,
        })
        .collect();
    m
}

#[tokio::test]
async fn the_delta_fetches_changed_chunks_and_zeroes_dropped_ones_within_the_new_size() {
    let env = env();
    let src = image(&env, "src", C, &[(0, pattern(1, C as usize))]);
    let m = take(&env, "m", &src).await;

    let held = with_chunks(
        &m,
        6 * C,
        &[(0, 1, C), (1, 2, C), (2, 3, C), (4, 4, C), (5, 5, C)],
    );
    // Chunk 0 the same, 1 changed, 2 dropped, 3 new, 4 the same, 5
    // dropped; shrunk to 5.5 chunks, so chunk 5 zeroes only its first half.
    let next = with_chunks(
        &m,
        5 * C + C / 2,
        &[(0, 1, C), (1, 9, C), (3, 6, C), (4, 4, C)],
    );
    let d = Delta::between(&held, &next);
    assert_eq!(d.fetch, [next.chunks[1].clone(), next.chunks[2].clone()]);
    assert_eq!(d.zero, [(2 * C, C), (5 * C, C / 2)]);
    assert_eq!((d.fetch_bytes(), d.zero_bytes()), (2 * C, C + C / 2));

    // The same hash at another length is another chunk (a tail grown whole).
    let held = with_chunks(&m, 2 * C + 10, &[(1, 1, C), (2, 2, 10)]);
    let next = with_chunks(&m, 4 * C, &[(1, 1, C), (2, 2, C)]);
    let d = Delta::between(&held, &next);
    assert_eq!(d.fetch, [next.chunks[1].clone()]);
    assert!(d.zero.is_empty());

    // Everything dropped: adjacent ranges merge into one.
    let held = with_chunks(&m, 3 * C, &[(0, 1, C), (1, 2, C), (2, 3, C)]);
    let next = with_chunks(&m, 3 * C, &[]);
    assert_eq!(
        Delta::between(&held, &next),
        Delta {
            fetch: vec![],
            zero: vec![(0, 3 * C)],
        }
    );
}

/// Measured, not asserted (`cargo test -p blockplane-backup --release --
/// --ignored standby_apply_against_a_full_restore`): a 1 GiB image fully
/// written, then 1% of it (ten 1 MiB writes, spread) changed and backed up
/// again; a standby holding the first backup applies the second, against
/// a full restore of the second into a new file, on one directory target
/// in the same run. Prints bytes fetched and written, the times and their
/// ratio.
#[tokio::test]
#[ignore = "a benchmark: run on purpose, its figures go to docs/benchmarks.md"]
async fn standby_apply_against_a_full_restore_benchmark() {
    const GIB: u64 = 1 << 30;
    let env = env();
    let id = Uuid::new_v4();
    let writes: Vec<(u64, Vec<u8>)> = (0..GIB / C)
        .map(|i| (i * C, pattern(i as u8, C as usize)))
        .collect();
    let path = image(&env, "big", GIB, &writes);
    let one = take_of(&env, id, "one", &path).await;
    for k in 0..10u64 {
        // 1 MiB at every 25th chunk: 10 MiB of 1 GiB, in ten chunks.
        write_at(&path, k * 25 * C + 4096, &pattern(200 + k as u8, 1 << 20));
    }
    let two = take_of(&env, id, "two", &path).await;
    let standby = restore_to(&env, &one, "standby").await.unwrap();
    let delta = Delta::between(&one, &two);

    let started = std::time::Instant::now();
    let restored = restore_to(&env, &two, "full").await.unwrap();
    let full = started.elapsed();
    let started = std::time::Instant::now();
    let (applied, journal) = apply_onto(
        &env,
        &one,
        &two,
        &standby,
        "journal",
        Arc::new(AllocateJob::default()),
    )
    .await;
    let applied = applied.unwrap();
    let took = started.elapsed();
    assert_holds(&standby, &std::fs::read(&path).unwrap(), "the standby");
    let _ = (
        std::fs::remove_file(journal),
        std::fs::remove_file(restored),
    );
    eprintln!(
        "standby apply: {} chunks, {} MiB fetched ({} MiB of changed data in a {} MiB image) in {:.3} s; full restore: {} MiB fetched in {:.3} s; apply / restore: {:.3} of the time, {:.4} of the bytes",
        applied.chunks,
        applied.fetched_bytes >> 20,
        10,
        GIB >> 20,
        took.as_secs_f64(),
        two.stored_bytes >> 20,
        full.as_secs_f64(),
        took.as_secs_f64() / full.as_secs_f64(),
        delta.fetch_bytes() as f64 / two.stored_bytes as f64,
    );
}
