fn main() {
    if let Err(e) = attnsweep::cli::main() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
