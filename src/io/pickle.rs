//! PyTorch checkpoints read without Python: the tensors of a `torch.save` archive, of a tch
//! `VarStore` file (`.ot`) and of a TorchScript archive (`torch.jit.save`).
//!
//! TorchScript archives and `.ot` files are modules; libtorch's loader (`torch::jit::load`,
//! through tch) reads their parameters. A `torch.save` archive is a zip of one pickle
//! (`<name>/data.pkl`) and the raw bytes of each tensor storage (`<name>/data/<key>`).
//! libtorch's own unpickler cannot read those: it turns every `collections.OrderedDict`
//! into None (it expects OrderedDicts only as a tensor's empty backward hooks), and every
//! `state_dict()` is one. So the pickle is read here by an interpreter of the pickle machine
//! that builds values and nothing else: containers (dict, OrderedDict, list, tuple, set),
//! numbers, strings, bytes, booleans, None, `torch.device`, and tensors rebuilt from their
//! storages (`torch._utils._rebuild_tensor_v2`, `_rebuild_parameter`,
//! `torch._tensor._rebuild_from_type_v2` of a plain tensor or parameter). Any other global a
//! pickle names (a class of the program that saved it, numpy scalars, argparse namespaces,
//! functions) is refused by name: calling it is what lets a pickle run code. Such files, and
//! the legacy (pre-zip, PyTorch < 1.6) format, need Python (`convert --allow-pickle`).

use anyhow::{bail, ensure, Context, Result};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;
use std::rc::Rc;
use tch::{Kind, Tensor};

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

/// A value of the pickle machine.
#[derive(Clone, Debug)]
enum Value {
    /// None, a bool, a float or bytes, by its Python type's name: read past, never used.
    Scalar(&'static str),
    Int(i64),
    Str(String),
    Tuple(Rc<[Value]>),
    List(Rc<RefCell<Vec<Value>>>),
    Dict(Rc<RefCell<Vec<(Value, Value)>>>),
    /// A global the interpreter knows (module, name); calling it is the only way it acts.
    Global(String, String),
    /// A tensor storage: its key in the archive, element type and length.
    Storage {
        key: String,
        kind: Kind,
        numel: i64,
    },
    Tensor(Rc<TensorRef>),
}

/// A tensor as `_rebuild_tensor_v2` describes it: a view of a storage.
#[derive(Debug)]
struct TensorRef {
    key: String,
    kind: Kind,
    numel: i64,
    offset: i64,
    size: Vec<i64>,
    stride: Vec<i64>,
}

/// The globals a pickle may name, and the element types of storage classes.
fn storage_kind(name: &str) -> Option<Kind> {
    Some(match name {
        "FloatStorage" => Kind::Float,
        "DoubleStorage" => Kind::Double,
        "HalfStorage" => Kind::Half,
        "BFloat16Storage" => Kind::BFloat16,
        "LongStorage" => Kind::Int64,
        "IntStorage" => Kind::Int,
        "ShortStorage" => Kind::Int16,
        "CharStorage" => Kind::Int8,
        "ByteStorage" => Kind::Uint8,
        "BoolStorage" => Kind::Bool,
        _ => return None,
    })
}

fn allowed_global(module: &str, name: &str) -> bool {
    matches!(
        (module, name),
        ("collections", "OrderedDict")
            | ("builtins", "set")
            | ("builtins", "frozenset")
            | ("torch", "device")
            | ("torch", "Tensor")
            | ("torch._utils", "_rebuild_tensor_v2")
            | ("torch._utils", "_rebuild_parameter")
            | ("torch._utils", "_rebuild_parameter_with_state")
            | ("torch._tensor", "_rebuild_from_type_v2")
            | ("torch.nn.parameter", "Parameter")
    ) || (module == "torch" && storage_kind(name).is_some())
}

/// A refused global: what it is and what to do.
fn refused(module: &str, name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "the pickle names {module}.{name}, which is not a tensor, container or number; reading \
         it would mean running Python code from the file. Pass --allow-pickle if you trust the \
         file (Python's torch.load then reads it), or save only the state_dict's tensors"
    )
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

/// Containers nested deeper than this, or more values than `MAX_VALUES` reached through
/// them, are refused: a state dict is a few levels deep and holds one value per tensor, while
/// a pickle can build a container that holds itself, or a few that refer to each other over
/// and over (memo references make that cheap to write and exponential to walk).
const MAX_DEPTH: usize = 64;
const MAX_VALUES: usize = 10_000_000;

/// The tensors of a pickled value at dotted names; `budget` counts down the values visited.
fn flatten(
    v: &Value,
    name: String,
    depth: usize,
    budget: &mut usize,
    out: &mut Vec<(String, Rc<TensorRef>)>,
) -> Result<()> {
    ensure!(
        depth <= MAX_DEPTH && *budget > 0,
        "the pickle nests containers more than {MAX_DEPTH} deep or reaches more than \
         {MAX_VALUES} values through them (a container inside itself?)"
    );
    *budget -= 1;
    let join = |k: &str| match name.is_empty() {
        true => k.to_string(),
        false => format!("{name}.{k}"),
    };
    match v {
        Value::Tensor(t) => out.push((name, t.clone())),
        Value::Dict(d) => {
            for (k, x) in d.borrow().iter() {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    _ => continue,
                };
                flatten(x, join(&key), depth + 1, budget, out)?;
            }
        }
        Value::List(l) => {
            for (i, x) in l.borrow().iter().enumerate() {
                flatten(x, join(&i.to_string()), depth + 1, budget, out)?;
            }
        }
        Value::Tuple(l) => {
            for (i, x) in l.iter().enumerate() {
                flatten(x, join(&i.to_string()), depth + 1, budget, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The pickle virtual machine, restricted to building values.
struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Positions in `stack` where MARKs were pushed.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl<'a> Machine<'a> {
    fn new(data: &'a [u8]) -> Self {
        Machine {
            data,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        // (Lengths come from the file: `pos + n` could wrap.)
        ensure!(
            n <= self.data.len() - self.pos,
            "the pickle ends in the middle of an instruction"
        );
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64> {
        Ok(self
            .take(n)?
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn line(&mut self) -> Result<&'a str> {
        let rest = &self.data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .context("the pickle ends in the middle of a line")?;
        let s = std::str::from_utf8(&rest[..end]).context("a pickle line is not UTF-8")?;
        self.pos += end + 1;
        Ok(s)
    }

    fn pop(&mut self) -> Result<Value> {
        ensure!(
            self.marks.last().is_none_or(|&m| self.stack.len() > m),
            "the pickle pops past a mark"
        );
        self.stack.pop().context("the pickle's stack is empty")
    }

    fn top(&mut self) -> Result<&mut Value> {
        self.stack.last_mut().context("the pickle's stack is empty")
    }

    /// The items since the last MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let m = self
            .marks
            .pop()
            .context("the pickle has no mark to pop to")?;
        ensure!(
            m <= self.stack.len(),
            "the pickle's mark is above its stack"
        );
        Ok(self.stack.split_off(m))
    }

    fn text(&mut self, n: usize) -> Result<Value> {
        let b = self.take(n)?;
        Ok(Value::Str(
            String::from_utf8(b.to_vec()).context("a pickled string is not UTF-8")?,
        ))
    }

    fn run(mut self) -> Result<Value> {
        loop {
            match self.u8()? {
                b'.' => return self.pop(),
                op => self.step(op)?,
            }
        }
    }

    /// One instruction, by family (pickletools' names in each family's documentation).
    fn step(&mut self, op: u8) -> Result<()> {
        match op {
            0x80 | 0x95 | b'(' | b'0' | b'1' | b'2' => self.control(op),
            b'N' | 0x88 | 0x89 | b'J' | b'K' | b'M' | 0x8a | 0x8b | b'I' | b'L' | b'G' | b'F' => {
                self.number(op)
            }
            b'X' | 0x8c | 0x8d | b'V' | b'T' | b'U' | b'B' | b'C' | 0x8e | b'S' => self.string(op),
            b')'
            | b't'
            | 0x85..=0x87
            | b']'
            | b'l'
            | b'a'
            | b'e'
            | b'}'
            | b'd'
            | b's'
            | b'u'
            | 0x8f
            | 0x90
            | 0x91 => self.container(op),
            b'c' | 0x93 | b'R' | 0x81 | 0x92 | b'b' | b'Q' => self.object(op),
            b'q' | b'r' | b'p' | 0x94 | b'h' | b'j' | b'g' => self.memo(op),
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
    }

    /// Protocol, framing, marks and the stack: PROTO, FRAME, MARK, POP, POP_MARK, DUP.
    fn control(&mut self, op: u8) -> Result<()> {
        match op {
            0x80 => {
                let proto = self.u8()?;
                ensure!(proto <= 5, "pickle protocol {proto} is not supported");
            }
            0x95 => {
                self.take(8)?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?.clone();
                self.stack.push(v);
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    /// Numbers and constants: NONE, NEWTRUE/NEWFALSE, the integers, the floats (read, never built).
    fn number(&mut self, op: u8) -> Result<()> {
        match op {
            b'N' => self.stack.push(Value::Scalar("None")),
            0x88 | 0x89 => self.stack.push(Value::Scalar("bool")),
            b'J' => {
                let v = self.le(4)? as u32 as i32 as i64;
                self.stack.push(Value::Int(v));
            }
            b'K' => {
                let v = self.u8()? as i64;
                self.stack.push(Value::Int(v));
            }
            b'M' => {
                let v = self.le(2)? as i64;
                self.stack.push(Value::Int(v));
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.u8()? as usize
                } else {
                    self.le(4)? as usize
                };
                ensure!(n <= 8, "a pickled integer of {n} bytes is too large");
                let b = self.take(n)?;
                let mut v: i64 = 0;
                for (i, &x) in b.iter().enumerate() {
                    v |= (x as i64) << (8 * i);
                }
                // Two's complement of the bytes given.
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                self.stack.push(Value::Int(v));
            }
            b'I' | b'L' => {
                let l = self.line()?.trim_end_matches('L');
                let v = match l {
                    "00" | "01" => Value::Scalar("bool"),
                    _ => Value::Int(l.parse().context("a pickled integer")?),
                };
                self.stack.push(v);
            }
            b'G' => {
                self.take(8)?;
                self.stack.push(Value::Scalar("float"));
            }
            b'F' => {
                self.line()?;
                self.stack.push(Value::Scalar("float"));
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    /// Strings and bytes (bytes are read, never built).
    fn string(&mut self, op: u8) -> Result<()> {
        match op {
            b'X' => {
                let n = self.le(4)? as usize;
                let v = self.text(n)?;
                self.stack.push(v);
            }
            0x8c => {
                let n = self.u8()? as usize;
                let v = self.text(n)?;
                self.stack.push(v);
            }
            0x8d => {
                let n = self.le(8)? as usize;
                let v = self.text(n)?;
                self.stack.push(v);
            }
            b'V' => {
                let v = Value::Str(self.line()?.to_string());
                self.stack.push(v);
            }
            b'T' | b'U' | b'B' | b'C' | 0x8e => {
                let n = match op {
                    b'U' | b'C' => self.u8()? as usize,
                    0x8e => self.le(8)? as usize,
                    _ => self.le(4)? as usize,
                };
                let b = self.take(n)?;
                // Python 2 strings (T, U) are text to Python 3's default decoder.
                let v = match (op, std::str::from_utf8(b)) {
                    (b'T' | b'U', Ok(s)) => Value::Str(s.to_string()),
                    _ => Value::Scalar("bytes"),
                };
                self.stack.push(v);
            }
            b'S' => {
                let l = self.line()?;
                let v = Value::Str(l.trim_matches(|c| c == '\'' || c == '"').to_string());
                self.stack.push(v);
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    /// Tuples, lists, dicts and sets, and what adds to them.
    fn container(&mut self, op: u8) -> Result<()> {
        match op {
            b')' => self.stack.push(Value::Tuple(Rc::new([]))),
            b't' => {
                let items = self.pop_mark()?;
                self.stack.push(Value::Tuple(items.into()));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                ensure!(self.stack.len() >= n, "the pickle's stack is too short");
                let items = self.stack.split_off(self.stack.len() - n);
                self.stack.push(Value::Tuple(items.into()));
            }
            b']' => self.stack.push(Value::List(Rc::default())),
            b'l' => {
                let items = self.pop_mark()?;
                self.stack.push(Value::List(Rc::new(RefCell::new(items))));
            }
            b'a' => {
                let v = self.pop()?;
                match self.top()? {
                    Value::List(l) => l.borrow_mut().push(v),
                    other => bail!("the pickle appends to a {}", kind_name(other)),
                }
            }
            b'e' => {
                let items = self.pop_mark()?;
                match self.top()? {
                    Value::List(l) => l.borrow_mut().extend(items),
                    other => bail!("the pickle appends to a {}", kind_name(other)),
                }
            }
            b'}' => self.stack.push(Value::Dict(Rc::default())),
            b'd' => {
                let items = self.pop_mark()?;
                let d = pairs(items)?;
                self.stack.push(Value::Dict(Rc::new(RefCell::new(d))));
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                match self.top()? {
                    Value::Dict(d) => d.borrow_mut().push((k, v)),
                    other => bail!("the pickle sets an item of a {}", kind_name(other)),
                }
            }
            b'u' => {
                let items = pairs(self.pop_mark()?)?;
                match self.top()? {
                    Value::Dict(d) => d.borrow_mut().extend(items),
                    other => bail!("the pickle sets items of a {}", kind_name(other)),
                }
            }
            0x8f => self.stack.push(Value::List(Rc::default())),
            0x90 => {
                let items = self.pop_mark()?;
                match self.top()? {
                    Value::List(l) => l.borrow_mut().extend(items),
                    other => bail!("the pickle adds items to a {}", kind_name(other)),
                }
            }
            0x91 => {
                let items = self.pop_mark()?;
                self.stack.push(Value::List(Rc::new(RefCell::new(items))));
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    /// Globals (allowed ones only), calls of them, BUILD and persistent ids (tensor storages).
    fn object(&mut self, op: u8) -> Result<()> {
        match op {
            b'c' => {
                let module = self.line()?.to_string();
                let name = self.line()?.to_string();
                self.global(module, name)?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => self.global(m, n)?,
                    _ => bail!("the pickle's STACK_GLOBAL names are not strings"),
                }
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let f = self.pop()?;
                let Value::Tuple(args) = args else {
                    bail!("the pickle calls with arguments that are not a tuple")
                };
                let v = call(f, &args)?;
                self.stack.push(v);
            }
            0x92 => {
                let _kwargs = self.pop()?;
                let args = self.pop()?;
                let f = self.pop()?;
                let Value::Tuple(args) = args else {
                    bail!("the pickle calls with arguments that are not a tuple")
                };
                let v = call(f, &args)?;
                self.stack.push(v);
            }
            b'b' => {
                // State for an object built above: an OrderedDict's attributes (a
                // state_dict's `_metadata`) or a tensor's; none changes the tensors.
                self.pop()?;
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = storage(pid)?;
                self.stack.push(v);
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    /// The memo: PUT and GET in their three forms each, and MEMOIZE.
    fn memo(&mut self, op: u8) -> Result<()> {
        match op {
            b'q' => {
                let i = self.u8()? as u32;
                self.put(i)?;
            }
            b'r' => {
                let i = self.le(4)? as u32;
                self.put(i)?;
            }
            b'p' => {
                let i = self.line()?.parse().context("a pickle memo index")?;
                self.put(i)?;
            }
            0x94 => {
                let i = self.memo.len() as u32;
                self.put(i)?;
            }
            b'h' => {
                let i = self.u8()? as u32;
                self.get(i)?;
            }
            b'j' => {
                let i = self.le(4)? as u32;
                self.get(i)?;
            }
            b'g' => {
                let i = self.line()?.parse().context("a pickle memo index")?;
                self.get(i)?;
            }
            other => bail!("pickle instruction 0x{other:02x} is not supported"),
        }
        Ok(())
    }

    fn global(&mut self, module: String, name: String) -> Result<()> {
        if !allowed_global(&module, &name) {
            return Err(refused(&module, &name));
        }
        self.stack.push(Value::Global(module, name));
        Ok(())
    }

    fn put(&mut self, i: u32) -> Result<()> {
        let v = self.top()?.clone();
        self.memo.insert(i, v);
        Ok(())
    }

    fn get(&mut self, i: u32) -> Result<()> {
        let v = self
            .memo
            .get(&i)
            .cloned()
            .with_context(|| format!("the pickle reads memo {i}, which it never stored"))?;
        self.stack.push(v);
        Ok(())
    }
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::Scalar(k) => k,
        Value::Int(_) => "int",
        Value::Str(_) => "str",
        Value::Tuple(_) => "tuple",
        Value::List(_) => "list",
        Value::Dict(_) => "dict",
        Value::Global(..) => "class or function",
        Value::Storage { .. } => "storage",
        Value::Tensor(_) => "tensor",
    }
}

fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>> {
    ensure!(
        items.len() % 2 == 0,
        "the pickle sets a key without a value"
    );
    let mut it = items.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// A persistent id: `('storage', <storage class>, key, location, numel)`.
fn storage(pid: Value) -> Result<Value> {
    let Value::Tuple(t) = pid else {
        bail!("the pickle's persistent id is not a tuple")
    };
    match &t[..] {
        [Value::Str(tag), Value::Global(_, class), Value::Str(key), _, Value::Int(numel)]
            if tag == "storage" =>
        {
            let kind = storage_kind(class)
                .with_context(|| format!("storage class {class} is not supported"))?;
            ensure!(*numel >= 0, "storage {key} has a negative length");
            Ok(Value::Storage {
                key: key.clone(),
                kind,
                numel: *numel,
            })
        }
        _ => bail!("the pickle's persistent id is not a tensor storage"),
    }
}

fn ints(v: &Value) -> Result<Vec<i64>> {
    match v {
        Value::Tuple(t) => t
            .iter()
            .map(|x| match x {
                Value::Int(i) => Ok(*i),
                _ => bail!("a tensor's size or stride holds a {}", kind_name(x)),
            })
            .collect(),
        other => bail!("a tensor's size or stride is a {}", kind_name(other)),
    }
}

/// Calls one of the allowed globals.
fn call(f: Value, args: &[Value]) -> Result<Value> {
    let Value::Global(module, name) = f else {
        bail!("the pickle calls a {}", kind_name(&f))
    };
    Ok(match (module.as_str(), name.as_str()) {
        ("collections", "OrderedDict") => Value::Dict(Rc::default()),
        ("builtins", "set" | "frozenset") => match args.first() {
            Some(Value::List(l)) => Value::List(l.clone()),
            None => Value::List(Rc::default()),
            Some(other) => bail!("set() of a {}", kind_name(other)),
        },
        ("torch", "device") => match args.first() {
            Some(Value::Str(s)) => Value::Str(s.clone()),
            _ => bail!("torch.device() without a name"),
        },
        ("torch._utils", "_rebuild_tensor_v2") => {
            ensure!(args.len() >= 4, "_rebuild_tensor_v2 with too few arguments");
            let Value::Storage { key, kind, numel } = &args[0] else {
                bail!("_rebuild_tensor_v2 of a {}", kind_name(&args[0]))
            };
            let Value::Int(offset) = args[1] else {
                bail!("_rebuild_tensor_v2 with a storage offset that is not an integer")
            };
            let (size, stride) = (ints(&args[2])?, ints(&args[3])?);
            ensure!(
                size.len() == stride.len()
                    && size.iter().chain(&stride).all(|&s| s >= 0)
                    && offset >= 0,
                "a tensor of storage {key} has a malformed size or stride"
            );
            Value::Tensor(Rc::new(TensorRef {
                key: key.clone(),
                kind: *kind,
                numel: *numel,
                offset,
                size,
                stride,
            }))
        }
        // A parameter is its tensor here.
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            match args.first() {
                Some(t @ Value::Tensor(_)) => t.clone(),
                _ => bail!("{name} of something that is not a tensor"),
            }
        }
        // (function, type, arguments, state): rebuilt by the function, for a plain tensor or
        // a parameter only.
        ("torch._tensor", "_rebuild_from_type_v2") => {
            let [func, ty, Value::Tuple(inner), ..] = args else {
                bail!("_rebuild_from_type_v2 with malformed arguments")
            };
            match &ty {
                Value::Global(m, n)
                    if (m == "torch" && n == "Tensor")
                        || (m == "torch.nn.parameter" && n == "Parameter") => {}
                other => bail!("a tensor of type {other:?} is not supported"),
            }
            call(func.clone(), inner)?
        }
        _ => return Err(refused(&module, &name)),
    })
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
