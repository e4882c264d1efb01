//! The `subagents` binary: all behaviour lives in the library; this only hands over.

/// mimalloc instead of the system allocator: a run's end frees a thousand connections' buffers
/// at once, and every step allocates its messages and events; glibc's free paths
/// (`_int_free`, `malloc_consolidate`) were a tenth of the server's time in `bench-api`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    subagents::cli::main()
}
