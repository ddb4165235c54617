//! Moving an image's blocks under a volume, as someone who unpins the image
//! and rewrites its head would: the drift a direct map's check must catch.
//! Shared by the kernel e2e tests and the CSI tests that run in the VM.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

/// Moves the first `len` bytes of `img` to other blocks of its filesystem,
/// as someone who unpins an image and rewrites its head would: clears its
/// immutable pin, punches the range, lets a filler file in `filler_dir`
/// take the freed space, and writes the same bytes back, until `filefrag`
/// shows the first extent elsewhere (the allocator may hand the same blocks
/// back). The data is unchanged; only where it lives moves, which is what a
/// direct map's drift check must catch. Panics if the blocks never moved.
pub fn move_first_blocks(img: &Path, len: u64, filler_dir: &Path) {
    let run = |cmd: &str, args: &[&str]| {
        let out = Command::new(cmd).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let p = img.to_str().unwrap();
    // The physical start of extent 0 in `filefrag -v`'s table.
    let first_block = || {
        run("filefrag", &["-v", p])
            .lines()
            .find(|l| l.trim_start().starts_with("0:"))
            .and_then(|l| l.split_whitespace().nth(3).map(str::to_string))
            .unwrap_or_default()
    };
    let before = first_block();
    run("chattr", &["-i", p]);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let mut head = vec![0u8; len as usize];
    f.read_exact_at(&mut head, 0).unwrap();
    for attempt in 0..4 {
        let filler = filler_dir.join(format!("filler{attempt}"));
        run(
            "fallocate",
            &[
                "--punch-hole",
                "--offset",
                "0",
                "--length",
                &len.to_string(),
                p,
            ],
        );
        run(
            "fallocate",
            &["-l", &len.to_string(), filler.to_str().unwrap()],
        );
        f.write_all_at(&head, 0).unwrap();
        f.sync_all().unwrap();
        if first_block() != before {
            return;
        }
    }
    panic!("could not move the first blocks of {p} (still at {before})");
}
