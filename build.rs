//! Makes the binary find libtorch at run time without LD_LIBRARY_PATH, keeps libtorch_cuda
//! linked so CUDA is there when the machine has a GPU, and stamps the commit it was built
//! from (`ATTNSWEEP_COMMIT`), which benches record beside their results.

fn main() {
    commit();
    // torch-sys publishes the libtorch it linked (`links = "tch"`).
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    // The linker's --as-needed would drop libtorch_cuda: nothing references it directly,
    // its CUDA kernels register themselves when it loads.
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}

/// The checkout's commit (its short hash), "unknown" outside a git checkout; rerun when the
/// checked-out commit moves.
fn commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let hash = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ATTNSWEEP_COMMIT={hash}");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for watched in ["HEAD", "refs/heads", "packed-refs"] {
            let p = std::path::Path::new(&dir).join(watched);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
