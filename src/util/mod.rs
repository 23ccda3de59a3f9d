//! The bottom layer: helpers with no knowledge of models or experiments.

pub(crate) mod atomic;
pub mod fault;
pub(crate) mod flags;
pub(crate) mod process;
pub(crate) mod progress;
pub mod rng;
pub(crate) mod stats;

/// A fresh, empty directory of this test process for a unit test named `tag`.
#[cfg(test)]
pub(crate) fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("attnsweep-unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 64-bit FNV-1a continued from `h` (start from `FNV_BASIS` for the hash of one string): a
/// hash whose value never changes between builds or platforms, for cell ids, folder names and
/// the kernel cache's key.
pub(crate) fn fnv1a_from(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// FNV-1a's offset basis.
pub(crate) const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// 64-bit FNV-1a of `bytes`.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_BASIS, bytes)
}
