//! The pickle machine, restricted to building values: what `pickle.rs` reads a `torch.save`
//! archive's `data.pkl` with. It builds containers (dict, OrderedDict, list, tuple, set),
//! numbers, strings, bytes, booleans, None, `torch.device`, and tensors rebuilt from their
//! storages; any other global a pickle names is refused by name, since calling it is what lets
//! a pickle run code. Nesting and the values reached through containers are bounded.

use anyhow::{bail, ensure, Context, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use tch::Kind;

/// A value of the pickle machine.
#[derive(Clone, Debug)]
pub(super) enum Value {
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
pub(super) struct TensorRef {
    pub(super) key: String,
    pub(super) kind: Kind,
    pub(super) numel: i64,
    pub(super) offset: i64,
    pub(super) size: Vec<i64>,
    pub(super) stride: Vec<i64>,
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

/// Containers nested deeper than this, or more values than `MAX_VALUES` reached through
/// them, are refused: a state dict is a few levels deep and holds one value per tensor, while
/// a pickle can build a container that holds itself, or a few that refer to each other over
/// and over (memo references make that cheap to write and exponential to walk).
const MAX_DEPTH: usize = 64;
pub(super) const MAX_VALUES: usize = 10_000_000;

/// The tensors of a pickled value at dotted names; `budget` counts down the values visited.
pub(super) fn flatten(
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
pub(super) struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Positions in `stack` where MARKs were pushed.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl<'a> Machine<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
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

    pub(super) fn run(mut self) -> Result<Value> {
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
