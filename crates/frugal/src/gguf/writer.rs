//! The GGUF writer: writes back everything the reader reads (used by tests and by model tools).

use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

use super::{Array, DEFAULT_ALIGNMENT, GgufError, GgufFile, MAGIC, Result, Value};
use crate::quant::GgmlType;

/// A tensor to write: its bytes must already be in the stored format `ty`.
pub struct TensorData<'a> {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: Cow<'a, [u8]>,
}

/// Builds a GGUF file in memory order: metadata, tensor infos, aligned data.
pub struct GgufWriter<'a> {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorData<'a>>,
}

impl Default for GgufWriter<'_> {
    fn default() -> Self {
        GgufWriter {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer holding all metadata and tensors of `file`, borrowing its tensor bytes.
    pub fn from_file(file: &'a GgufFile) -> Self {
        GgufWriter {
            version: file.version,
            metadata: file.metadata().to_vec(),
            tensors: file
                .tensors()
                .iter()
                .map(|t| TensorData {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ty: t.ty,
                    data: Cow::Borrowed(file.tensor_bytes(t)),
                })
                .collect(),
        }
    }

    /// Sets (or replaces) a metadata value.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    fn alignment(&self) -> Result<u64> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v)) => v
                .as_int()
                .filter(|&a| a > 0 && (a as u64).is_power_of_two())
                .map(|a| a as u64)
                .ok_or_else(|| {
                    GgufError::Write(format!("general.alignment {v} is not a power of two"))
                }),
        }
    }

    /// Serializes the whole file.
    pub fn write(&self, out: &mut impl Write) -> Result<()> {
        let io = |e: std::io::Error| GgufError::Write(e.to_string());
        let alignment = self.alignment()?;
        let mut head = Vec::new();
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&self.version.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut head, k);
            head.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let n: u64 = t.dims.iter().product();
            let expected = t.ty.bytes_for(n).ok_or_else(|| {
                GgufError::Write(format!(
                    "tensor {:?}: {n} elements is not a whole number of {} blocks",
                    t.name, t.ty
                ))
            })?;
            if expected != t.data.len() as u64 {
                return Err(GgufError::Write(format!(
                    "tensor {:?}: {} bytes given, {} expected for {:?} {}",
                    t.name,
                    t.data.len(),
                    expected,
                    t.dims,
                    t.ty
                )));
            }
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + expected).div_ceil(alignment) * alignment;
        }
        pad(&mut head, alignment);
        out.write_all(&head).map_err(io)?;
        let mut written = 0u64;
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            let zeros = vec![0u8; (off - written) as usize];
            out.write_all(&zeros).map_err(io)?;
            out.write_all(&t.data).map_err(io)?;
            written = off + t.data.len() as u64;
        }
        Ok(())
    }

    /// Writes to `path` through a temporary file in the same folder, renamed into place, so a
    /// failure never leaves a half-written model behind.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |e: std::io::Error| GgufError::Write(format!("{}: {e}", path.display()));
        let tmp = path.with_extension("gguf.partial");
        {
            let f = std::fs::File::create(&tmp).map_err(io)?;
            let mut w = std::io::BufWriter::new(f);
            self.write(&mut w)?;
            w.flush().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        self.write(&mut v)?;
        Ok(v)
    }
}

fn pad(buf: &mut Vec<u8>, alignment: u64) {
    let len = buf.len() as u64;
    let target = len.div_ceil(alignment) * alignment;
    buf.resize(target as usize, 0);
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::String(s) => put_string(buf, s),
        Value::Array(items) => put_array(buf, items),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

/// An array: element type, count, then the elements packed as the format stores them.
fn put_array(buf: &mut Vec<u8>, a: &Array) {
    buf.extend_from_slice(&(a.elem_type() as u32).to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => buf.extend(v.iter().map(|&x| x as u8)),
        Array::U16(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::I16(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::U32(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::I32(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::F32(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::Bool(v) => buf.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(buf, s)),
        Array::Array(v) => v.iter().for_each(|x| put_array(buf, x)),
        Array::U64(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::I64(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
        Array::F64(v) => v
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> GgufWriter<'static> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("llama".into()));
        w.set("u8", Value::U8(7));
        w.set("i8", Value::I8(-7));
        w.set("u16", Value::U16(700));
        w.set("i16", Value::I16(-700));
        w.set("u32", Value::U32(70000));
        w.set("i32", Value::I32(-70000));
        w.set("f32", Value::F32(1.5));
        w.set("bool", Value::Bool(true));
        w.set("u64", Value::U64(1 << 40));
        w.set("i64", Value::I64(-(1 << 40)));
        w.set("f64", Value::F64(-2.25));
        w.set("empty", Value::Array(Array::F32(vec![])));
        w.set(
            "nested",
            Value::Array(Array::Array(vec![
                Array::String(vec!["a".into()]),
                Array::I32(vec![1, -2]),
                Array::Bool(vec![true, false]),
                Array::U8(vec![0, 255]),
            ])),
        );
        w.tensors.push(TensorData {
            name: "a".into(),
            dims: vec![3, 2],
            ty: GgmlType::F32,
            data: Cow::Owned((0..24).collect()),
        });
        w.tensors.push(TensorData {
            name: "b".into(),
            dims: vec![32],
            ty: GgmlType::Q8_0,
            data: Cow::Owned(vec![9; 34]),
        });
        w
    }

    #[test]
    fn round_trip_is_byte_identical() {
        let bytes = sample().to_bytes().unwrap();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        assert_eq!(f.metadata(), sample().metadata.as_slice());
        assert_eq!(f.tensors().len(), 2);
        assert_eq!(
            f.tensor("a").unwrap().1,
            (0..24).collect::<Vec<u8>>().as_slice()
        );
        assert_eq!(f.tensor("b").unwrap().1, &[9u8; 34][..]);
        assert_eq!(f.tensor_info("b").unwrap().offset % 32, 0);
        assert_eq!(f.u32("u16").unwrap(), 700);
        assert!(
            f.u32("i32").is_err(),
            "negative values do not convert to u32"
        );
        assert_eq!(f.str("general.architecture").unwrap(), "llama");
        let again = GgufWriter::from_file(&f).to_bytes().unwrap();
        assert_eq!(again, bytes);
    }

    #[test]
    fn writer_rejects_wrong_sizes() {
        let mut w = sample();
        w.tensors[1].data = Cow::Owned(vec![0; 33]);
        assert!(matches!(w.to_bytes(), Err(GgufError::Write(_))));
    }
}
