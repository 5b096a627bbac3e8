//! Training data: token windows cut from text files (with a held-out split), or sampled from a
//! teacher when there is no corpus, and the seeded order in which a run visits them.

use std::path::Path;

use frugal::kv::KvSequence;
use frugal::model::{Logits, Model, Scratch};
use frugal::sample::{Sampler, SamplerParams};
use frugal::tokenizer::Tokenizer;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TrainError, io_err};

/// Windows of `seq + 1` tokens: a window's first `seq` are the inputs, its last `seq` the labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Windows {
    pub seq: usize,
    pub tokens: Vec<u32>,
}

impl Windows {
    pub fn len(&self) -> usize {
        self.tokens.len() / (self.seq + 1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> &[u32] {
        &self.tokens[i * (self.seq + 1)..(i + 1) * (self.seq + 1)]
    }

    /// The first `n` windows (all, if there are fewer): calibration text.
    pub fn first(&self, n: usize) -> Windows {
        let n = n.min(self.len());
        Windows {
            seq: self.seq,
            tokens: self.tokens[..n * (self.seq + 1)].to_vec(),
        }
    }

    /// The same windows, each starting with `start` in place of its first token (which is the
    /// previous window's last label, so no label is lost), as llama.cpp's perplexity starts
    /// each chunk: a model whose tokenizer adds a beginning-of-text token (Gemma) is trained
    /// on windows as it is evaluated and run, each opening with that token; without it such a
    /// model's first positions have no attention sink, and training on them teaches the
    /// model another function than the one evaluated. `None` leaves the windows as they are.
    pub fn starting_with(mut self, start: Option<u32>) -> Windows {
        if let Some(b) = start {
            for w in self.tokens.chunks_exact_mut(self.seq + 1) {
                w[0] = b;
            }
        }
        self
    }

    fn push(&mut self, w: &[u32]) {
        debug_assert_eq!(w.len(), self.seq + 1);
        self.tokens.extend_from_slice(w);
    }
}

/// A corpus split into training and held-out windows.
#[derive(Clone, Debug, Default)]
pub struct Corpus {
    pub train: Windows,
    pub heldout: Windows,
}

/// Cuts a token stream into windows of `seq + 1` with stride `seq` (consecutive windows share one
/// token, so every token but the first is a label exactly once).
pub fn windows_of(stream: &[u32], seq: usize) -> Windows {
    let mut w = Windows {
        seq,
        tokens: Vec::new(),
    };
    let mut i = 0;
    while i + seq < stream.len() {
        w.push(&stream[i..i + seq + 1]);
        i += seq;
    }
    w
}

/// The token every window starts with for a model of this tokenizer: its beginning-of-text
/// token when it adds one to a text (`tokenizer.ggml.add_bos_token`), else none.
pub fn window_start(tok: &Tokenizer) -> Option<u32> {
    if tok.add_bos { tok.bos } else { None }
}

/// Tokenizes text files into one stream (each file ends with the end-of-text token), cuts it
/// into windows (each starting as [`window_start`] says), and holds out the last `heldout`
/// fraction of them (at least one).
pub fn corpus_from_files(
    tok: &Tokenizer,
    files: &[impl AsRef<Path>],
    seq: usize,
    heldout: f64,
) -> Result<Corpus> {
    let mut stream = Vec::new();
    for f in files {
        let f = f.as_ref();
        let text = std::fs::read_to_string(f).map_err(io_err(f))?;
        stream.extend(tok.encode(&text, false)?);
        stream.extend(tok.eos);
    }
    split(
        windows_of(&stream, seq).starting_with(window_start(tok)),
        heldout,
        &format!("{} file(s)", files.len()),
    )
}

/// Splits windows into training and held-out ones: the last `frac` of them (at least one) are
/// held out, so the two never share text.
pub fn split(all: Windows, frac: f64, what: &str) -> Result<Corpus> {
    let n = all.len();
    if n < 2 {
        return Err(TrainError::Invalid(format!(
            "{what} give {n} window(s) of {} tokens; at least 2 are needed (one to train on, one held out)",
            all.seq + 1
        )));
    }
    let h = ((n as f64 * frac).ceil() as usize).clamp(1, n - 1);
    let cut = (n - h) * (all.seq + 1);
    Ok(Corpus {
        heldout: Windows {
            seq: all.seq,
            tokens: all.tokens[cut..].to_vec(),
        },
        train: Windows {
            seq: all.seq,
            tokens: all.tokens[..cut].to_vec(),
        },
    })
}

/// Sequence-level distillation data: `n` windows sampled from the teacher at temperature 1,
/// each starting from the beginning-of-text token, seeded. Generation that ends early (an
/// end-of-text token) starts again from the beginning-of-text token inside the window, as
/// documents follow one another in a corpus.
pub fn teacher_samples(
    teacher: &Model,
    tok: &Tokenizer,
    n: usize,
    seq: usize,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<Windows> {
    let start = tok.bos.or(tok.eos).unwrap_or(0);
    let mut sampler = Sampler::new(SamplerParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed,
        ..SamplerParams::default()
    });
    let mut out = Windows {
        seq,
        tokens: Vec::with_capacity(n * (seq + 1)),
    };
    let mut kv = teacher.new_cache(seq + 1)?;
    let mut scratch = Scratch::default();
    let mut window = Vec::with_capacity(seq + 1);
    for i in 0..n {
        window.clear();
        window.push(start);
        kv.clear();
        while window.len() <= seq {
            let last = *window.last().unwrap_or(&start);
            if window.len() > 1 && tok.is_end_of_generation(last) {
                // A new document: the next token starts from a fresh context.
                kv.clear();
            }
            let logits = teacher.forward(
                &[last],
                &mut kv as &mut dyn KvSequence,
                &mut scratch,
                Logits::Last,
            )?;
            let next = sampler.sample(logits, &[]);
            window.push(next);
        }
        out.push(&window);
        progress(i + 1, n);
    }
    Ok(out)
}

/// The order in which a run visits its training windows: a fresh seeded permutation per epoch,
/// a pure function of (seed, position), so a resumed run sees exactly the windows it would have.
#[derive(Clone, Debug)]
pub struct Order {
    seed: u64,
    n: usize,
    epoch: usize,
    perm: Vec<usize>,
}

impl Order {
    pub fn new(seed: u64, n: usize) -> Self {
        let mut o = Order {
            seed,
            n,
            epoch: usize::MAX,
            perm: Vec::new(),
        };
        o.shuffle(0);
        o
    }

    fn shuffle(&mut self, epoch: usize) {
        self.perm = (0..self.n).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(
            self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        self.perm.shuffle(&mut rng);
        self.epoch = epoch;
    }

    /// The window visited at position `i` of the run (`i` counts sequences from the start).
    pub fn window(&mut self, i: usize) -> usize {
        let epoch = i / self.n;
        if epoch != self.epoch {
            self.shuffle(epoch);
        }
        self.perm[i % self.n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_share_one_token_and_split_without_overlap() {
        let stream: Vec<u32> = (0..23).collect();
        let w = windows_of(&stream, 5);
        let b = w.clone().starting_with(Some(99));
        assert_eq!(b.len(), w.len());
        for i in 0..w.len() {
            assert_eq!(b.get(i)[0], 99);
            assert_eq!(b.get(i)[1..], w.get(i)[1..]);
        }
        assert_eq!(w.clone().starting_with(None), w);
        assert_eq!(w.len(), 4);
        assert_eq!(w.get(1), &[5, 6, 7, 8, 9, 10]);
        let c = split(w, 0.3, "test").unwrap();
        assert_eq!((c.train.len(), c.heldout.len()), (2, 2));
        assert_eq!(c.heldout.get(0)[0], 10);
        assert!(split(windows_of(&stream[..7], 5), 0.5, "short").is_err());
    }

    #[test]
    fn order_is_a_permutation_per_epoch_and_reproducible() {
        let mut a = Order::new(7, 10);
        let first: Vec<usize> = (0..10).map(|i| a.window(i)).collect();
        let mut s = first.clone();
        s.sort();
        assert_eq!(s, (0..10).collect::<Vec<_>>());
        let second: Vec<usize> = (10..20).map(|i| a.window(i)).collect();
        assert_ne!(first, second);
        let mut b = Order::new(7, 10);
        assert_eq!(b.window(13), second[3]);
        assert_eq!(b.window(2), first[2]);
    }
}
