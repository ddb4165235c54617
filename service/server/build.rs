//! Rebuilds this crate when a migration is added, changed or removed:
//! `sqlx::migrate!` (`store::MIGRATOR`) embeds `migrations/` when the crate
//! is compiled, and cargo does not know the macro read that directory, so
//! a new migration alone left the old set embedded in an incremental build.

fn main() {
    println!("cargo::rerun-if-changed=../../migrations");
}
