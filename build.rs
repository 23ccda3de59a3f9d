//! Makes the binary find libtorch at run time without LD_LIBRARY_PATH, and keeps
//! libtorch_cuda linked so CUDA is there when the machine has a GPU.

fn main() {
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
