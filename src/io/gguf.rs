//! llama.cpp's GGUF files read without llama.cpp: the header, the typed metadata, and each
//! tensor's values, dequantised.
//!
//! A GGUF file (versions 2 and 3; the layout is in ggml's `docs/gguf.md`) is: the magic
//! `GGUF`, a u32 version, the tensor and metadata counts (u64), the metadata as key / typed
//! value pairs, the tensor infos (name, dimensions innermost first, ggml type, offset), then
//! the tensor data, starting at the next multiple of `general.alignment` (32 unless set).
//! Every number is little-endian. Quantised types store rows as blocks of 32 (`Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`, `Q8_0`) or 256 values (`Q4_K`, `Q5_K`, `Q6_K`), each block its own scale
//! (and minimum) as fp16; the formulas below are ggml's `dequantize_row_*`.
//!
//! Every count and offset is checked against the file's length before it is used, so a
//! truncated or hostile file is refused by name, never read out of bounds: tensor data must
//! lie aligned, one tensor after another with no overlap and no gap beyond the alignment's
//! padding, and the metadata may take at most `METADATA_BUDGET` bytes of memory. A metadata
//! value is read as the type it has; one of another type than the reader expects is refused
//! by name, never taken for absent.

use anyhow::{bail, ensure, Context, Result};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// A metadata value. Integers of every width read as `Int`, both float widths as `Float`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// Its type as a message names it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Value::Int(_) => "an integer",
            Value::Float(_) => "a float",
            Value::Bool(_) => "a bool",
            Value::Str(_) => "a string",
            Value::Array(_) => "an array",
        }
    }

    pub(crate) fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    pub(crate) fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub(crate) fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    pub(crate) fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// The most memory the metadata may take once read (a vocabulary of 150,000 tokens with its
/// merges takes about 30 MiB): a file that declares more is refused before it is allocated.
pub(crate) const METADATA_BUDGET: usize = 512 << 20;

/// The tensor types read: ggml's numbering (`enum ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    Bf16,
}

impl GgmlType {
    fn from_id(id: u32) -> Result<GgmlType> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => bail!(
                "tensor type {id} ({}) is not supported; supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (requantize the file with llama.cpp's llama-quantize to one of them)",
                ggml_type_name(id)
            ),
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Bf16 => "BF16",
        }
    }

    /// Values per block and bytes per block.
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
        }
    }
}

/// ggml's names of the types not read, so the error says what the file holds.
fn ggml_type_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// One tensor's entry: its name, dimensions as PyTorch orders them (outermost first; GGUF
/// stores them innermost first), type, and byte range in the file.
#[derive(Clone, Debug)]
pub(crate) struct TensorInfo {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) ty: GgmlType,
    start: usize,
    len: usize,
}

/// A GGUF file, memory-mapped: its metadata and tensor infos parsed, the data read on demand.
pub(crate) struct Gguf {
    map: memmap2::Mmap,
    pub(crate) metadata: BTreeMap<String, Value>,
    pub(crate) tensors: Vec<TensorInfo>,
}

/// The first four bytes of every GGUF file.
pub(crate) const MAGIC: &[u8; 4] = b"GGUF";

/// Whether `path` starts like a GGUF file.
pub(crate) fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && &head == MAGIC
}

/// A bounds-checked little-endian reader over the file's bytes, with the memory the values
/// read so far may still take.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    budget: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            bail!(
                "the file ends at byte {} where {n} more bytes were expected at {} (truncated?)",
                self.bytes.len(),
                self.pos
            );
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// A count of items each at least `min_item` bytes long, refused when the rest of the file
    /// cannot hold that many (so no count allocates more than the file's size).
    fn count(&mut self, what: &str, min_item: usize) -> Result<usize> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        ensure!(
            n.saturating_mul(min_item as u64) <= left,
            "{what}: {n} entries cannot fit in the {left} bytes left of the file (corrupt header?)"
        );
        Ok(n as usize)
    }
    /// Takes `bytes` of the metadata's memory budget, refusing what would exceed it.
    fn spend(&mut self, bytes: usize, what: &str) -> Result<()> {
        ensure!(
            bytes <= self.budget,
            "{what} would take {bytes} bytes of memory, more than the {} left of the {} the \
             metadata may take; the file is corrupt or crafted",
            self.budget,
            METADATA_BUDGET
        );
        self.budget -= bytes;
        Ok(())
    }
    fn string(&mut self) -> Result<String> {
        let n = self.count("a string's length", 1)?;
        self.spend(n, "a string")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).context("a string of the file is not UTF-8")
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::Int(self.take(1)?[0] as i128),
            1 => Value::Int(self.take(1)?[0] as i8 as i128),
            2 => Value::Int(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i128),
            3 => Value::Int(i16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i128),
            4 => Value::Int(self.u32()? as i128),
            5 => Value::Int(self.u32()? as i32 as i128),
            // An f32 read as the decimal it was written from (1e-5, not 9.99999974e-6).
            6 => {
                let f = f32::from_le_bytes(self.take(4)?.try_into().unwrap());
                Value::Float(f.to_string().parse().unwrap_or(f as f64))
            }
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                ensure!(depth < 4, "arrays nested more than 4 deep");
                let inner = self.u32()?;
                let n = self.count("an array", 1)?;
                self.spend(
                    n.saturating_mul(std::mem::size_of::<Value>()),
                    &format!("an array of {n} values"),
                )?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::Int(self.u64()? as i128),
            11 => Value::Int(self.u64()? as i64 as i128),
            12 => Value::Float(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            _ => bail!("metadata value type {ty} is not one GGUF defines (0-12)"),
        })
    }
}

impl Gguf {
    pub(crate) fn open(path: &Path) -> Result<Gguf> {
        let f =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // Safety: the file is only read, and the map lives as long as the values read from it.
        let map = unsafe { memmap2::Mmap::map(&f) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        Gguf::parse(map).with_context(|| format!("{} is not a readable GGUF file", path.display()))
    }

    fn parse(map: memmap2::Mmap) -> Result<Gguf> {
        let mut c = Cursor {
            bytes: &map,
            pos: 0,
            budget: METADATA_BUDGET,
        };
        ensure!(
            map.len() >= 4 && &map[..4] == MAGIC,
            "it does not start with the magic GGUF ({} bytes; a GGUF file starts with those four \
             letters)",
            map.len()
        );
        c.take(4)?;
        let version = c.u32()?;
        ensure!(
            version == 2 || version == 3,
            "GGUF version {version}; versions 2 and 3 are read (version 1 predates 2023-08: convert it again with llama.cpp)"
        );
        // A tensor info takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata pair 8 + 4 + 1.
        let n_tensors = c.count("the tensor count", 32)?;
        let n_meta = c.count("the metadata count", 13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_meta {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0).with_context(|| format!("metadata {key}"))?;
            ensure!(
                metadata.insert(key.clone(), v).is_none(),
                "metadata key {key} appears twice"
            );
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => {
                let a = v.as_int().unwrap_or(0);
                ensure!(
                    a > 0 && a <= 1 << 20 && (a & (a - 1)) == 0,
                    "general.alignment = {v:?}: expected a power of two"
                );
                a as usize
            }
        };
        let mut raw = Vec::with_capacity(n_tensors);
        let mut names = std::collections::BTreeSet::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            ensure!(names.insert(name.clone()), "tensor {name} appears twice");
            let n_dims = c.u32()? as usize;
            ensure!(
                (1..=4).contains(&n_dims),
                "tensor {name} has {n_dims} dimensions (GGUF allows 1 to 4)"
            );
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let ty_id = c.u32()?;
            let offset = c.u64()?;
            raw.push((name, dims, ty_id, offset));
        }
        let data_start = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(n_tensors);
        for (name, dims, ty_id, offset) in raw {
            let ty = GgmlType::from_id(ty_id).with_context(|| format!("tensor {name}"))?;
            let numel = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n > 0)
                .with_context(|| format!("tensor {name} has dimensions {dims:?}"))?;
            let (per_block, block_bytes) = ty.block();
            ensure!(
                dims[0] % per_block as u64 == 0,
                "tensor {name}: rows of {} values are not whole blocks of {per_block} ({})",
                dims[0],
                ty.name()
            );
            let len = (numel / per_block as u64)
                .checked_mul(block_bytes as u64)
                .context("tensor size overflows")?;
            let start = (data_start as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(len));
            ensure!(
                end.is_some_and(|e| e <= map.len() as u64),
                "tensor {name} ({} bytes at offset {offset}) runs past the end of the file ({} bytes; truncated?)",
                len,
                map.len()
            );
            tensors.push(TensorInfo {
                name,
                shape: dims.iter().rev().map(|&d| d as usize).collect(),
                ty,
                start: start.unwrap() as usize,
                len: len as usize,
            });
        }
        check_layout(&tensors, data_start, alignment)?;
        Ok(Gguf {
            map,
            metadata,
            tensors,
        })
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Metadata `key` as `want` says (`Value::as_str`, `as_int`, ...): None where the file
    /// lacks it, an error naming both types where it holds another.
    pub(crate) fn typed<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        read: fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v)
                .map(Some)
                .with_context(|| format!("metadata {key} is {}, not {want}", v.kind())),
        }
    }

    /// The bytes a tensor is stored in.
    pub(crate) fn raw(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.start..info.start + info.len]
    }

    /// A tensor's values: F16 and BF16 as stored, everything else as fp32 (quantised types
    /// dequantised). Non-finite values are refused by name.
    pub(crate) fn tensor(&self, info: &TensorInfo) -> Result<Tensor> {
        let bytes = self.raw(info);
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let t = match info.ty {
            GgmlType::F16 => Tensor::from_data_size(bytes, &shape, Kind::Half),
            GgmlType::Bf16 => Tensor::from_data_size(bytes, &shape, Kind::BFloat16),
            GgmlType::F32 => Tensor::from_data_size(bytes, &shape, Kind::Float),
            ty => Tensor::from_slice(&dequantize(ty, bytes)).reshape(&shape),
        };
        let finite = t.isfinite().all().int64_value(&[]) == 1;
        ensure!(
            finite,
            "tensor {} ({}) holds values that are not finite (NaN or infinity)",
            info.name,
            info.ty.name()
        );
        Ok(t)
    }
}

/// Tensor data that lies misaligned, overlaps another tensor's, or leaves a gap wider than the
/// alignment's padding is refused: a misplaced offset would read another tensor's bytes (or
/// the same bytes twice) as this one's. GGUF writers pack the tensors in order from data
/// offset 0, each padded to the alignment.
fn check_layout(tensors: &[TensorInfo], data_start: usize, alignment: usize) -> Result<()> {
    let mut by_start: Vec<&TensorInfo> = tensors.iter().collect();
    by_start.sort_by_key(|t| t.start);
    let mut end = data_start;
    for t in by_start {
        ensure!(
            (t.start - data_start) % alignment == 0,
            "tensor {} starts at data offset {}, not a multiple of the alignment {alignment}",
            t.name,
            t.start - data_start
        );
        let next = end.div_ceil(alignment) * alignment;
        ensure!(
            t.start >= next,
            "tensor {} (data offset {}) overlaps the tensor before it, which ends at {}",
            t.name,
            t.start - data_start,
            end - data_start
        );
        ensure!(
            t.start == next,
            "tensor {} starts at data offset {}, leaving {} bytes unused after the tensor \
             before it (only the alignment's padding may lie between, here up to {})",
            t.name,
            t.start - data_start,
            t.start - end,
            next - end
        );
        end = t.start + t.len;
    }
    Ok(())
}

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// ggml's K-quant scales: eight 6-bit scales and eight 6-bit minimums packed in 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

/// The values of whole blocks of a quantised type (`bytes` a multiple of its block size).
pub(crate) fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let (per_block, block_bytes) = ty.block();
    let mut out = vec![0f32; bytes.len() / block_bytes * per_block];
    for (b, y) in bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(per_block))
    {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let d = h(&b[0..2]);
                // Q4_0 centres the nibbles on 8; Q4_1 adds its stored minimum instead.
                let (qs, m, centre) = if ty == GgmlType::Q4_0 {
                    (&b[2..18], 0.0, 8.0)
                } else {
                    (&b[4..20], h(&b[2..4]), 0.0)
                };
                for j in 0..16 {
                    y[j] = ((qs[j] & 0xF) as f32 - centre) * d + m;
                    y[j + 16] = ((qs[j] >> 4) as f32 - centre) * d + m;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let d = h(&b[0..2]);
                let (m, rest, centre) = if ty == GgmlType::Q5_0 {
                    (0.0, &b[2..], 16.0)
                } else {
                    (h(&b[2..4]), &b[4..], 0.0)
                };
                // The fifth bit of value j is bit j of qh; of value j + 16, bit j + 16.
                let qh = u32::from_le_bytes(rest[0..4].try_into().unwrap());
                let qs = &rest[4..20];
                for j in 0..16 {
                    let hi0 = ((qh >> j) & 1) << 4;
                    let hi1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = (((qs[j] & 0xF) as u32 | hi0) as f32 - centre) * d + m;
                    y[j + 16] = (((qs[j] >> 4) as u32 | hi1) as f32 - centre) * d + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = h(&b[0..2]);
                for (j, &q) in b[2..34].iter().enumerate() {
                    y[j] = q as i8 as f32 * d;
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                let (d, dmin) = (h(&b[0..2]), h(&b[2..4]));
                let scales = &b[4..16];
                // Q5_K keeps a fifth bit per value in qh: for the n-th 32 values, bit n.
                let (qh, qs) = if ty == GgmlType::Q5K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for chunk in 0..4 {
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    for half in 0..2 {
                        let (sc, mn) = scale_min_k4(chunk * 2 + half, scales);
                        let (d1, m1) = (d * sc, dmin * mn);
                        let bit = chunk * 2 + half;
                        for l in 0..32 {
                            let lo = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                            let hi = qh.map_or(0, |qh| ((qh[l] >> bit) & 1) << 4);
                            y[chunk * 64 + half * 32 + l] = d1 * (lo | hi) as f32 - m1;
                        }
                    }
                }
            }
            GgmlType::Q6K => {
                let (ql_all, qh_all, sc_all) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = h(&b[208..210]);
                for n in 0..2 {
                    let (ql, qh) = (&ql_all[n * 64..], &qh_all[n * 32..]);
                    let sc = &sc_all[n * 8..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q = [
                            (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                            (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                            (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                            (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                        ];
                        for (k, &qk) in q.iter().enumerate() {
                            let s = sc[is + 2 * k] as i8 as f32;
                            y[n * 128 + k * 32 + l] = d * s * (qk as i32 - 32) as f32;
                        }
                    }
                }
            }
            // Blocks of one value.
            GgmlType::F32 => y[0] = f32::from_le_bytes(b.try_into().unwrap()),
            GgmlType::F16 => y[0] = h(b),
            GgmlType::Bf16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    /// Each block format against its values worked out by hand from ggml's definitions.
    #[test]
    fn blocks_dequantize_as_ggml_defines_them() {
        // Q8_0: scale 0.5, values -128..=96 in steps of 7.
        let mut b = f16b(0.5).to_vec();
        let q: Vec<i8> = (0..32).map(|i| (-128 + 7 * i) as i8).collect();
        b.extend(q.iter().map(|&v| v as u8));
        let y = dequantize(GgmlType::Q8_0, &b);
        assert_eq!(y, q.iter().map(|&v| v as f32 * 0.5).collect::<Vec<_>>());

        // Q4_0: nibble j low = j % 16, high = 15 - j % 16; value (n - 8) * 2.
        let mut b = f16b(2.0).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_0, &b);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0);
            assert_eq!(y[j + 16], (7.0 - j as f32) * 2.0);
        }

        // Q4_1: the same nibbles, value n * 0.25 + (-1).
        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_1, &b);
        assert_eq!(y[3], 3.0 * 0.25 - 1.0);
        assert_eq!(y[19], 12.0 * 0.25 - 1.0);

        // Q5_0: every fifth bit set for the first half only: values (n + 16 - 16) = n.
        let mut b = f16b(1.0).to_vec();
        b.extend(0x0000_FFFFu32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let y = dequantize(GgmlType::Q5_0, &b);
        assert_eq!(y[5], 5.0);
        assert_eq!(y[21], 5.0 - 16.0);

        // Q6_K: scale 1, sub-block scales 1..=16, all 6-bit values 33 (1 after centring).
        let mut b = vec![0x11u8; 128]; // low nibbles 1, high nibbles 1
        b.extend(vec![0xAAu8; 64]); // two high bits 2 everywhere: 1 | 2 << 4 = 33
        b.extend((1..=16u8).collect::<Vec<_>>());
        b.extend(f16b(1.0));
        let y = dequantize(GgmlType::Q6K, &b);
        // Value i uses scale 1 + (i / 16) (the 16 sub-blocks in order).
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, (1 + i / 16) as f32, "value {i}");
        }

        // Q4_K: scales 1..=8 (j < 4 low six bits; j >= 4 split), minimums 0, d 1, nibbles 3.
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = (j + 1) as u8;
        }
        for j in 4..8 {
            scales[j + 4] = (j + 1) as u8; // low four bits of scale j, minimum's bits 0
        }
        let mut b = f16b(1.0).to_vec();
        b.extend(f16b(1.0));
        b.extend(scales);
        b.extend(vec![0x33u8; 128]);
        let y = dequantize(GgmlType::Q4K, &b);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 3.0 * (1 + i / 32) as f32, "value {i}");
        }
    }

    fn string(v: &str) -> Vec<u8> {
        let mut out = (v.len() as u64).to_le_bytes().to_vec();
        out.extend(v.as_bytes());
        out
    }

    /// A GGUF file of version 3: the metadata (key, value type, value bytes), the tensor infos
    /// (name, dimensions innermost first, type, data offset), then `data` from the next
    /// multiple of 32 bytes.
    fn build(
        meta: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, u64)],
        data: &[u8],
    ) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((meta.len() as u64).to_le_bytes());
        for (k, ty, v) in meta {
            b.extend(string(k));
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, ty, offset) in tensors {
            b.extend(string(name));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(data);
        b
    }

    /// `bytes` written to a file of this test and opened; the error's text where refused.
    fn open(tag: &str, bytes: &[u8]) -> Result<Gguf, String> {
        let dir = crate::util::scratch_dir(tag);
        let path = dir.join("t.gguf");
        std::fs::write(&path, bytes).unwrap();
        let r = Gguf::open(&path).map_err(|e| format!("{e:#}"));
        let _ = std::fs::remove_dir_all(&dir);
        r
    }

    /// A tiny file written here byte by byte: metadata of each kind, one tensor, and the
    /// refusals of a truncated file, an unknown tensor type and a wrong magic.
    #[test]
    fn a_file_is_read_and_bad_ones_are_refused_by_name() {
        let meta = |tokens: &[&str]| {
            let mut array = 8u32.to_le_bytes().to_vec();
            array.extend((tokens.len() as u64).to_le_bytes());
            for t in tokens {
                array.extend(string(t));
            }
            vec![
                ("general.architecture", 8, string("llama")),
                ("llama.rope.freq_base", 6, 10000f32.to_le_bytes().to_vec()),
                ("tokenizer.ggml.tokens", 9, array),
            ]
        };
        let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let file = |ty: u32, truncate: usize| {
            let mut b = build(&meta(&["a", "b"]), &[("w", &[3, 2], ty, 0)], &data);
            b.truncate(b.len() - truncate);
            b
        };
        let dir = crate::util::scratch_dir("gguf-read");
        let path = dir.join("t.gguf");
        std::fs::write(&path, file(0, 0)).unwrap();
        assert!(is_gguf(&path));
        let g = Gguf::open(&path).unwrap();
        assert_eq!(
            g.get("general.architecture").unwrap().as_str(),
            Some("llama")
        );
        assert_eq!(
            g.get("llama.rope.freq_base").unwrap().as_f64(),
            Some(10000.0)
        );
        assert_eq!(
            g.get("tokenizer.ggml.tokens")
                .unwrap()
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(g.tensors[0].shape, vec![2, 3]);
        let t = g.tensor(&g.tensors[0]).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(t.flatten(0, -1)).unwrap(),
            vec![0., 1., 2., 3., 4., 5.]
        );
        // A key of another type than asked is refused by name, not taken for absent.
        let e = g.typed("general.architecture", "an integer", Value::as_int);
        assert!(format!("{:#}", e.unwrap_err()).contains("is a string, not an integer"));
        assert_eq!(g.typed("absent", "a bool", Value::as_bool).unwrap(), None);
        let _ = std::fs::remove_dir_all(&dir);

        let err = |bytes: Vec<u8>| open("gguf-bad", &bytes).err().expect("refused");
        assert!(err(file(0, 4)).contains("runs past the end of the file"));
        assert!(err(file(23, 0)).contains("IQ4_XS"), "{}", err(file(23, 0)));
        let mut bad = file(0, 0);
        bad[0] = b'X';
        assert!(err(bad).contains("does not start with the magic GGUF"));
        assert!(err(b"GG".to_vec()).contains("does not start with the magic GGUF"));
        let mut huge = file(0, 0);
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(huge).contains("cannot fit"));
    }

    /// Tensors are read only where they lie one after another, aligned, each under its own
    /// name; the metadata only within its memory budget.
    #[test]
    fn tensors_out_of_place_and_metadata_beyond_its_budget_are_refused() {
        let data = vec![0u8; 256];
        let refused = |tensors: &[(&str, &[u64], u32, u64)]| {
            open("gguf-layout", &build(&[], tensors, &data))
                .err()
                .expect("refused")
        };
        // 4 F32 values take 16 bytes; the next tensor starts at 32 (the alignment).
        assert!(open(
            "gguf-layout",
            &build(&[], &[("a", &[4], 0, 0), ("b", &[4], 0, 32)], &data)
        )
        .is_ok());
        let e = refused(&[("a", &[4], 0, 0), ("a", &[4], 0, 32)]);
        assert!(e.contains("tensor a appears twice"), "{e}");
        let e = refused(&[("a", &[4], 0, 0), ("b", &[4], 0, 40)]);
        assert!(e.contains("not a multiple of the alignment 32"), "{e}");
        let e = refused(&[("a", &[16], 0, 0), ("b", &[4], 0, 32)]);
        assert!(e.contains("overlaps the tensor before it"), "{e}");
        let e = refused(&[("a", &[4], 0, 0), ("b", &[4], 0, 0)]);
        assert!(e.contains("overlaps"), "{e}");
        let e = refused(&[("a", &[4], 0, 0), ("b", &[4], 0, 64)]);
        assert!(e.contains("leaving 48 bytes unused"), "{e}");
        let e = refused(&[("a", &[4], 0, 32)]);
        assert!(e.contains("leaving 32 bytes unused"), "{e}");

        // An array of 20 million one-byte values: 20 MB of file, far more once read.
        let n = 20_000_000u64;
        let mut array = 0u32.to_le_bytes().to_vec();
        array.extend(n.to_le_bytes());
        array.extend(vec![1u8; n as usize]);
        let e = open("gguf-budget", &build(&[("big", 9, array)], &[], &[]))
            .err()
            .expect("refused");
        assert!(e.contains("an array of 20000000 values would take"), "{e}");
    }
}
