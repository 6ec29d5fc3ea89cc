//! The NumPy `.npy` format (versions 1.0, 2.0 and 3.0): header parsing, the exact header
//! `numpy.save` writes, and typed reads of row ranges.
//!
//! A file is the magic `\x93NUMPY`, a major and minor version byte, the header length
//! (little-endian `u16` for version 1, `u32` for versions 2 and 3), then the header: a Python
//! dict literal `{'descr': '<f4', 'fortran_order': False, 'shape': (N, 13), }` padded with
//! spaces and a final `\n` so the data starts at a multiple of 64 bytes. The data follows, C
//! (row-major) order. Supported element types: `f4`, `f8`, `i1`..`i8`, `u1`..`u8` and `b1`,
//! either byte order.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::DataError;

/// The magic bytes every `.npy` file starts with.
pub const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// An element type of a `.npy` array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// `b1`: one byte, 0 or 1.
    Bool,
    /// `i1`.
    I8,
    /// `i2`.
    I16,
    /// `i4`.
    I32,
    /// `i8`.
    I64,
    /// `u1`.
    U8,
    /// `u2`.
    U16,
    /// `u4`.
    U32,
    /// `u8`.
    U64,
    /// `f4`.
    F32,
    /// `f8`.
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    fn code(self) -> &'static str {
        match self {
            DType::Bool => "b1",
            DType::I8 => "i1",
            DType::I16 => "i2",
            DType::I32 => "i4",
            DType::I64 => "i8",
            DType::U8 => "u1",
            DType::U16 => "u2",
            DType::U32 => "u4",
            DType::U64 => "u8",
            DType::F32 => "f4",
            DType::F64 => "f8",
        }
    }

    /// The little-endian `descr` numpy writes for this type (`<f4`, `|b1`, ...).
    pub fn descr(self) -> String {
        let order = if self.size() == 1 { '|' } else { '<' };
        format!("{order}{}", self.code())
    }
}

/// A parsed `.npy` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    /// Element type.
    pub dtype: DType,
    /// Whether elements are big-endian.
    pub big_endian: bool,
    /// Array shape (the first dimension is rows).
    pub shape: Vec<u64>,
    /// Byte offset of the first element.
    pub data_offset: u64,
}

impl NpyHeader {
    /// Rows: the first dimension (1 for a 0-d array).
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Elements per row: the product of the other dimensions.
    pub fn row_len(&self) -> u64 {
        self.shape.iter().skip(1).product()
    }
}

fn format_err(path: &Path, message: impl Into<String>) -> DataError {
    DataError::Format { path: path.to_path_buf(), message: message.into() }
}

/// The header `numpy.save` writes for a C-order array of `dtype` and `shape`, byte for byte
/// (numpy reserves room for the first dimension to grow to 21 digits, then pads to 64 bytes).
pub fn header_bytes(dtype: DType, shape: &[u64]) -> Vec<u8> {
    let shape_repr = match shape {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        dims => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape_repr}, }}", dtype.descr());
    if let Some(first) = shape.first() {
        header.push_str(&" ".repeat(21usize.saturating_sub(first.to_string().len())));
    }
    let hlen = header.len() + 1;
    let (version, prefix) = if 10 + hlen + 64 <= u16::MAX as usize { (1u8, 10) } else { (2u8, 12) };
    let padlen = 64 - ((prefix + hlen) % 64);
    let total_header = hlen + padlen;
    let mut out = Vec::with_capacity(prefix + total_header);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    if version == 1 {
        out.extend_from_slice(&(total_header as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(total_header as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(b' ', padlen));
    out.push(b'\n');
    out
}

/// Reads and checks the header of `path` (including that the file holds all its data).
pub fn read_header(path: &Path) -> Result<NpyHeader, DataError> {
    let mut file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let header = parse_header(&mut file, path)?;
    let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    let elems = header.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let need =
        elems.and_then(|e| e.checked_mul(header.dtype.size() as u64)).and_then(|b| b.checked_add(header.data_offset));
    match need {
        Some(need) if need <= len => Ok(header),
        Some(need) => Err(format_err(
            path,
            format!("truncated: shape {:?} needs {need} bytes but the file has {len}", header.shape),
        )),
        None => Err(format_err(path, format!("shape {:?} is too large", header.shape))),
    }
}

fn parse_header(file: &mut File, path: &Path) -> Result<NpyHeader, DataError> {
    let mut pre = [0u8; 8];
    file.read_exact(&mut pre).map_err(|_| format_err(path, "not a .npy file (too short for the header)"))?;
    if &pre[..6] != MAGIC {
        return Err(format_err(path, "not a .npy file (no \\x93NUMPY magic)"));
    }
    let major = pre[6];
    let hlen = match major {
        1 => {
            let mut b = [0u8; 2];
            file.read_exact(&mut b).map_err(|e| DataError::io(path, e))?;
            u16::from_le_bytes(b) as usize
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            file.read_exact(&mut b).map_err(|e| DataError::io(path, e))?;
            u32::from_le_bytes(b) as usize
        }
        v => return Err(format_err(path, format!("unsupported .npy format version {v}.{}", pre[7]))),
    };
    if hlen > 1 << 24 {
        return Err(format_err(path, format!("implausible .npy header length {hlen}")));
    }
    let mut text = vec![0u8; hlen];
    file.read_exact(&mut text).map_err(|_| format_err(path, "truncated .npy header"))?;
    let text = String::from_utf8_lossy(&text).into_owned();
    let data_offset = (if major == 1 { 10 } else { 12 } + hlen) as u64;
    let (dtype, big_endian) =
        parse_descr(&dict_value(&text, "descr").ok_or_else(|| format_err(path, "header has no 'descr'"))?)
            .map_err(|m| format_err(path, m))?;
    match dict_value(&text, "fortran_order").as_deref() {
        Some("False") => {}
        Some("True") => return Err(format_err(path, "Fortran-order (column-major) arrays are not supported")),
        _ => return Err(format_err(path, "header has no valid 'fortran_order'")),
    }
    let shape_text = dict_value(&text, "shape").ok_or_else(|| format_err(path, "header has no 'shape'"))?;
    let shape = shape_text
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format_err(path, format!("bad shape {shape_text}")))?;
    Ok(NpyHeader { dtype, big_endian, shape, data_offset })
}

/// The text of the value of `key` in a Python dict literal (quotes stripped from strings).
fn dict_value(text: &str, key: &str) -> Option<String> {
    let pat_single = format!("'{key}'");
    let pat_double = format!("\"{key}\"");
    let at = text
        .find(&pat_single)
        .map(|i| i + pat_single.len())
        .or_else(|| text.find(&pat_double).map(|i| i + pat_double.len()))?;
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    if let Some(r) = rest.strip_prefix('(') {
        let end = r.find(')')?;
        return Some(format!("({})", &r[..end]));
    }
    if let Some(q) = rest.chars().next().filter(|c| *c == '\'' || *c == '"') {
        let r = &rest[1..];
        let end = r.find(q)?;
        return Some(r[..end].to_string());
    }
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim().to_string())
}

fn parse_descr(descr: &str) -> Result<(DType, bool), String> {
    let (order, code) = match descr.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &descr[1..]),
        _ => ('=', descr),
    };
    let dtype = match code {
        "b1" | "?" => DType::Bool,
        "i1" => DType::I8,
        "i2" => DType::I16,
        "i4" => DType::I32,
        "i8" => DType::I64,
        "u1" => DType::U8,
        "u2" => DType::U16,
        "u4" => DType::U32,
        "u8" => DType::U64,
        "f4" => DType::F32,
        "f8" => DType::F64,
        _ => return Err(format!("unsupported element type {descr:?} (supported: f4, f8, i1..i8, u1..u8, b1)")),
    };
    let big_endian = order == '>' || (order == '=' && cfg!(target_endian = "big"));
    Ok((dtype, big_endian))
}

/// An open `.npy` file for row-range reads.
#[derive(Debug)]
pub struct NpyReader {
    file: File,
    path: PathBuf,
    /// The file's header.
    pub header: NpyHeader,
    buf: Vec<u8>,
}

macro_rules! decode {
    ($bytes:expr, $big:expr, $t:ty, $n:literal, $out:expr, $conv:expr) => {{
        for c in $bytes.chunks_exact($n) {
            let a: [u8; $n] = c.try_into().expect("chunk size");
            let v = if $big { <$t>::from_be_bytes(a) } else { <$t>::from_le_bytes(a) };
            $out.push($conv(v));
        }
    }};
}

impl NpyReader {
    /// Opens `path` and reads its header.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let header = read_header(path)?;
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        Ok(Self { file, path: path.to_path_buf(), header, buf: Vec::new() })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_raw(&mut self, start: u64, rows: u64) -> Result<(), DataError> {
        if start.checked_add(rows).is_none_or(|end| end > self.header.rows()) {
            return Err(format_err(
                &self.path,
                format!("rows {start}..{} are out of range (the file has {})", start + rows, self.header.rows()),
            ));
        }
        let row_bytes = self.header.row_len() * self.header.dtype.size() as u64;
        self.buf.resize((rows * row_bytes) as usize, 0);
        self.file
            .seek(SeekFrom::Start(self.header.data_offset + start * row_bytes))
            .map_err(|e| DataError::io(&self.path, e))?;
        self.file.read_exact(&mut self.buf).map_err(|e| DataError::io(&self.path, e))
    }

    /// Reads rows `start..start + rows` into `out`: the elements of 32 bits or fewer (a bool as
    /// 0 or 1) through `small`, the others by `wide` (given the element type, the bytes and
    /// whether they are big-endian; an `Err` message is about the file).
    fn decode<T>(
        &mut self,
        start: u64,
        rows: u64,
        out: &mut Vec<T>,
        small: impl Fn(i64) -> T,
        wide: impl FnOnce(DType, &[u8], bool, &mut Vec<T>) -> Result<(), String>,
    ) -> Result<(), DataError> {
        self.read_raw(start, rows)?;
        let big = self.header.big_endian;
        let b = &self.buf;
        out.clear();
        out.reserve(b.len() / self.header.dtype.size());
        match self.header.dtype {
            DType::Bool => out.extend(b.iter().map(|&x| small((x != 0) as i64))),
            DType::I8 => out.extend(b.iter().map(|&x| small(x as i8 as i64))),
            DType::U8 => out.extend(b.iter().map(|&x| small(x as i64))),
            DType::I16 => decode!(b, big, i16, 2, out, |v| small(v as i64)),
            DType::U16 => decode!(b, big, u16, 2, out, |v| small(v as i64)),
            DType::I32 => decode!(b, big, i32, 4, out, |v| small(v as i64)),
            DType::U32 => decode!(b, big, u32, 4, out, |v| small(v as i64)),
            t => wide(t, b, big, out).map_err(|m| format_err(&self.path, m))?,
        }
        Ok(())
    }

    /// Rows `start..start + rows` as `f64` (row-major), from any element type.
    pub fn read_f64(&mut self, start: u64, rows: u64, out: &mut Vec<f64>) -> Result<(), DataError> {
        self.decode(
            start,
            rows,
            out,
            |v| v as f64,
            |t, b, big, out| {
                match t {
                    DType::I64 => decode!(b, big, i64, 8, out, |v| v as f64),
                    DType::U64 => decode!(b, big, u64, 8, out, |v| v as f64),
                    DType::F32 => decode!(b, big, f32, 4, out, |v| v as f64),
                    _ => decode!(b, big, f64, 8, out, |v| v),
                }
                Ok(())
            },
        )
    }

    /// Rows `start..start + rows` as `f32` (row-major), from any element type (through `f64`,
    /// but for `f32` elements).
    pub fn read_f32(&mut self, start: u64, rows: u64, out: &mut Vec<f32>) -> Result<(), DataError> {
        self.decode(
            start,
            rows,
            out,
            |v| v as f64 as f32,
            |t, b, big, out| {
                match t {
                    DType::I64 => decode!(b, big, i64, 8, out, |v| v as f64 as f32),
                    DType::U64 => decode!(b, big, u64, 8, out, |v| v as f64 as f32),
                    DType::F32 => decode!(b, big, f32, 4, out, |v| v),
                    _ => decode!(b, big, f64, 8, out, |v| v as f32),
                }
                Ok(())
            },
        )
    }

    /// Rows `start..start + rows` as `i64` (row-major); only integer element types (a `u8`
    /// value above `i64::MAX` is an error).
    pub fn read_i64(&mut self, start: u64, rows: u64, out: &mut Vec<i64>) -> Result<(), DataError> {
        if self.header.dtype.is_float() {
            return Err(format_err(&self.path, format!("expected integers, found {}", self.header.dtype.descr())));
        }
        self.decode(
            start,
            rows,
            out,
            |v| v,
            |t, b, big, out| {
                match t {
                    DType::I64 => decode!(b, big, i64, 8, out, |v| v),
                    DType::U64 => {
                        for c in b.chunks_exact(8) {
                            let a: [u8; 8] = c.try_into().expect("chunk size");
                            let v = if big { u64::from_be_bytes(a) } else { u64::from_le_bytes(a) };
                            out.push(i64::try_from(v).map_err(|_| format!("value {v} does not fit in i64"))?);
                        }
                    }
                    _ => unreachable!("checked above"),
                }
                Ok(())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_match_numpy_save() {
        // Printed by `np.save` (numpy 2.4) for these shapes.
        let h = header_bytes(DType::F32, &[1, 13]);
        let dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 13), }";
        assert_eq!(&h[..8], b"\x93NUMPY\x01\x00");
        assert_eq!(u16::from_le_bytes([h[8], h[9]]), 118);
        let want = format!("{dict}{}\n", " ".repeat(117 - dict.len()));
        assert_eq!(&h[10..], want.as_bytes());
        assert_eq!(h.len(), 128);
        for shape in [vec![123456, 26], vec![5, 1], vec![7], vec![0, 13]] {
            assert_eq!(header_bytes(DType::I64, &shape).len(), 128, "{shape:?}");
        }
    }

    #[test]
    fn every_element_type_reads_as_f64_f32_and_i64() {
        let dir = std::env::temp_dir().join(format!("trainrec-npy-types-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.npy");
        let write = |dtype: DType, big: bool, bytes: Vec<u8>| {
            let mut h = header_bytes(dtype, &[2]);
            if big {
                let at = h.windows(3).position(|w| w == format!("<{}", dtype.code()).as_bytes()).unwrap();
                h[at] = b'>';
            }
            std::fs::write(&path, [h, bytes].concat()).unwrap();
            NpyReader::open(&path).unwrap()
        };
        let big_i64 = (1i64 << 60) + 1;
        let cases: Vec<(DType, Vec<u8>, [f64; 2])> = vec![
            (DType::Bool, vec![0, 7], [0.0, 1.0]),
            (DType::I8, vec![0xFF, 5], [-1.0, 5.0]),
            (DType::U8, vec![0xFF, 5], [255.0, 5.0]),
            (DType::I16, [(-300i16).to_le_bytes(), 2i16.to_le_bytes()].concat(), [-300.0, 2.0]),
            (DType::U16, [60000u16.to_le_bytes(), 2u16.to_le_bytes()].concat(), [60000.0, 2.0]),
            (DType::I32, [i32::MIN.to_le_bytes(), 2i32.to_le_bytes()].concat(), [i32::MIN as f64, 2.0]),
            (DType::U32, [u32::MAX.to_le_bytes(), 2u32.to_le_bytes()].concat(), [u32::MAX as f64, 2.0]),
            (DType::I64, [big_i64.to_le_bytes(), (-2i64).to_le_bytes()].concat(), [big_i64 as f64, -2.0]),
            (DType::U64, [(big_i64 as u64).to_le_bytes(), 2u64.to_le_bytes()].concat(), [big_i64 as f64, 2.0]),
            (DType::F32, [1.5f32.to_le_bytes(), (-0.25f32).to_le_bytes()].concat(), [1.5, -0.25]),
            (DType::F64, [0.1f64.to_le_bytes(), 3.0f64.to_le_bytes()].concat(), [0.1, 3.0]),
        ];
        for (dtype, bytes, want) in cases {
            let mut r = write(dtype, false, bytes);
            let (mut f64s, mut f32s, mut i64s) = (Vec::new(), Vec::new(), Vec::new());
            r.read_f64(0, 2, &mut f64s).unwrap();
            r.read_f32(0, 2, &mut f32s).unwrap();
            assert_eq!(f64s, want, "{dtype:?}");
            assert_eq!(f32s, want.map(|v| v as f32), "{dtype:?}");
            if dtype.is_float() {
                assert!(r.read_i64(0, 2, &mut i64s).unwrap_err().to_string().contains("expected integers"));
            } else {
                r.read_i64(0, 2, &mut i64s).unwrap();
                let exact = if matches!(dtype, DType::I64 | DType::U64) {
                    vec![big_i64, want[1] as i64]
                } else {
                    want.map(|v| v as i64).to_vec()
                };
                assert_eq!(i64s, exact, "{dtype:?}");
            }
        }
        let mut r = write(DType::U64, false, [u64::MAX.to_le_bytes(), 1u64.to_le_bytes()].concat());
        let err = r.read_i64(0, 2, &mut Vec::new()).unwrap_err().to_string();
        assert!(err.ends_with(&format!("value {} does not fit in i64", u64::MAX)), "{err}");
        let mut r = write(DType::I16, true, [(-300i16).to_be_bytes(), 2i16.to_be_bytes()].concat());
        let mut f64s = Vec::new();
        r.read_f64(0, 2, &mut f64s).unwrap();
        assert_eq!(f64s, [-300.0, 2.0]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn round_trips_and_rejects_bad_headers() {
        let dir = std::env::temp_dir().join(format!("trainrec-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.npy");
        let mut bytes = header_bytes(DType::I32, &[3, 2]);
        for v in [1i32, -2, 3, 4, i32::MAX, i32::MIN] {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let mut r = NpyReader::open(&path).unwrap();
        assert_eq!(r.header.shape, vec![3, 2]);
        let mut out = Vec::new();
        r.read_i64(1, 2, &mut out).unwrap();
        assert_eq!(out, vec![3, 4, i32::MAX as i64, i32::MIN as i64]);
        let mut f = Vec::new();
        r.read_f32(0, 1, &mut f).unwrap();
        assert_eq!(f, vec![1.0, -2.0]);
        assert!(r.read_i64(2, 2, &mut out).unwrap_err().to_string().contains("out of range"));

        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(read_header(&path).unwrap_err().to_string().contains("truncated"));
        std::fs::write(&path, b"hello world").unwrap();
        assert!(read_header(&path).unwrap_err().to_string().contains("magic"));
        let replace = |bytes: Vec<u8>, from: &[u8], to: &[u8]| {
            let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
            [&bytes[..at], to, &bytes[at + from.len()..]].concat()
        };
        let mut fortran = replace(header_bytes(DType::I32, &[1, 1]), b"False", b"True ");
        fortran.extend_from_slice(&[0; 4]);
        std::fs::write(&path, &fortran).unwrap();
        assert!(read_header(&path).unwrap_err().to_string().contains("Fortran"));
        let mut be = replace(header_bytes(DType::I32, &[1]), b"<i4", b">i4");
        be.extend_from_slice(&7i32.to_be_bytes());
        std::fs::write(&path, &be).unwrap();
        let mut r = NpyReader::open(&path).unwrap();
        r.read_i64(0, 1, &mut out).unwrap();
        assert_eq!(out, vec![7]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
