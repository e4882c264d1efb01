//! Rebuilds the crate when a migration changes: `sqlx::migrate!` embeds the files at compile
//! time, and cargo does not know to look at them (sqlx's advice: `sqlx migrate build-script`).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
