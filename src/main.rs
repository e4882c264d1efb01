//! The `subagents` binary: all behaviour lives in the library; this only hands over.

fn main() -> std::process::ExitCode {
    subagents::cli::main()
}
