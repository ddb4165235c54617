//! The ublk device of a worker (libublk): created with user recovery (and
//! reissue where the kernel has it), or recovered after a crashed worker;
//! one thread per queue, one async task per tag.
//!
//! libublk's `run_target` is not used: after the queues exit it always sends
//! STOP_DEV, which would turn a crash-and-recover into a dead device. The same
//! steps are done here by hand, and the device is deleted only when the
//! control plane asks for it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::Arc;

use blockplane_protocol::WorkerSpec;
use blockplane_system::mountinfo;
use io_uring::{opcode, types};
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::{BufDesc, UblkError, UblkFlags, sys};

use super::io::{Buf, IMAGE_SLOT, QueueCtx, RAW_SLOTS, Req};
use super::mailbox::{Mailbox, Queues};
use crate::control;
use crate::shared::Shared;
use blockplane_protocol::DataPath;

/// Every request waits for the device's server to exist; how long a queue
/// thread sleeps in `io_uring_enter` before looking at its tasks again.
const IDLE_WAIT_SECS: u64 = 20;

/// A ublk server must not share a mount namespace with the device's users (a
/// mount of its own device held in its namespace would make its exit wait on
/// itself). Unshare, make everything private, and detach inherited mounts of
/// ublk devices and of blockplane's dm volumes (a dm volume leaving `direct`
/// with a filesystem mounted gets its private ublk worker only then: that
/// worker would hold the mount, and its exit would unmount it through
/// itself).
pub fn private_mount_namespace() -> std::io::Result<()> {
    // SAFETY: called at start, before any thread exists: no other thread can
    // observe the namespace change.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS)? };
    rustix::mount::mount_change(
        "/",
        rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC,
    )?;
    // ublk disks have dynamic (blkext) numbers: collect them from sysfs.
    let ublk_devs: Vec<(u32, u32)> = std::fs::read_dir("/sys/class/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_string_lossy().starts_with("ublkb")
                || std::fs::read_to_string(e.path().join("dm/name"))
                    .is_ok_and(|n| n.starts_with("blockplane-"))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("dev")).ok())
        .filter_map(|d| {
            let (major, minor) = d.trim().split_once(':')?;
            Some((major.parse().ok()?, minor.parse().ok()?))
        })
        .collect();
    if ublk_devs.is_empty() {
        return Ok(());
    }
    for m in mountinfo::mounts()? {
        if ublk_devs.contains(&m.dev) {
            // A mount below one detached before is gone with it (EINVAL):
            // what matters is that none is left, not each call's answer.
            let _ = rustix::mount::unmount(&m.mount_point, rustix::mount::UnmountFlags::DETACH);
        }
    }
    Ok(())
}

/// The ublk feature bits this kernel offers (UBLK_U_CMD_GET_FEATURES).
pub fn kernel_features() -> u64 {
    UblkCtrl::get_features().unwrap_or(0)
}

fn ctrl_flags(features: u64) -> u64 {
    let mut f = u64::from(sys::UBLK_F_USER_RECOVERY);
    // AUTO_BUF_REG: zero copy, the request's pages registered on the queue's
    // ring for each request (kernel 6.16+); copy mode where it is missing.
    // QUIESCE (6.16+): a handover lets the kernel drain the worker's queues.
    for opt in [
        sys::UBLK_F_USER_RECOVERY_REISSUE,
        sys::UBLK_F_UPDATE_SIZE,
        sys::UBLK_F_AUTO_BUF_REG,
        sys::UBLK_F_QUIESCE,
    ] {
        if features & u64::from(opt) != 0 {
            f |= u64::from(opt);
        }
    }
    f
}

/// Logical block size: 512, or the image's direct-I/O alignment if larger.
fn logical_block_shift(shared: &Shared) -> u8 {
    let align = rustix::fs::statx(
        &shared.image,
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    )
    .ok()
    .filter(|s| s.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0)
    .map(|s| s.stx_dio_offset_align)
    .unwrap_or(512)
    .clamp(512, 4096);
    align.trailing_zeros() as u8
}

/// Creates (or recovers) the device and serves it until it stops.
pub fn serve(shared: Arc<Shared>) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let spec = shared.spec.clone();
    let features = kernel_features();
    let ctrl = claim_device(&spec, features)?;
    // The device exists from here on: named in the run dir at once, so that a
    // control plane finds it to delete should this worker die before it serves.
    shared.write_state_file(ctrl.dev_info().dev_id);
    #[cfg(feature = "test-faults")]
    die_after_add();
    let target = Target {
        size: spec.size_bytes,
        read_only: spec.read_only,
        data_fd: shared.data.as_raw_fd(),
        lbs_shift: logical_block_shift(&shared),
    };
    let dev = Arc::new(UblkDev::new(
        ctrl.get_name(),
        move |dev: &mut UblkDev| {
            target.set_up(dev);
            Ok(())
        },
        &ctrl,
    )?);
    tracing::debug!("start: device set up");
    let queues = start_queues(&ctrl, &dev, &shared)?;
    tracing::debug!("start: queues ready");
    start_device(&ctrl, &dev)?;
    let _ = ctrl.read_dev_info();
    let info = ctrl.dev_info();
    let dev_id = info.dev_id;
    tracing::info!(
        dev_id,
        features = format!("{features:#x}"),
        flags = format!("{:#x}", info.flags),
        recovered = spec.recover_dev_id.is_some(),
        policy = ?shared.policy(),
        "serving /dev/ublkb{dev_id}"
    );
    // The control loop (and the periodic drift checks) on this thread,
    // until the queues end.
    let (control, server) =
        control::start(shared.clone(), ctrl.clone(), dev_id, features, info.flags)?;
    server.run(&queues.ended, u64::from(dev.dev_info.nr_hw_queues));

    for q in queues.threads {
        let _ = q.join();
    }
    let _ = ctrl.read_dev_info();
    let stopped = u32::from(ctrl.dev_info().state) == sys::UBLK_S_DEV_DEAD;
    // Closes the char device: a quiesced device now waits for its successor.
    drop(dev);
    Ok(end(&ctrl, &control, &shared, stopped))
}

/// The device this worker serves: `spec`'s to recover (a dead worker's,
/// or one handed over), or a new one.
fn claim_device(
    spec: &WorkerSpec,
    features: u64,
) -> Result<Arc<UblkCtrl>, Box<dyn std::error::Error>> {
    let (id, dev_flags) = match spec.recover_dev_id {
        Some(id) => {
            // Retries while the dead server's char device is still being released.
            let r = UblkCtrl::new_simple(id as i32)?.start_user_recover()?;
            if r != 0 {
                return Err(format!("START_USER_RECOVERY of ublk device {id}: {r}").into());
            }
            (id as i32, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        }
        None => (-1, UblkFlags::UBLK_DEV_F_ADD_DEV),
    };
    tracing::debug!("start: device claimed");
    Ok(Arc::new(
        UblkCtrlBuilder::default()
            .name("blockplane")
            .id(id)
            .nr_queues(spec.queues)
            .depth(spec.queue_depth)
            .io_buf_bytes(spec.max_io_bytes)
            .ctrl_flags(ctrl_flags(features))
            .dev_flags(dev_flags)
            .build()?,
    ))
}

/// What the kernel is told of the device and its target.
#[derive(Clone, Copy)]
struct Target {
    size: u64,
    read_only: bool,
    data_fd: std::os::fd::RawFd,
    lbs_shift: u8,
}

impl Target {
    /// The device's registered files, ring sizes and parameters.
    fn set_up(self, dev: &mut UblkDev) {
        dev.tgt.dev_size = self.size;
        // Registered files of every queue's ring: the char device (libublk's,
        // slot 0), the image, and empty slots for the direct path's devices.
        let files = IMAGE_SLOT as usize + 1 + RAW_SLOTS;
        dev.tgt.fds[IMAGE_SLOT as usize] = self.data_fd;
        dev.tgt.fds[IMAGE_SLOT as usize + 1..files].fill(-1);
        dev.tgt.nr_fds = files as i32;
        // Room on each queue's ring for every tag's command plus its own
        // request SQEs (a direct request's pieces go together), the eventfd
        // read and QoS timers.
        let ring = dev
            .dev_info
            .queue_depth
            .saturating_mul(3)
            .saturating_add(16);
        dev.tgt.sq_depth = ring;
        dev.tgt.cq_depth = ring;
        let mut attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
        if self.read_only {
            attrs |= sys::UBLK_ATTR_READ_ONLY;
        }
        dev.tgt.params = sys::ublk_params {
            types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
            basic: sys::ublk_param_basic {
                attrs,
                logical_bs_shift: self.lbs_shift,
                physical_bs_shift: 12,
                io_opt_shift: 12,
                io_min_shift: self.lbs_shift,
                max_sectors: dev.dev_info.max_io_buf_bytes >> 9,
                dev_sectors: self.size >> 9,
                ..Default::default()
            },
            discard: sys::ublk_param_discard {
                discard_granularity: 4096,
                max_discard_sectors: u32::MAX >> 9,
                max_write_zeroes_sectors: u32::MAX >> 9,
                max_discard_segments: 1,
                ..Default::default()
            },
            ..Default::default()
        };
    }
}

/// The queue threads, and the eventfd each says on that it ended.
struct QueueThreads {
    threads: Vec<std::thread::JoinHandle<()>>,
    ended: Arc<OwnedFd>,
}

/// A thread per queue, each with its mailbox, configured with the kernel;
/// and the eventfd each says on that it ended (the control loop returns
/// when all have).
fn start_queues(
    ctrl: &Arc<UblkCtrl>,
    dev: &Arc<UblkDev>,
    shared: &Arc<Shared>,
) -> Result<QueueThreads, Box<dyn std::error::Error>> {
    let mailboxes = (0..dev.dev_info.nr_hw_queues)
        .map(|_| Mailbox::new().map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()?;
    if !shared.adopt_queues(Queues(mailboxes.clone())) {
        return Err("the queues were set up twice".into());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let ended = Arc::new(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC,
    )?);
    let mut queues = Vec::new();
    for (qid, mailbox) in (0..dev.dev_info.nr_hw_queues).zip(mailboxes) {
        let (dev, tx, shared, ended) = (dev.clone(), tx.clone(), shared.clone(), ended.clone());
        queues.push(
            std::thread::Builder::new()
                .name(format!("queue-{qid}"))
                .spawn(move || {
                    let _ = tx.send((qid, UblkCtrl::init_queue_thread()));
                    if let Err(e) = queue(qid, &dev, shared, mailbox) {
                        tracing::error!(qid, error = %e, "queue ended with an error");
                    }
                    let _ = rustix::io::write(&*ended, &1u64.to_ne_bytes());
                })?,
        );
    }
    for _ in 0..dev.dev_info.nr_hw_queues {
        let (qid, tid) = rx.recv()?;
        ctrl.set_thread_affinity(qid, tid);
        ctrl.configure_queue(dev, qid, tid)?;
    }
    Ok(QueueThreads {
        threads: queues,
        ended,
    })
}

/// SET_PARAMS and START_DEV, or END_USER_RECOVERY for a recovered device.
/// START_DEV waits for every queue's first fetch, so the kernel runs it on
/// an io-wq worker of the issuing thread, which then stays as long as that
/// thread: issued from a short-lived thread, it goes with it.
fn start_device(ctrl: &UblkCtrl, dev: &UblkDev) -> Result<i32, UblkError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            libublk::ublk_init_ctrl_task_ring(|r| {
                if r.is_none() {
                    *r =
                        Some(io_uring::IoUring::<io_uring::squeue::Entry128>::builder().build(16)?);
                }
                Ok(())
            })?;
            ctrl.start_dev(dev)
        })
        .join()
        .unwrap_or(Err(UblkError::OtherError(-libc::EIO)))
    })
}

/// After the queues ended (`stopped`: the kernel says the device is
/// dead): a device handed over or left for recovery is disowned; one this
/// worker was asked to stop is deleted, its image unpinned.
fn end(ctrl: &UblkCtrl, control: &control::Control, shared: &Shared, stopped: bool) -> ExitCode {
    let dev_id = ctrl.dev_info().dev_id;
    if control.handed_over() {
        // The image stays pinned and the stats file stays: both are the
        // successor's now.
        ctrl.disown();
        tracing::info!(dev_id, "handed over (quiesced); worker exits");
        return ExitCode::SUCCESS;
    }
    if !stopped || !control.shutdown_requested() {
        // The queues ended without STOP_DEV from us: leave the device to a
        // successor (the control plane recovers it).
        ctrl.disown();
        tracing::error!(
            dev_id,
            "queues ended unexpectedly; device left for recovery"
        );
        return ExitCode::FAILURE;
    }
    // Deleting waits for every handle on the char device: `dev` is dropped.
    if let Err(e) = ctrl.del_dev() {
        tracing::error!(dev_id, error = %e, "DEL_DEV failed");
    }
    if shared.policy() == DataPath::Direct
        && let Err(e) = shared.leave_direct()
    {
        tracing::error!(error = %e, "could not unpin the image");
    }
    control.remove_files();
    tracing::info!(dev_id, "device deleted; worker exits");
    ExitCode::SUCCESS
}

/// Test faults `kill_after_add` and `fail_after_add` (a build with test
/// faults only): the worker dies between ADD_DEV and START_DEV (its control
/// plane dies with it under the first).
#[cfg(feature = "test-faults")]
fn die_after_add() {
    if std::env::var("BLOCKPLANE_TEST_FAULT")
        .is_ok_and(|f| f == "kill_after_add" || f == "fail_after_add")
    {
        tracing::warn!("test fault: dying between ADD_DEV and START_DEV");
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
}

/// One queue: a task per tag, plus one keeping a read armed on the mailbox's
/// eventfd so the control thread can reach it.
fn queue(
    qid: u16,
    dev: &UblkDev,
    shared: Arc<Shared>,
    mailbox: Arc<Mailbox>,
) -> Result<(), UblkError> {
    let q = Rc::new(UblkQueue::new(qid, dev)?);
    // `threaded` runs on this ring's io-wq workers: cap them as the spec says.
    let mut max = [u32::from(shared.spec.threads.max(1)), 0];
    if let Err(e) =
        libublk::io::with_task_io_ring(|r| r.submitter().register_iowq_max_workers(&mut max))
    {
        tracing::warn!(qid, error = %e, "io-wq worker cap not set");
    }
    let efd = mailbox.kick_fd();
    let cfg = shared.config().clone();
    let ctx = Rc::new(QueueCtx::new(qid as usize, shared, mailbox, cfg));
    let exe = Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in q.tags() {
        let (q, ctx) = (q.clone(), ctx.clone());
        tasks.push(exe.spawn(async move {
            match tag_task(&q, tag, &ctx).await {
                Ok(()) | Err(UblkError::QueueIsDown) => {}
                Err(e) => tracing::error!(tag, error = %e, "tag task failed"),
            }
        }));
    }
    let q2 = q.clone();
    exe.spawn(async move { mailbox_task(&q2, &ctx, efd).await })
        .detach();
    let ex = exe.clone();
    smol::block_on(exe.run(async move {
        let run_ops = || while ex.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) =
            libublk::wait_and_handle_io_events(&q, Some(IDLE_WAIT_SECS), run_ops, done).await
        {
            tracing::error!(error = %e, "queue event loop failed");
        }
    }));
    Ok(())
}

async fn tag_task(q: &UblkQueue<'_>, tag: u16, ctx: &QueueCtx) -> Result<(), UblkError> {
    if q.support_auto_buf_zc() {
        // Zero copy: the kernel registers each request's pages at the tag's
        // index of the ring's buffer table; there is no buffer of our own.
        let reg = sys::ublk_auto_buf_reg {
            index: tag,
            ..Default::default()
        };
        q.submit_io_prep_cmd(tag, BufDesc::AutoReg(reg), 0, None)
            .await?;
        loop {
            let req = Req::from_iod(q.get_iod(tag));
            let res = ctx.serve(q, req, Buf::Registered(tag)).await;
            q.submit_io_commit_cmd(tag, BufDesc::AutoReg(reg), res)
                .await?;
        }
    }
    let buf = IoBuf::<u8>::new(q.dev.dev_info.max_io_buf_bytes as usize);
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf))
        .await?;
    loop {
        let req = Req::from_iod(q.get_iod(tag));
        let res = ctx.serve(q, req, Buf::Mem(buf.as_mut_ptr())).await;
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res)
            .await?;
    }
}

/// Takes the mailbox's messages each time its eventfd is written.
async fn mailbox_task(q: &UblkQueue<'_>, ctx: &QueueCtx, efd: i32) {
    let mut val = Box::new(0u64);
    loop {
        let sqe =
            opcode::Read::new(types::Fd(efd), (&mut *val as *mut u64).cast::<u8>(), 8).build();
        if q.ublk_submit_sqe(sqe).await < 0 {
            break;
        }
        ctx.take_messages();
    }
    // A read may still be in the ring when the queue goes: never free its target.
    Box::leak(val);
}
