//! PyTorch checkpoints read without Python: the tensors of a `torch.save` archive, of a tch
//! `VarStore` file (`.ot`) and of a TorchScript archive (`torch.jit.save`).
//!
//! TorchScript archives and `.ot` files are modules; libtorch's loader (`torch::jit::load`,
//! through tch) reads their parameters. A `torch.save` archive is a zip of one pickle
//! (`<name>/data.pkl`) and the raw bytes of each tensor storage (`<name>/data/<key>`).
//! libtorch's own unpickler cannot read those: it turns every `collections.OrderedDict`
//! into None (it expects OrderedDicts only as a tensor's empty backward hooks), and every
//! `state_dict()` is one. So the pickle is read by an interpreter of the pickle machine that
//! builds values and nothing else (`unpickle.rs`): containers (dict, OrderedDict, list, tuple, set),
//! numbers, strings, bytes, booleans, None, `torch.device`, and tensors rebuilt from their
//! storages (`torch._utils._rebuild_tensor_v2`, `_rebuild_parameter`,
//! `torch._tensor._rebuild_from_type_v2` of a plain tensor or parameter). Any other global a
//! pickle names (a class of the program that saved it, numpy scalars, argparse namespaces,
//! functions) is refused by name: calling it is what lets a pickle run code. Such files, and
//! the legacy (pre-zip, PyTorch < 1.6) format, need Python (`convert --allow-pickle`).

use super::unpickle::{flatten, Machine, MAX_VALUES};
use anyhow::{bail, ensure, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;
use tch::Tensor;

/// What kind of weight file `path` is, by its first bytes and zip contents.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// Safetensors: a little-endian u64 header length, then the JSON header.
    Safetensors,
    /// `torch.save`'s zip archive (PyTorch >= 1.6).
    TorchSave,
    /// A module archive: `torch.jit.save`, or a tch `VarStore::save` (`.ot`).
    Module,
    /// `torch.save` before the zip format: a bare pickle stream.
    LegacyPickle,
}

pub(crate) fn format(path: &Path) -> Result<Format> {
    let mut head = [0u8; 9];
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    // A safetensors header is JSON: its first byte follows the 8-byte length. (The length's
    // own first byte may be anything, 0x80 included, so it is not a pickle's mark.)
    if n == 9 && head[8] == b'{' {
        return Ok(Format::Safetensors);
    }
    if n >= 4 && head[..4] == *b"PK\x03\x04" {
        let zip = zip::ZipArchive::new(std::fs::File::open(path)?)
            .with_context(|| format!("{} is not a readable zip archive", path.display()))?;
        let module = zip
            .file_names()
            .any(|n| n.ends_with("/constants.pkl") || n.contains("/code/"));
        let pickle = zip.file_names().any(|n| n.ends_with("/data.pkl"));
        return match (module, pickle) {
            (true, _) => Ok(Format::Module),
            (false, true) => Ok(Format::TorchSave),
            _ => bail!(
                "{} is a zip archive but neither a torch.save file nor a TorchScript module",
                path.display()
            ),
        };
    }
    // A pickle opens with PROTO and a protocol number.
    if n >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]) {
        return Ok(Format::LegacyPickle);
    }
    bail!(
        "{} is neither safetensors nor a PyTorch checkpoint (a torch.save or TorchScript zip \
         archive, or a pickle)",
        path.display()
    )
}

/// Every tensor of the file at a dotted name (`model.layers.0.mlp.up_proj.weight`; list and
/// tuple items by index), for the formats read without Python. Other values (numbers,
/// strings, an optimizer's settings) are skipped.
pub(crate) fn read_tensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    match format(path)? {
        Format::Module => {
            let named = Tensor::load_multi(path)
                .with_context(|| format!("libtorch cannot load module {}", path.display()))?;
            // tch's VarStore writes '.' in names as '|'.
            Ok(named
                .into_iter()
                .map(|(n, t)| (n.replace('|', "."), t))
                .collect())
        }
        Format::TorchSave => TorchSave::open(path)?.tensors(),
        Format::Safetensors => Ok(Tensor::read_safetensors(path)?),
        Format::LegacyPickle => bail!(
            "{} is in torch.save's legacy format (PyTorch < 1.6), which only Python reads; pass \
             --allow-pickle if you trust it, or save it again with a current torch",
            path.display()
        ),
    }
}

/// The largest pickle (a checkpoint's structure, without its tensors' bytes) read.
const MAX_PICKLE_BYTES: usize = 256 << 20;

struct TorchSave {
    zip: zip::ZipArchive<std::fs::File>,
    /// The directory inside the archive that holds data.pkl.
    prefix: String,
    path: std::path::PathBuf,
}

impl TorchSave {
    fn open(path: &Path) -> Result<TorchSave> {
        let zip = zip::ZipArchive::new(std::fs::File::open(path)?)
            .with_context(|| format!("{} is not a readable zip archive", path.display()))?;
        let pkl = zip
            .file_names()
            .find(|n| n.ends_with("/data.pkl"))
            .with_context(|| format!("{} holds no data.pkl", path.display()))?;
        let prefix = pkl.trim_end_matches("data.pkl").to_string();
        Ok(TorchSave {
            zip,
            prefix,
            path: path.to_path_buf(),
        })
    }

    /// The bytes of entry `name`, which may hold at most `declared` (a storage's, from the
    /// pickle): a compressed entry is inflated no further, so a small file cannot make the
    /// reader hold gigabytes.
    fn entry(&mut self, name: &str, declared: usize) -> Result<Vec<u8>> {
        let full = format!("{}{name}", self.prefix);
        let path = self.path.display().to_string();
        let f = self
            .zip
            .by_name(&full)
            .with_context(|| format!("{path} lacks {full}"))?;
        let claimed = f.size();
        ensure!(
            claimed <= declared as u64,
            "{path}: entry {full} claims {claimed} bytes, more than the {declared} its pickle \
             declares; the file is corrupt or crafted"
        );
        // No capacity from the header's claimed size: the bytes that arrive decide.
        let mut out = Vec::new();
        f.take(declared as u64 + 1).read_to_end(&mut out)?;
        ensure!(
            out.len() <= declared,
            "{path}: entry {full} holds more than the {declared} bytes its pickle declares; the \
             file is corrupt or crafted"
        );
        Ok(out)
    }

    fn tensors(mut self) -> Result<Vec<(String, Tensor)>> {
        if let Ok(order) = self.entry("byteorder", 16) {
            ensure!(
                order == b"little",
                "{} stores its tensors big-endian, which is not supported",
                self.path.display()
            );
        }
        let pickle = self.entry("data.pkl", MAX_PICKLE_BYTES)?;
        let root = Machine::new(&pickle)
            .run()
            .with_context(|| format!("reading {}", self.path.display()))?;
        let (mut leaves, mut budget) = (Vec::new(), MAX_VALUES);
        flatten(&root, String::new(), 0, &mut budget, &mut leaves)?;
        // Each storage is read once, however many tensors view it (tied weights).
        let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
        let mut out = Vec::new();
        for (name, t) in leaves {
            if !storages.contains_key(&t.key) {
                let declared = (t.numel as usize)
                    .checked_mul(t.kind.elt_size_in_bytes())
                    .with_context(|| format!("storage {} is too large", t.key))?;
                let bytes = self.entry(&format!("data/{}", t.key), declared)?;
                storages.insert(t.key.clone(), bytes);
            }
            let bytes = &storages[&t.key];
            let malformed = || {
                anyhow::anyhow!(
                    "{}: tensor {name} does not fit its storage {} ({} bytes)",
                    self.path.display(),
                    t.key,
                    bytes.len()
                )
            };
            let want = (t.numel as usize)
                .checked_mul(t.kind.elt_size_in_bytes())
                .filter(|&w| w <= bytes.len())
                .ok_or_else(malformed)?;
            // The last element the view reads, in checked arithmetic (sizes and strides come
            // from the file).
            let last = t
                .size
                .iter()
                .zip(&t.stride)
                .try_fold(t.offset, |acc, (s, st)| {
                    (s - 1)
                        .max(0)
                        .checked_mul(*st)
                        .and_then(|x| acc.checked_add(x))
                })
                .ok_or_else(malformed)?;
            ensure!(
                t.size.contains(&0) || last < t.numel,
                "{}: tensor {name} reaches beyond its storage",
                self.path.display()
            );
            let view = Tensor::f_from_data_size(&bytes[..want], &[t.numel], t.kind)
                .and_then(|s| s.f_as_strided(&t.size, &t.stride, Some(t.offset)))
                .and_then(|v| {
                    // Its own storage, not a view of one that other tensors share.
                    let mut own = v.f_zeros_like()?;
                    own.f_copy_(&v)?;
                    Ok(own)
                })
                .map_err(|e| anyhow::anyhow!("{}: tensor {name}: {e}", self.path.display()))?;
            out.push((name, view));
        }
        Ok(out)
    }
}

/// Tensors read at dotted names, with a wrapper around the state dict removed when that
/// makes more names match `expected`: checkpoints often hold `{"model": state_dict, "step":
/// ..., "optimizer": ...}` or `{"state_dict": ...}`. Two wrappers that match equally well
/// (`{"model": ..., "ema": ...}`) are an error naming both: which one is meant is the user's
/// call.
pub(crate) fn unwrap_state_dict(
    tensors: Vec<(String, Tensor)>,
    expected: &[String],
) -> Result<Vec<(String, Tensor)>> {
    let known = |names: &mut dyn Iterator<Item = &str>| {
        names.filter(|n| expected.iter().any(|e| e == n)).count()
    };
    let as_is = known(&mut tensors.iter().map(|(n, _)| n.as_str()));
    let firsts: std::collections::BTreeSet<&str> = tensors
        .iter()
        .filter_map(|(n, _)| n.split_once('.').map(|(f, _)| f))
        .collect();
    let scored: Vec<(String, usize)> = firsts
        .into_iter()
        .map(|f| {
            let prefix = format!("{f}.");
            let n = known(&mut tensors.iter().filter_map(|(n, _)| n.strip_prefix(&prefix)));
            (prefix, n)
        })
        .filter(|(_, n)| *n > as_is)
        .collect();
    let best = scored.iter().map(|s| s.1).max().unwrap_or(0);
    let winners: Vec<&String> = scored
        .iter()
        .filter(|s| s.1 == best)
        .map(|s| &s.0)
        .collect();
    match winners.as_slice() {
        [] => Ok(tensors),
        [prefix] => Ok(tensors
            .into_iter()
            .filter_map(|(n, t)| n.strip_prefix(prefix.as_str()).map(|s| (s.to_string(), t)))
            .collect()),
        many => bail!(
            "the checkpoint holds the model's tensors under several keys ({}); save the one \
             state dict to convert on its own",
            many.iter()
                .map(|p| p.trim_end_matches('.'))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The tensors of a pickle as Python's `torch.load` reads them (unrestricted: it runs what
/// the pickle names), for what the reader above refuses; for trusted files only, and needs a
/// Python with torch and safetensors.
pub(crate) fn read_with_python(path: &Path, scratch: &Path) -> Result<Vec<(String, Tensor)>> {
    let out = scratch.join("from_python.safetensors");
    let script = "import sys, torch\nfrom safetensors.torch import save_file\nsd = torch.load(sys.argv[1], map_location='cpu', weights_only=False)\nflat = {}\ndef walk(v, name):\n    if isinstance(v, torch.Tensor):\n        flat[name] = v.detach().clone().contiguous()\n    elif isinstance(v, dict):\n        for k, x in v.items(): walk(x, f'{name}.{k}' if name else str(k))\n    elif isinstance(v, (list, tuple)):\n        for i, x in enumerate(v): walk(x, f'{name}.{i}' if name else str(i))\nwalk(sd, '')\nsave_file(flat, sys.argv[2])\n";
    let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
    let o = std::process::Command::new(&py)
        .args(["-c", script])
        .arg(path)
        .arg(&out)
        .output()
        .with_context(|| {
            format!("--allow-pickle runs {py} (set ATTNSWEEP_PYTHON to another) with torch and safetensors")
        })?;
    ensure!(
        o.status.success(),
        "{py} cannot read {}: {}",
        path.display(),
        String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("")
    );
    Ok(Tensor::read_safetensors(&out)?)
}

/// The tensors of a PyTorch checkpoint: in-process where the format allows, through Python
/// with `allow_pickle` for the rest.
pub(crate) fn read_checkpoint(
    path: &Path,
    allow_pickle: bool,
    scratch: &Path,
) -> Result<BTreeMap<String, Tensor>> {
    let tensors = match read_tensors(path) {
        Ok(t) => t,
        Err(e) if allow_pickle => read_with_python(path, scratch)
            .with_context(|| format!("the built-in reader refused the file ({e:#})"))?,
        Err(e) => return Err(e),
    };
    let mut out = BTreeMap::new();
    for (n, t) in tensors {
        ensure!(
            out.insert(n.clone(), t).is_none(),
            "{} holds two tensors named {n}",
            path.display()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// Opcodes by hand: an OrderedDict (as every state_dict is) of a tensor viewing a
    /// storage with an offset and a transposed stride, a nested dict, numbers and strings
    /// that are skipped, and a memoised value read back.
    #[test]
    fn the_machine_builds_containers_and_tensor_views() {
        let mut p = vec![0x80, 2];
        p.extend(b"ccollections\nOrderedDict\nq\x00)R"); // OrderedDict()
        p.extend(b"q\x01(");
        p.extend(b"X\x01\x00\x00\x00w"); // key "w"
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        p.extend(b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x07tQ");
        p.extend(b"K\x01K\x02K\x03\x86K\x01K\x02\x86\x89h\x00)Rt"); // offset 1, size (2,3), stride (1,2)
        p.extend(b"R");
        p.extend(b"X\x04\x00\x00\x00step");
        p.extend(b"K\x07");
        p.extend(b"X\x03\x00\x00\x00sub}(X\x01\x00\x00\x00aG\x3f\xf0\x00\x00\x00\x00\x00\x00u");
        p.extend(b"u.");
        let root = Machine::new(&p).run().unwrap();
        let (mut leaves, mut budget) = (Vec::new(), MAX_VALUES);
        flatten(&root, String::new(), 0, &mut budget, &mut leaves).unwrap();
        assert_eq!(leaves.len(), 1);
        let (name, t) = &leaves[0];
        assert_eq!(name, "w");
        assert_eq!(
            (t.offset, t.size.clone(), t.stride.clone()),
            (1, vec![2, 3], vec![1, 2])
        );
        assert_eq!((t.kind, t.numel, t.key.as_str()), (Kind::Float, 7, "0"));
    }

    /// A deflated storage that inflates far beyond what its pickle declares (a 64 MiB entry
    /// for a storage of 7 floats) is refused by name after at most the declared bytes and
    /// one more, however large it claims to be.
    #[test]
    fn an_entry_larger_than_its_storage_is_refused() {
        use std::io::Write;
        let mut p = vec![0x80, 2];
        p.extend(b"}(X\x01\x00\x00\x00w");
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        p.extend(b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x07tQ");
        p.extend(b"K\x00K\x07\x85K\x01\x85\x89}tR");
        p.extend(b"u.");
        let dir = crate::util::scratch_dir("pickle-bomb");
        let write = |name: &str, storage: &[u8], deflate: bool| {
            let path = dir.join(name);
            let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
            let stored = zip::write::FileOptions::default()
                .compression_method(zip::CompressionMethod::Stored);
            z.start_file("archive/data.pkl", stored).unwrap();
            z.write_all(&p).unwrap();
            let method = match deflate {
                true => zip::CompressionMethod::Deflated,
                false => zip::CompressionMethod::Stored,
            };
            z.start_file("archive/data/0", stored.compression_method(method))
                .unwrap();
            z.write_all(storage).unwrap();
            z.finish().unwrap();
            path
        };
        let fine = write("fine.pt", &[0u8; 28], false);
        let t = TorchSave::open(&fine).unwrap().tensors().unwrap();
        assert_eq!(t[0].1.size(), [7]);
        let bomb = write("bomb.pt", &vec![0u8; 64 << 20], true);
        assert!(std::fs::metadata(&bomb).unwrap().len() < 1 << 20);
        let e = format!(
            "{:#}",
            TorchSave::open(&bomb).unwrap().tensors().unwrap_err()
        );
        assert!(e.contains("archive/data/0") && e.contains("28"), "{e}");
    }

    /// Globals outside the list are refused by name, before anything is called.
    #[test]
    fn code_in_a_pickle_is_refused_by_name() {
        let p = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00lsq\x00\x85R.";
        let e = format!("{:#}", Machine::new(p).run().unwrap_err());
        assert!(
            e.contains("os.system") && e.contains("--allow-pickle"),
            "{e}"
        );
        for bad in [&b"\x80\x02("[..], b"\x80\x02h\x05.", b"\x80\x02\xff"] {
            assert!(Machine::new(bad).run().is_err());
        }
    }

    #[test]
    fn a_wrapper_around_the_state_dict_comes_off() {
        let t = || Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
        let expected = vec![
            "model.norm.weight".to_string(),
            "lm_head.weight".to_string(),
        ];
        let wrapped = vec![
            ("model.model.norm.weight".to_string(), t()),
            ("model.lm_head.weight".to_string(), t()),
            ("optimizer.state.0.exp_avg".to_string(), t()),
        ];
        let names: Vec<String> = unwrap_state_dict(wrapped, &expected)
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["model.norm.weight", "lm_head.weight"]);
        // A plain state dict whose names start with "model." stays as it is.
        let plain = vec![
            ("model.norm.weight".to_string(), t()),
            ("lm_head.weight".to_string(), t()),
        ];
        assert_eq!(unwrap_state_dict(plain, &expected).unwrap().len(), 2);
        // Two wrappers of the same model: which one is meant is not guessed.
        let two = vec![
            ("model.model.norm.weight".to_string(), t()),
            ("ema.model.norm.weight".to_string(), t()),
        ];
        let e = format!("{:#}", unwrap_state_dict(two, &expected).unwrap_err());
        assert!(e.contains("ema, model"), "{e}");
    }
}
