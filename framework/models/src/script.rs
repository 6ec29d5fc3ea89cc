//! TorchScript serving files written without Python.
//!
//! A TorchScript file is a zip archive that `torch.jit.load` (PyTorch) and `torch::jit::load`
//! (libtorch C++) read: the module's class as TorchScript source (`code/__torch__.py`, compiled
//! at load), its attributes pickled in `data.pkl` (tensors by reference to `data/<n>` records),
//! a file-format `version`, and any extra files (`extra/<name>`). [`ScriptModule`] collects a
//! module's attributes and methods and writes that archive; the models write their dense part
//! through it (`DenseModel::torchscript`), the engine the embedding lookups around it.
//!
//! Source is written in the serialized dialect `torch.jit.load` compiles: operators are called
//! as `torch.<op>` or `ops.<namespace>.<op>` (not `torch.nn.functional`), tensors' own methods
//! are allowed.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;

use tch::{Kind, Tensor};

/// Why a module could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ScriptError(pub String);

impl From<tch::TchError> for ScriptError {
    fn from(e: tch::TchError) -> Self {
        Self(format!("libtorch: {e}"))
    }
}

/// The element type of a tensor attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// `torch.float32`.
    F32,
    /// `torch.float16`.
    F16,
    /// `torch.uint8`.
    U8,
    /// `torch.int64`.
    I64,
}

impl Dtype {
    fn storage(self) -> &'static str {
        match self {
            Self::F32 => "FloatStorage",
            Self::F16 => "HalfStorage",
            Self::U8 => "ByteStorage",
            Self::I64 => "LongStorage",
        }
    }
    fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::U8 => 1,
            Self::I64 => 8,
        }
    }
    fn of(kind: Kind) -> Option<Self> {
        match kind {
            Kind::Float => Some(Self::F32),
            Kind::Half => Some(Self::F16),
            Kind::Uint8 => Some(Self::U8),
            Kind::Int64 => Some(Self::I64),
            _ => None,
        }
    }
}

/// A contiguous CPU tensor's raw bytes (little-endian).
#[derive(Clone, Debug)]
pub struct TensorBytes {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<i64>,
    /// `product(shape) * size(dtype)` bytes, row-major.
    pub bytes: Vec<u8>,
}

impl TensorBytes {
    /// `values` as an fp32 tensor of `shape`.
    pub fn f32(shape: Vec<i64>, values: &[f32]) -> Self {
        Self { dtype: Dtype::F32, shape, bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }
    /// `values` as an int64 tensor of `shape`.
    pub fn i64(shape: Vec<i64>, values: &[i64]) -> Self {
        Self { dtype: Dtype::I64, shape, bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }
    /// A tch tensor's values (copied to the CPU, made contiguous; fp64 becomes fp32).
    pub fn from_tensor(t: &Tensor) -> Result<Self, ScriptError> {
        let t = t.f_detach()?.f_to_device(tch::Device::Cpu)?;
        let t = if t.kind() == Kind::Double { t.f_to_kind(Kind::Float)? } else { t };
        let dtype = Dtype::of(t.kind()).ok_or_else(|| {
            ScriptError(format!("a tensor of kind {:?} has no TorchScript attribute type here", t.kind()))
        })?;
        let t = t.f_contiguous()?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * dtype.size()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        Ok(Self { dtype, shape: t.size(), bytes })
    }
    fn numel(&self) -> usize {
        self.shape.iter().product::<i64>().max(0) as usize
    }
}

/// A module attribute.
#[derive(Clone, Debug)]
pub enum Attr {
    /// A tensor (declared as a buffer).
    Tensor(TensorBytes),
    /// `int`.
    Int(i64),
    /// `float`.
    Float(f64),
    /// `List[str]`.
    Strings(Vec<String>),
}

impl Attr {
    fn type_name(&self) -> &'static str {
        match self {
            Self::Tensor(_) => "Tensor",
            Self::Int(_) => "int",
            Self::Float(_) => "float",
            Self::Strings(_) => "List[str]",
        }
    }
}

/// A TorchScript module being written: attributes and methods (TorchScript source).
#[derive(Debug)]
pub struct ScriptModule {
    class: String,
    attrs: Vec<(String, Attr)>,
    methods: Vec<String>,
    names: HashMap<String, usize>,
}

/// The variables of a model's VarStore, by name (`nn::VarStore::variables()`).
pub type Vars = HashMap<String, Tensor>;

/// An identifier from `name`: letters, digits and `_` kept, anything else `_`.
fn identifier(name: &str) -> String {
    let mut s: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    s
}

/// A Python string literal.
pub fn string_literal(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl ScriptModule {
    /// An empty module of class `__torch__.<class>`.
    pub fn new(class: &str) -> Self {
        Self { class: identifier(class), attrs: Vec::new(), methods: Vec::new(), names: HashMap::new() }
    }

    /// A fresh attribute name from `name` (made an identifier, suffixed when taken).
    fn fresh(&mut self, name: &str) -> String {
        let base = identifier(name);
        let n = self.names.entry(base.clone()).or_insert(0);
        *n += 1;
        if *n == 1 { base } else { format!("{base}_{}", *n - 1) }
    }

    /// Adds attribute `attr` under a name made from `name`; returns how source reads it
    /// (`self.<name>`).
    pub fn attr(&mut self, name: &str, attr: Attr) -> String {
        let name = self.fresh(name);
        self.attrs.push((name.clone(), attr));
        format!("self.{name}")
    }

    /// Adds a tensor attribute (a tch tensor's values, copied); returns `self.<name>`.
    pub fn tensor(&mut self, name: &str, t: &Tensor) -> Result<String, ScriptError> {
        Ok(self.attr(name, Attr::Tensor(TensorBytes::from_tensor(t)?)))
    }

    /// Adds model variable `var` of `vars` as a tensor attribute.
    pub fn var(&mut self, vars: &Vars, var: &str) -> Result<String, ScriptError> {
        let t = vars.get(var).ok_or_else(|| ScriptError(format!("the model has no variable {var}")))?;
        self.tensor(var, t)
    }

    /// Adds a method: its full source, `def name(self, ...) -> T:` then its body indented by
    /// four spaces.
    pub fn method(&mut self, source: impl Into<String>) {
        self.methods.push(source.into());
    }

    /// Appends to `body` (method lines, indented by four spaces) the MLP whose layers are
    /// `<prefix>.layer<i>.{weight,bias}` in `vars` (ReLU after each, and after the last when
    /// `relu_last`), applied to `input`; returns the variable holding its output.
    pub fn mlp(
        &mut self,
        body: &mut Vec<String>,
        vars: &Vars,
        prefix: &str,
        input: &str,
        relu_last: bool,
    ) -> Result<String, ScriptError> {
        let layers = (0..).take_while(|i| vars.contains_key(&format!("{prefix}.layer{i}.weight"))).count();
        if layers == 0 {
            return Err(ScriptError(format!("the model has no layers under {prefix}")));
        }
        let out = identifier(prefix);
        let mut x = input.to_string();
        for i in 0..layers {
            let w = self.var(vars, &format!("{prefix}.layer{i}.weight"))?;
            let b = self.var(vars, &format!("{prefix}.layer{i}.bias"))?;
            let linear = format!("torch.linear({x}, {w}, {b})");
            if relu_last || i + 1 < layers {
                body.push(format!("    {out} = torch.relu({linear})"));
            } else {
                body.push(format!("    {out} = {linear}"));
            }
            x = out.clone();
        }
        Ok(out)
    }

    /// The class source (`code/__torch__.py`).
    pub fn source(&self) -> String {
        let mut s = format!("class {}(Module):\n  __parameters__ = []\n  __buffers__ = [", self.class);
        for (name, a) in &self.attrs {
            if matches!(a, Attr::Tensor(_)) {
                let _ = write!(s, "\"{name}\", ");
            }
        }
        s.push_str("]\n  training : bool\n");
        for (name, a) in &self.attrs {
            let _ = writeln!(s, "  {name} : {}", a.type_name());
        }
        for m in &self.methods {
            for line in m.lines() {
                if line.trim().is_empty() {
                    continue;
                }
                let _ = writeln!(s, "  {line}");
            }
        }
        s
    }

    /// The archive's bytes: a TorchScript file whose top folder is `archive` (PyTorch names
    /// it after the file), with `extra` files under `extra/`.
    pub fn archive(&self, archive: &str, extra: &[(&str, &[u8])]) -> Result<Vec<u8>, ScriptError> {
        let archive = identifier(archive);
        let (pickle, storages) = self.pickle();
        let source = self.source();
        let mut out = std::io::Cursor::new(Vec::new());
        let mut zip = zip::ZipWriter::new(&mut out);
        let zerr = |e: zip::result::ZipError| ScriptError(format!("cannot write the archive: {e}"));
        let ioerr = |e: std::io::Error| ScriptError(format!("cannot write the archive: {e}"));
        let mut put = |name: String, bytes: &[u8]| -> Result<(), ScriptError> {
            let options = zip::write::FileOptions::default()
                .compression_method(zip::CompressionMethod::Stored)
                .large_file(bytes.len() as u64 >= u64::from(u32::MAX) / 2);
            // Records start on 64-byte boundaries, as torch.jit.save writes them (so a loader
            // may map tensors in place).
            zip.start_file_aligned(format!("{archive}/{name}"), options, 64).map_err(zerr)?;
            zip.write_all(bytes).map_err(ioerr)
        };
        put("data.pkl".into(), &pickle)?;
        put("code/__torch__.py".into(), source.as_bytes())?;
        // No constants: every value is an attribute. An empty tuple, pickled.
        put("constants.pkl".into(), &[0x80, 0x02, b')', b'.'])?;
        put("version".into(), b"3\n")?;
        put("byteorder".into(), b"little")?;
        for (i, t) in storages.iter().enumerate() {
            put(format!("data/{i}"), &t.bytes)?;
        }
        for (name, bytes) in extra {
            put(format!("extra/{name}"), bytes)?;
        }
        zip.finish().map_err(zerr)?;
        drop(zip);
        Ok(out.into_inner())
    }

    /// `data.pkl`: the module object (protocol 2), and the tensors its storages refer to in
    /// order (`data/<i>`).
    fn pickle(&self) -> (Vec<u8>, Vec<&TensorBytes>) {
        let mut p = Pickle::default();
        let mut storages = Vec::new();
        p.global("__torch__", &self.class);
        p.op(b")\x81}(");
        p.string("training");
        p.op(b"\x89");
        for (name, a) in &self.attrs {
            p.string(name);
            match a {
                Attr::Tensor(t) => {
                    p.tensor(t, storages.len());
                    storages.push(t);
                }
                Attr::Int(v) => p.int(*v),
                Attr::Float(v) => {
                    p.op(b"G");
                    p.0.extend(v.to_be_bytes());
                }
                Attr::Strings(v) => {
                    p.global("torch.jit._pickle", "restore_type_tag");
                    p.op(b"](");
                    for s in v {
                        p.string(s);
                    }
                    p.op(b"e");
                    p.string("List[str]");
                    p.op(b"\x86R");
                }
            }
        }
        p.op(b"ub.");
        (p.0, storages)
    }
}

/// A protocol-2 pickle being written (the opcodes TorchScript's unpickler reads).
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, bytes: &[u8]) {
        if self.0.is_empty() {
            self.0.extend([0x80, 0x02]);
        }
        self.0.extend_from_slice(bytes);
    }
    fn global(&mut self, module: &str, name: &str) {
        self.op(b"c");
        self.0.extend(format!("{module}\n{name}\n").bytes());
    }
    fn string(&mut self, s: &str) {
        self.op(b"X");
        self.0.extend((s.len() as u32).to_le_bytes());
        self.0.extend(s.bytes());
    }
    fn int(&mut self, v: i64) {
        if let Ok(v) = i32::try_from(v) {
            self.op(b"J");
            self.0.extend(v.to_le_bytes());
        } else {
            self.op(b"\x8a\x08");
            self.0.extend(v.to_le_bytes());
        }
    }
    fn tuple(&mut self, values: &[i64]) {
        self.op(b"(");
        for &v in values {
            self.int(v);
        }
        self.op(b"t");
    }
    /// `torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`, the
    /// storage a persistent id `('storage', torch.<T>Storage, '<key>', 'cpu', numel)`.
    fn tensor(&mut self, t: &TensorBytes, key: usize) {
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.op(b"((");
        self.string("storage");
        self.global("torch", t.dtype.storage());
        self.string(&key.to_string());
        self.string("cpu");
        self.int(t.numel() as i64);
        self.op(b"tQ");
        self.int(0);
        self.tuple(&t.shape);
        let mut strides = vec![1i64; t.shape.len()];
        for i in (0..t.shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * t.shape[i + 1].max(1);
        }
        self.tuple(&strides);
        self.op(b"\x89");
        self.global("collections", "OrderedDict");
        self.op(b")RtR");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_module_loads_in_libtorch_and_computes_its_source() {
        let mut m = ScriptModule::new("Check");
        let w = m.tensor("w", &Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3])).unwrap();
        let q = m.attr("q", Attr::Tensor(TensorBytes { dtype: Dtype::U8, shape: vec![2], bytes: vec![7, 250] }));
        let i = m.attr("big", Attr::Int(1 << 40));
        let f = m.attr("half", Attr::Float(0.5));
        let names = m.attr("names", Attr::Strings(vec!["a\"b".into(), "c".into()]));
        m.method(format!(
            "def forward(self, x: Tensor) -> Tensor:\n    y = torch.linear(x, {w})\n    return y + torch.sum({q}) * {f} + ({i} - 1099511627775) + len({names})\n"
        ));
        m.method(format!("def get_names(self) -> List[str]:\n    return {names}\n"));
        let bytes = m.archive("check", &[("note.txt", b"hello")]).unwrap();
        let dir = std::env::temp_dir().join(format!("trainrec-script-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("check.pt");
        std::fs::write(&path, &bytes).unwrap();
        let module = tch::CModule::load(&path).unwrap();
        let x = Tensor::from_slice(&[1.0f32, 0.0, 1.0]).view([1, 3]);
        let y = module.forward_ts(&[x]).unwrap();
        let got: Vec<f64> = Vec::try_from(y.to_kind(Kind::Double).view([-1])).unwrap();
        // [1+3, 4+6] + 257 * 0.5 + (2^40 - (2^40 - 1)) + 2.
        let extra = 257.0 * 0.5 + 1.0 + 2.0;
        assert_eq!(got, vec![4.0 + extra, 10.0 + extra]);
        match module.method_is::<tch::IValue>("get_names", &[]).unwrap() {
            tch::IValue::GenericList(v) => {
                assert_eq!(v.len(), 2);
                assert!(matches!(&v[0], tch::IValue::String(s) if s == "a\"b"));
            }
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn identifiers_and_literals_are_escaped() {
        assert_eq!(identifier("dense_arch.layer0.weight"), "dense_arch_layer0_weight");
        assert_eq!(identifier("0x"), "_0x");
        assert_eq!(string_literal("a\"b\\c"), "\"a\\\"b\\\\c\"");
        let mut m = ScriptModule::new("M");
        assert_eq!(m.attr("a.b", Attr::Int(1)), "self.a_b");
        assert_eq!(m.attr("a_b", Attr::Int(2)), "self.a_b_1");
    }
}
