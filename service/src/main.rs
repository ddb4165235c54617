fn main() -> std::process::ExitCode {
    blockplane::cli::main()
}
