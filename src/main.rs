//! The `subagents` binary: all behaviour lives in the library; this only hands over.

/// mimalloc instead of the system allocator: a run's end frees a thousand connections' buffers
/// at once, and every step allocates its messages and events; glibc's free paths
/// (`_int_free`, `malloc_consolidate`) were a tenth of the server's time in `bench-api`, and
/// our CPU per step fell by a tenth to two fifths with it (README, Benchmarks).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in the bundled mimalloc 3's `mi_option_e` (`c_src/mimalloc/v3/
/// include/mimalloc.h`; the Rust bindings name no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> std::process::ExitCode {
    // Give freed memory back to the system at once rather than after a second (this build's
    // default; `MIMALLOC_VERBOSE=1` lists the options): with 10,000 runs in flight the delay
    // held about 70 MB more at the peak (1,018 against 947 MB), for a tenth more CPU per step.
    // SAFETY: sets a plain integer option; mimalloc reads options at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    subagents::cli::main()
}
