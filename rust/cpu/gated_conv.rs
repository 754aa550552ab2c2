//! LFM2's gated short convolution in the CPU step: the twin of
//! `python/guided/model/short_conv.py`, which says why its cache is per token.
//!
//! The decoder's in_proj gives each row B, C and x. B·x goes into the row's
//! slot of the layer's cache ([blocks, block_size, hidden]); the row's output
//! is C · Σ_j w_j · (B·x at position p − kernel + 1 + j), the earlier positions
//! read through the sequence's block table (zero before its first token), so a
//! row reads the same values alone, in a batch, after a chunk or a cache hit.
//! The decoder's out_proj follows.

/// The convolution's weights.
#[derive(Clone)]
pub struct ShortConv {
    /// [hidden, kernel]: per channel, the taps oldest first (the last on the row's own position)
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// Where a step's rows read and write their B·x.
pub struct ConvRows<'a> {
    pub slots: &'a [i64],
    /// [sequences, max_blocks]
    pub tables: &'a [i32],
    pub max_blocks: usize,
    pub block_size: usize,
    pub seq: &'a [i32],
    pub pos: &'a [i32],
}

impl ShortConv {
    pub fn check(&self, hidden: usize) -> Result<(), String> {
        if self.weight.is_empty() || !self.weight.len().is_multiple_of(hidden) {
            return Err(format!("a convolution of {} values is not [{hidden}, kernel]", self.weight.len()));
        }
        match &self.bias {
            Some(b) if b.len() != hidden => Err(format!("a convolution bias of {} values, not {hidden}", b.len())),
            _ => Ok(()),
        }
    }

    /// `bcx` [t, 3·hidden] → `out` [t, hidden]. Every row's B·x is written to `cache`
    /// first, so a row reads the rows before it in the same step.
    pub fn mix(&self, bcx: &[f32], rows: &ConvRows, cache: &mut [f32], out: &mut [f32]) {
        let hidden = out.len() / rows.slots.len().max(1);
        let kernel = self.weight.len() / hidden;
        for (r, part) in bcx.chunks_exact(3 * hidden).enumerate() {
            let (b, x) = (&part[..hidden], &part[2 * hidden..]);
            let slot = rows.slots[r] as usize;
            cache[slot * hidden..][..hidden].iter_mut().zip(b.iter().zip(x)).for_each(|(c, (b, x))| *c = b * x);
        }
        for (r, (part, o)) in bcx.chunks_exact(3 * hidden).zip(out.chunks_exact_mut(hidden)).enumerate() {
            match &self.bias {
                Some(bias) => o.copy_from_slice(bias),
                None => o.fill(0.0),
            }
            let (p, table) = (rows.pos[r] as usize, &rows.tables[rows.seq[r] as usize * rows.max_blocks..]);
            for j in 0..kernel {
                let Some(at) = (p + j + 1).checked_sub(kernel) else { continue };
                let slot = table[at / rows.block_size] as usize * rows.block_size + at % rows.block_size;
                let bx = &cache[slot * hidden..][..hidden];
                for (c, (o, v)) in o.iter_mut().zip(bx).enumerate() {
                    *o += self.weight[c * kernel + j] * v;
                }
            }
            o.iter_mut().zip(&part[hidden..2 * hidden]).for_each(|(o, c)| *o *= c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// hidden 2, kernel 3; a sequence of three tokens in blocks [1, 0] of 2 slots, in steps cut at `cuts`
    fn run(cuts: &[usize]) -> Vec<f32> {
        let conv = ShortConv { weight: vec![0.5, -1.0, 2.0, 1.0, 3.0, -0.5], bias: Some(vec![0.25, 0.0]) };
        conv.check(2).unwrap();
        // per token: B (2), C (2), x (2)
        let bcx: Vec<f32> = (0..3).flat_map(|t| [1.0 + t as f32, 2.0, 1.0, -1.0, 3.0, 0.5 * t as f32]).collect();
        let (slots, pos, tables) = ([2i64, 3, 0], [0i32, 1, 2], [1i32, 0]);
        let mut cache = vec![0f32; 4 * 2];
        let mut out = vec![0f32; 3 * 2];
        for r in cuts.windows(2).map(|w| w[0]..w[1]) {
            let rows = ConvRows { slots: &slots[r.clone()], tables: &tables, max_blocks: 2, block_size: 2, seq: &vec![0; r.len()], pos: &pos[r.clone()] };
            conv.mix(&bcx[r.start * 6..r.end * 6], &rows, &mut cache, &mut out[r.start * 2..r.end * 2]);
        }
        out
    }

    #[test]
    fn a_row_convolves_its_own_and_the_earlier_tokens_however_the_steps_cut_them() {
        // B·x per token: [3, 0], [6, 1], [9, 2]; channel c's taps weight[c*3..][..3], oldest first
        let bx = [[3.0, 0.0], [6.0, 1.0], [9.0, 2.0]];
        let (w, bias, c) = ([[0.5, -1.0, 2.0], [1.0, 3.0, -0.5]], [0.25, 0.0], [1.0, -1.0]);
        let want: Vec<f32> = (0..3)
            .flat_map(|t| (0..2).map(move |ch| (bias[ch] + (0..3).filter(|j| t + j >= 2).map(|j| w[ch][j] * bx[t + j - 2][ch]).sum::<f32>()) * c[ch]))
            .collect();
        assert_eq!(run(&[0, 3]), want);
        assert_eq!(run(&[0, 1, 3]), want);
        assert_eq!(run(&[0, 2, 3]), want);
    }
}
