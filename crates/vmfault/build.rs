//! Mutation testing without rebuilding the dependencies: with
//! `VMFAULT_MUTATION=name` in the environment, this crate (and only this
//! crate) is built with `--cfg vmfault_mutation="name"`, which removes one
//! fence or check that a loom model guards (see `.ci/run`). Setting the cfg
//! through `RUSTFLAGS` works too, but rebuilds every dependency. Loom
//! builds also take the mutation at run time (`VMFAULT_LOOM_MUTATION`, see
//! `mutated!` in `src/lib.rs`), which is how CI runs them: one build.

fn main() {
    println!("cargo:rerun-if-env-changed=VMFAULT_MUTATION");
    if let Ok(m) = std::env::var("VMFAULT_MUTATION")
        && !m.is_empty()
    {
        println!("cargo:rustc-cfg=vmfault_mutation=\"{m}\"");
        // For `sync::loom_mutation`, which also knows run-time mutations.
        println!("cargo:rustc-env=VMFAULT_MUTATION_BUILT={m}");
    }
}
