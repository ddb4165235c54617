//! Soak on real ublk and dm devices: every backend and policy in turn,
//! short by default, longer with `BLOCKPLANE_SOAK=1` (each ublk volume has
//! a worker process, so the VM's memory bounds how many run at once).

use serde_json::json;

use crate::leaks::{Plan, assert_flat, soak};
use crate::{Scratch, Vm};

#[tokio::test(flavor = "multi_thread")]
async fn ublk_dm_and_loop_volumes_come_and_go_without_leaking() {
    let vm = Vm::start().await;
    let plan = Plan::pick(
        Plan {
            volumes: 6,
            rounds: 3,
        },
        Plan {
            volumes: 18,
            rounds: 10,
        },
    );
    let specs = [
        json!({"backend": "ublk", "dispatch": "nowait"}),
        json!({"backend": "ublk", "dispatch": "threaded"}),
        json!({"backend": "ublk", "dispatch": "direct"}),
        json!({"backend": "dm", "dispatch": "direct"}),
        json!({"backend": "dm", "dispatch": "nowait"}),
        json!({"backend": "loop"}),
    ];
    let rounds = soak(&vm.s, &vm.root(Scratch::Xfs), &specs, &plan).await;
    assert_flat(&rounds, plan.volumes);
}
