//! The validating GGUF reader.

use std::collections::HashMap;
use std::path::Path;

use super::{
    Array, DEFAULT_ALIGNMENT, GgufError, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, Result, Value, ValueType,
};
use crate::quant::GgmlType;

/// Where a tensor lives and what it holds. `dims[0]` is the innermost (row) dimension, as in ggml.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the tensor's bytes from the start of the data section.
    pub offset: u64,
    /// Byte offset of this tensor's info record in the file (for error messages).
    pub info_offset: u64,
}

impl TensorInfo {
    /// Number of elements (validated against overflow when the file was read).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of tensor data (validated when the file was read).
    pub fn n_bytes(&self) -> u64 {
        self.ty.bytes_for(self.n_elements()).unwrap_or(0)
    }

    /// Row length (innermost dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }

    /// Number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A file's image, shared: what a matrix keeps to read its stored bytes after the borrow of the
/// [`GgufFile`] that loaded it ends.
#[derive(Clone)]
pub struct SharedBytes(std::sync::Arc<Bytes>);

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.0.as_slice().len())
    }
}

impl SharedBytes {
    pub fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    /// Tells the kernel the mapped pages of `range` are not needed now (they were copied
    /// elsewhere), so they stop counting toward resident memory; reading them again simply
    /// faults them back in from the file. No-op for in-memory images.
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let Bytes::Mapped(m) = &*self.0 {
            let page = 4096;
            let start = range.start.div_ceil(page) * page;
            let end = range.end / page * page;
            if end > start {
                // SAFETY: the map is read-only and file-backed, so dropped pages are re-read from
                // the file on the next access; no data is lost.
                let _ = unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
                };
            }
        }
    }
}

/// An opened, fully validated GGUF file. Tensor data stays in the memory map and is borrowed.
pub struct GgufFile {
    bytes: SharedBytes,
    pub version: u32,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let available = self.remaining() as u64;
        if n > available {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset: start,
        })
    }

    /// Checks that `count` items of at least `min_len` bytes each can fit in what is left, so
    /// that a corrupted count never drives an allocation.
    fn check_count(&self, count: u64, min_len: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let available = self.remaining() as u64;
        match count.checked_mul(min_len as u64) {
            Some(needed) if needed <= available => Ok(count as usize),
            needed => Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: needed.unwrap_or(u64::MAX),
                available,
            }),
        }
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => {
                let at = self.pos as u64;
                match self.array::<1>(&what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(GgufError::BadValue {
                            key: key.to_string(),
                            reason: format!("bool byte {b} at byte {at} is neither 0 nor 1"),
                        });
                    }
                }
            }
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                let at = self.pos as u64;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep {
                        key: key.to_string(),
                        offset: at,
                    });
                }
                Value::Array(self.array_value(key, depth)?)
            }
        })
    }

    /// An array's element type, count and elements, read into a vector of that type (the count
    /// checked against the bytes left before anything is allocated).
    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array> {
        let what = || format!("value of metadata key {key:?}");
        let at = self.pos as u64;
        let type_id = self.u32(&what)?;
        let elem = ValueType::from_id(type_id).ok_or(GgufError::UnknownValueType {
            key: key.to_string(),
            type_id,
            offset: at,
        })?;
        let count = self.u64(&what)?;
        let n = self.check_count(count, elem.min_encoded_len(), &what)?;
        fn fixed<T, const N: usize>(
            c: &mut Cursor,
            n: usize,
            what: &dyn Fn() -> String,
            f: fn([u8; N]) -> T,
        ) -> Result<Vec<T>> {
            (0..n).map(|_| c.array::<N>(what).map(f)).collect()
        }
        Ok(match elem {
            ValueType::U8 => Array::U8(fixed(self, n, &what, |b: [u8; 1]| b[0])?),
            ValueType::I8 => Array::I8(fixed(self, n, &what, |b: [u8; 1]| b[0] as i8)?),
            ValueType::U16 => Array::U16(fixed(self, n, &what, u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(fixed(self, n, &what, i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(fixed(self, n, &what, u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(fixed(self, n, &what, i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(fixed(self, n, &what, f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(fixed(self, n, &what, u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(fixed(self, n, &what, i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(fixed(self, n, &what, f64::from_le_bytes)?),
            ValueType::Bool => Array::Bool(
                (0..n)
                    .map(|_| match self.value(ValueType::Bool, key, depth + 1)? {
                        Value::Bool(b) => Ok(b),
                        _ => unreachable!("a bool value"),
                    })
                    .collect::<Result<_>>()?,
            ),
            ValueType::String => {
                Array::String((0..n).map(|_| self.string(&what)).collect::<Result<_>>()?)
            }
            ValueType::Array => {
                if depth + 1 >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep {
                        key: key.to_string(),
                        offset: self.pos as u64,
                    });
                }
                Array::Array(
                    (0..n)
                        .map(|_| self.array_value(key, depth + 1))
                        .collect::<Result<_>>()?,
                )
            }
        })
    }
}

/// The file at `path`, memory-mapped read-only.
fn map(path: &Path) -> Result<Bytes> {
    let io = |source| GgufError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only; frugal never writes to model files while they are open.
    // Like every mmap reader, we rely on no other process truncating the file underneath us.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok(Bytes::Mapped(map))
}

impl GgufFile {
    /// Memory-maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::parse(map(path.as_ref())?, false)
    }

    /// Opens only the header and metadata of `path`, with no tensors: what a tokenizer needs.
    /// The file may hold no tensor data at all (llama.cpp's vocab-only files) or be cut off
    /// inside it (the first part of a split download).
    pub fn open_metadata(path: impl AsRef<Path>) -> Result<Self> {
        Self::parse(map(path.as_ref())?, true)
    }

    /// Parses a GGUF image held in memory (used by tests and by tools that build files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Bytes::Owned(bytes), false)
    }

    /// Parses the image; with `metadata_only` it stops after the metadata (no tensors).
    fn parse(bytes: Bytes, metadata_only: bool) -> Result<Self> {
        let buf = bytes.as_slice();
        let mut c = Cursor { buf, pos: 0 };
        let magic = c
            .take(4, &|| "magic".into())
            .map_err(|_| GgufError::BadMagic {
                found: buf[..buf.len().min(4)].to_vec(),
            })?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = c.u32(&|| "version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = c.u64(&|| "tensor count".into())?;
        let n_kv = c.u64(&|| "metadata count".into())?;
        // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes.
        let n_kv = c.check_count(n_kv, 13, &|| "metadata key/values".into())?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            let at = c.pos as u64;
            let key = c.string(&|| format!("key of metadata entry {i}"))?;
            let type_at = c.pos as u64;
            let type_id = c.u32(&|| format!("type of metadata key {key:?}"))?;
            let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                type_id,
                offset: type_at,
            })?;
            let value = c.value(ty, &key, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { key, offset: at });
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.get(
            index
                .get("general.alignment")
                .copied()
                .unwrap_or(usize::MAX),
        ) {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v.as_int() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 20 => a as u64,
                _ => {
                    return Err(GgufError::BadValue {
                        key: "general.alignment".into(),
                        reason: format!("{v} is not a power of two integer up to 1 MiB"),
                    });
                }
            },
        };

        if metadata_only {
            let data_offset = c.pos as u64;
            return Ok(GgufFile {
                bytes: SharedBytes(std::sync::Arc::new(bytes)),
                version,
                metadata,
                index,
                tensors: Vec::new(),
                tensor_index: HashMap::new(),
                alignment,
                data_offset,
            });
        }
        // Each tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
        let n_tensors = c.check_count(n_tensors, 24, &|| "tensor infos".into())?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info_offset = c.pos as u64;
            let name = c.string(&|| format!("name of tensor {i}"))?;
            let what = || format!("info of tensor {name:?}");
            let bad = |reason: String| GgufError::BadTensor {
                tensor: name.clone(),
                offset: info_offset,
                reason,
            };
            let n_dims = c.u32(&what)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad(format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let type_at = c.pos as u64;
            let type_id = c.u32(&what)?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                tensor: name.clone(),
                type_id,
                offset: type_at,
            })?;
            let offset = c.u64(&what)?;
            if dims.contains(&0) {
                return Err(bad(format!("zero-sized dimension in {dims:?}")));
            }
            let n = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            if dims[0] % ty.block_size() as u64 != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {} block size {}",
                    dims[0],
                    ty,
                    ty.block_size()
                )));
            }
            ty.bytes_for(n)
                .ok_or_else(|| bad(format!("byte size of {n} {ty} elements overflows")))?;
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "data offset {offset} is not aligned to {alignment}"
                )));
            }
            let info = TensorInfo {
                name: name.clone(),
                dims,
                ty,
                offset,
                info_offset,
            };
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor {
                    tensor: name,
                    offset: info_offset,
                });
            }
            tensors.push(info);
        }

        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = buf.len() as u64;
        if n_tensors > 0 && data_offset > file_len {
            return Err(GgufError::Truncated {
                what: "padding before the tensor data".into(),
                offset: c.pos as u64,
                needed: data_offset - c.pos as u64,
                available: file_len - c.pos as u64,
            });
        }
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes()));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(GgufError::Truncated {
                        what: format!("data of tensor {:?}", t.name),
                        offset: data_offset.saturating_add(t.offset),
                        needed: t.n_bytes(),
                        available: file_len.saturating_sub(data_offset.saturating_add(t.offset)),
                    });
                }
            }
        }

        Ok(GgufFile {
            bytes: SharedBytes(std::sync::Arc::new(bytes)),
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The whole file image (tensor ranges inside it were validated at open).
    pub fn raw_bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// See [`SharedBytes::release`].
    pub fn release(&self, range: std::ops::Range<usize>) {
        self.bytes.release(range);
    }

    /// The file image, shared (see [`SharedBytes`]).
    pub fn shared_bytes(&self) -> SharedBytes {
        self.bytes.clone()
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }

    fn type_error(key: &str, expected: &str, v: &Value) -> GgufError {
        GgufError::BadValue {
            key: key.into(),
            reason: format!("expected {expected}, found {:?}", v.value_type()),
        }
    }

    /// An integer value that fits in u32 (any integer type is accepted).
    pub fn u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_int()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| Self::type_error(key, "an integer in u32 range", v))
    }

    pub fn u32_opt(&self, key: &str) -> Result<Option<u32>> {
        if self.get(key).is_some() {
            self.u32(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| Self::type_error(key, "a number", v))
    }

    pub fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        if self.get(key).is_some() {
            self.f32(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Self::type_error(key, "a bool", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str()
            .ok_or_else(|| Self::type_error(key, "a string", v))
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        if self.get(key).is_some() {
            self.str(key).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn array(&self, key: &str) -> Result<&Array> {
        let v = self.require(key)?;
        v.as_array()
            .ok_or_else(|| Self::type_error(key, "an array", v))
    }

    /// An array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(Array::strings)
            .map(|s| s.iter().map(String::as_str).collect())
            .ok_or_else(|| Self::type_error(key, "an array of strings", v))
    }

    /// An array of integers that fit in i32.
    pub fn i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.array(key)?
            .values()
            .map(|v| {
                v.as_int()
                    .and_then(|i| i32::try_from(i).ok())
                    .ok_or_else(|| Self::type_error(key, "an array of i32", &v))
            })
            .collect()
    }

    /// An array of numbers, as f32 (SentencePiece scores).
    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.array(key)?
            .values()
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| Self::type_error(key, "an array of numbers", &v))
            })
            .collect()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (bounds were validated at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.bytes.as_slice()[start..start + info.n_bytes() as usize]
    }

    /// Looks a tensor up by name and returns its info and bytes.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor {
                tensor: name.into(),
            })?;
        Ok((info, self.tensor_bytes(info)))
    }
}
