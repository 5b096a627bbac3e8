//! Checkpoints: the parameters, hidden-state projections, AdamW's moments, the step and the
//! run's configuration, in one GGUF file written atomically (a temporary file renamed over the
//! old one, so an interruption leaves the last good checkpoint intact). The data order is a
//! pure function of the seed and the position, so a resumed run continues exactly where the
//! interrupted one was: its parameters equal an uninterrupted run's, bit for bit.

use std::borrow::Cow;
use std::path::Path;

use frugal::gguf::{GgufFile, GgufWriter, TensorData, Value};
use frugal::quant::{self, GgmlType};

use crate::error::{Result, TrainError, io_err};
use crate::params::{Tensor, f32_bytes};
use crate::trainer::Trainer;

const VERSION: u32 = 1;

fn config_json(t: &Trainer) -> String {
    serde_json::to_string(&t.cfg).unwrap_or_default()
}

/// Writes `t`'s state to `path`.
pub fn save(t: &Trainer, path: &Path) -> Result<()> {
    let mut w = GgufWriter::new();
    w.set(
        "general.architecture",
        Value::String("frugal-checkpoint".into()),
    );
    w.set("frugal.checkpoint.version", Value::U32(VERSION));
    w.set("frugal.checkpoint.step", Value::U64(t.step as u64));
    w.set("frugal.checkpoint.adam_t", Value::U64(t.opt.t));
    w.set("frugal.checkpoint.config", Value::String(config_json(t)));
    let model = serde_json::to_string(&t.params.config).unwrap_or_default();
    w.set("frugal.checkpoint.model", Value::String(model));
    let push = |w: &mut GgufWriter<'_>, name: String, dims: Vec<u64>, data: &'_ [f32]| {
        w.tensors.push(TensorData {
            name,
            dims,
            ty: GgmlType::F32,
            data: Cow::Owned(f32_bytes(data).to_vec()),
        });
    };
    let tensors: Vec<&Tensor> = t
        .params
        .tensors()
        .into_iter()
        .chain(t.projectors.iter().flatten())
        .collect();
    for (i, (x, m)) in tensors.iter().zip(&t.opt.moments).enumerate() {
        push(&mut w, x.name.clone(), x.dims(), &x.data);
        push(&mut w, format!("adam.m.{i}"), x.dims(), &m.m);
        push(&mut w, format!("adam.v.{i}"), x.dims(), &m.v);
    }
    let tmp = path.with_extension("tmp");
    w.write_file(&tmp)?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// The peak learning rate a checkpoint's run was configured with (a probed run's choice).
pub fn saved_learning_rate(path: &Path) -> Result<f32> {
    let f = GgufFile::open(path)?;
    let cfg: serde_json::Value = serde_json::from_str(f.str("frugal.checkpoint.config")?)
        .map_err(|e| TrainError::Invalid(format!("{}: its configuration: {e}", path.display())))?;
    cfg.pointer("/schedule/lr")
        .and_then(serde_json::Value::as_f64)
        .map(|lr| lr as f32)
        .ok_or_else(|| {
            TrainError::Invalid(format!(
                "{}: the checkpoint holds no learning rate",
                path.display()
            ))
        })
}

/// Restores `t`'s state from `path`, refusing a checkpoint of another model or configuration.
pub fn resume(t: &mut Trainer, path: &Path) -> Result<()> {
    let f = GgufFile::open(path)?;
    let bad =
        |why: String| TrainError::Invalid(format!("{}: cannot resume: {why}", path.display()));
    if f.u32("frugal.checkpoint.version").ok() != Some(VERSION) {
        return Err(bad("not a frugal checkpoint of this version".into()));
    }
    let saved_cfg = f.str("frugal.checkpoint.config")?;
    if saved_cfg != config_json(t) {
        return Err(bad(format!(
            "it was made with another configuration\n  checkpoint: {saved_cfg}\n  this run:   {}",
            config_json(t)
        )));
    }
    let saved_model = f.str("frugal.checkpoint.model")?;
    if saved_model != serde_json::to_string(&t.params.config).unwrap_or_default() {
        return Err(TrainError::Shape(format!(
            "the checkpoint's model is {saved_model}, this run's student {}",
            serde_json::to_string(&t.params.config).unwrap_or_default()
        )));
    }
    let int = |k: &str| {
        f.get(k)
            .and_then(Value::as_int)
            .map(|v| v as u64)
            .ok_or_else(|| bad(format!("{k} is missing")))
    };
    let step = int("frugal.checkpoint.step")? as usize;
    let adam_t = int("frugal.checkpoint.adam_t")?;
    let read = |name: &str, out: &mut [f32]| -> Result<()> {
        let (info, bytes) = f.tensor(name)?;
        if info.ty != GgmlType::F32 || info.n_elements() as usize != out.len() {
            return Err(TrainError::Shape(format!(
                "{name} in the checkpoint has {} {} elements, the run {} f32",
                info.n_elements(),
                info.ty,
                out.len()
            )));
        }
        quant::dequantize(GgmlType::F32, bytes, out).map_err(|e| bad(format!("{name}: {e}")))
    };
    let mut tensors: Vec<&mut Tensor> = t
        .params
        .tensors_mut()
        .into_iter()
        .chain(t.projectors.iter_mut().flatten())
        .collect();
    if tensors.len() != t.opt.moments.len() {
        return Err(bad("the optimizer state does not match the tensors".into()));
    }
    for (i, (x, m)) in tensors.iter_mut().zip(t.opt.moments.iter_mut()).enumerate() {
        read(&x.name, &mut x.data)?;
        read(&format!("adam.m.{i}"), &mut m.m)?;
        read(&format!("adam.v.{i}"), &mut m.v)?;
    }
    t.step = step;
    t.opt.t = adam_t;
    Ok(())
}
