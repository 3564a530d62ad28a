//! The `vmfault` command.
fn main() {
    println!("vmfault {}", env!("CARGO_PKG_VERSION"));
}
