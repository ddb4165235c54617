//! Soak on the host's kernel: loop volumes, short by default, 64 volumes ×
//! 20 rounds with `BLOCKPLANE_SOAK=1`.

use serde_json::json;

use crate::harness::Service;
use crate::leaks::{Plan, assert_flat, soak};

#[tokio::test(flavor = "multi_thread")]
async fn volumes_come_and_go_without_leaking() {
    let s = Service::start().await;
    let plan = Plan::pick(
        Plan {
            volumes: 16,
            rounds: 6,
        },
        Plan {
            volumes: 64,
            rounds: 20,
        },
    );
    let rounds = soak(&s, &s.images, &[json!({"backend": "loop"})], &plan).await;
    assert_flat(&rounds, plan.volumes);
}
