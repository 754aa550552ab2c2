//! Speculative decoding with drafts the grammar chooses, checked in one
//! forward pass.
//!
//! A running sequence may carry a draft into a step: tokens guessed to come
//! next, fed to the model after its real ones, so that one forward pass
//! gives a row of logits after each of them (and one after the last real
//! token). The draft is model-free (prompt lookup): the latest earlier
//! places where the sequence's last few tokens occurred are candidates, and
//! the grammar picks the first whose next token it allows, token by token;
//! where the grammar then forces tokens (fast-forward), they join the draft
//! as forced ones and the lookup goes on after them.
//!
//! Verification draws each row as a step without a draft would have drawn
//! it (the same mask, penalties, bans and random stream: [`walk`]), and
//! `update()` commits the draws one by one as such steps would have. A
//! draft token is kept while the tokens appended equal it; the first that
//! differs ends the step. So the output is the output without speculation,
//! token for token, greedy or seeded. The sequence's computed count then
//! covers only the tokens kept: the rejected ones' KV is overwritten later
//! and never enters the prefix cache.
//!
//! A draft is as long as its rows are likely to pay for ([`Limits`]): a
//! token goes in while the chance that it and those before it are kept
//! ([`KeepRates`]: learned per length of the match behind it, for the
//! engine and for the sequence) is above a row's cost over what a kept
//! token saves (the scheduler's, from what the caller measures). Rows are
//! dear on a CPU, where the forward pass costs about the same per row at
//! any batch, and cheap on a GPU.

use crate::grammar::matchers::{GrammarMatcher, MAX_FF_ROUNDS};
use crate::sampling::random::Stream;
use crate::sampling::cpu_sampler::{sample_row, Row, Sampled};

/// The longest n-gram looked up (then shorter ones, down to one token).
const MAX_NGRAM: usize = 3;
/// Earlier occurrences tried per n-gram length, latest first.
const CANDIDATES: usize = 8;
/// Matches are measured back this far at most.
const MAX_MATCH: usize = 16;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Drafter {
    /// Prompt lookup, chosen by the grammar.
    #[default]
    Lookup,
    /// Random token ids, unchecked, from this seed: drafts the grammar
    /// mostly refuses and the model never writes, for tests of the
    /// verification alone.
    Random(u64),
}

impl Drafter {
    /// "lookup", or "random:SEED".
    pub fn parse(s: &str) -> Result<Drafter, String> {
        match s.split_once(':') {
            None if s == "lookup" => Ok(Drafter::Lookup),
            Some(("random", seed)) => seed.parse().map(Drafter::Random).map_err(|_| format!("drafter {s:?}: the seed must be an integer")),
            _ => Err(format!("drafter must be \"lookup\" or \"random:SEED\", got {s:?}")),
        }
    }
}

/// Tokens guessed to follow a sequence's last token. `forced[i]`: token i
/// is one the grammar forces after token i - 1 and fast-forward appends
/// without a draw, so no row is drawn before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub forced: Vec<bool>,
    /// Per token, the length of the match it was looked up behind (0: the
    /// grammar forced it).
    pub match_len: Vec<usize>,
    /// Drafted as a probe, though unlikely to pay.
    pub probe: bool,
}

impl Draft {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// How many tokens were looked up (the rest are spans the grammar forces).
    pub fn looked_up(&self) -> usize {
        self.match_len.iter().filter(|&&l| l > 0).count()
    }

    fn push(&mut self, token: u32, forced: bool, match_len: usize) {
        self.tokens.push(token);
        self.forced.push(forced);
        self.match_len.push(match_len);
    }

    /// Cut to at most `n` tokens, never inside a forced span (a row would
    /// then be drawn where fast-forward appends without one).
    pub fn truncate(&mut self, n: usize) {
        let mut n = n.min(self.len());
        while n > 0 && n < self.len() && self.forced[n] {
            n -= 1;
        }
        self.tokens.truncate(n);
        self.forced.truncate(n);
        self.match_len.truncate(n);
    }

    /// The rows a verification may draw: after the last real token and
    /// after each draft token but those followed by a forced one.
    pub fn drawn_rows(&self) -> Vec<bool> {
        (0..=self.len()).map(|r| r == self.len() || !self.forced[r]).collect()
    }
}

/// How often a looked-up draft token is kept, by the length of the match
/// behind it (how many of the sequence's last tokens agree with the text
/// before the place it was looked up): a long match means the model is
/// copying, and goes on doing so. Counts of the whole engine, older ones
/// weighing less, from a prior that trusts long matches more.
#[derive(Debug, Clone, PartialEq)]
pub struct KeepRates {
    kept: [f32; BUCKETS],
    tried: [f32; BUCKETS],
}

/// Match lengths 1, 2, 3, 4-5, 6-8, 9 and more.
const BUCKETS: usize = 6;
/// Each new outcome weighs this much more than the one before.
const DECAY: f32 = 0.995;

fn bucket(match_len: usize) -> usize {
    match match_len {
        0..=1 => 0,
        2 => 1,
        3 => 2,
        4..=5 => 3,
        6..=8 => 4,
        _ => 5,
    }
}

impl Default for KeepRates {
    fn default() -> Self {
        let prior = [0.2, 0.35, 0.5, 0.65, 0.8, 0.85];
        KeepRates { kept: prior.map(|p| 4.0 * p), tried: [4.0; BUCKETS] }
    }
}

impl KeepRates {
    /// The chance a token looked up behind a match of `match_len` is kept.
    pub fn chance(&self, match_len: usize) -> f32 {
        let b = bucket(match_len);
        self.kept[b] / self.tried[b]
    }

    /// No counts: a sequence's own, before its first draft.
    pub fn empty() -> Self {
        KeepRates { kept: [0.0; BUCKETS], tried: [0.0; BUCKETS] }
    }

    /// The chance for one sequence: its own counts, with the engine's
    /// chance standing for `PRIOR` tries (so a sequence whose text does not
    /// repeat soon stops drafting, whatever other sequences do).
    pub fn chance_for(&self, own: &KeepRates, match_len: usize) -> f32 {
        const PRIOR: f32 = 4.0;
        let b = bucket(match_len);
        (own.kept[b] + PRIOR * self.chance(match_len)) / (own.tried[b] + PRIOR)
    }

    pub fn record(&mut self, match_len: usize, kept: bool) {
        let b = bucket(match_len);
        self.tried[b] = self.tried[b] * DECAY + 1.0;
        self.kept[b] = self.kept[b] * DECAY + f32::from(u8::from(kept));
    }
}

/// A speculating sequence's own state: how often its drafts were kept, and
/// after a probe (a token drafted though unlikely to pay, to learn whether
/// it would), how many steps to wait before the next one.
#[derive(Debug, Clone, PartialEq)]
pub struct Speculation {
    pub own: KeepRates,
    wait: u32,
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation { own: KeepRates::empty(), wait: 0 }
    }
}

/// Steps between probes of one sequence.
const PROBE_EVERY: u32 = 16;

impl Speculation {
    /// Count a step; whether a probe is due.
    pub fn probe_due(&mut self) -> bool {
        self.wait = self.wait.saturating_sub(1);
        self.wait == 0
    }

    pub fn probed(&mut self) {
        self.wait = PROBE_EVERY;
    }
}

/// Speculation's counters: steps of a sequence that carried a draft, its
/// tokens (looked up, and forced spans carried with them), the looked-up
/// ones and those kept, every token those steps appended, and the masks
/// after draft tokens (time summed over threads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounters {
    pub steps: usize,
    pub tokens: usize,
    pub lookups: usize,
    pub lookups_kept: usize,
    pub step_tokens: usize,
    pub mask_us: u64,
    pub mask_rows: usize,
}

impl DraftCounters {
    /// As `stats()` names them.
    pub fn entries(&self) -> [(&'static str, usize); 7] {
        [
            ("draft_steps", self.steps),
            ("draft_tokens", self.tokens),
            ("draft_lookups", self.lookups),
            ("draft_lookups_kept", self.lookups_kept),
            ("draft_step_tokens", self.step_tokens),
            ("draft_mask_us", self.mask_us as usize),
            ("draft_mask_rows", self.mask_rows),
        ]
    }
}

/// Drafts are sized to pay this many times their rows' cost (the cost
/// model is rough, and a row also costs where it is not measured).
const MARGIN: f32 = 1.25;

/// What sizes the drafts of a scheduler: what a step costs, as the caller
/// measures it, and how often looked-up tokens are kept.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Drafts {
    /// Fixed and per token fed; None: unknown, rows are taken to be cheap.
    step_cost: Option<(f32, f32)>,
    rates: KeepRates,
}

impl Drafts {
    pub fn set_step_cost(&mut self, fixed: f32, per_token: f32) {
        self.step_cost = (fixed.is_finite() && per_token.is_finite()).then_some((fixed.max(0.0), per_token.max(0.0)));
    }

    pub fn rates(&self) -> &KeepRates {
        &self.rates
    }

    /// The chance of being kept at which a draft row pays for itself, with
    /// `batch` sequences running: its cost over what a kept token saves (a
    /// step's share per sequence, plus the row).
    pub fn threshold(&self, batch: usize) -> f32 {
        match self.step_cost {
            Some((fixed, per_token)) => MARGIN * per_token / (fixed / batch.max(1) as f32 + per_token),
            None => 0.0,
        }
    }

    /// A step that carried `draft`: `kept` of its tokens kept, `appended`
    /// tokens appended in all; `finished` steps may have stopped short of
    /// trying the token after those kept. What was tried teaches the rates,
    /// the engine's and the sequence's (`own`).
    pub fn record(&mut self, counters: &mut DraftCounters, draft: &Draft, kept: usize, finished: bool, appended: usize, mut own: Option<&mut Speculation>) {
        counters.steps += 1;
        counters.tokens += draft.len();
        counters.lookups += draft.looked_up();
        counters.lookups_kept += draft.match_len[..kept].iter().filter(|&&l| l > 0).count();
        counters.step_tokens += appended;
        let tried = if finished { kept } else { (kept + 1).min(draft.len()) };
        for (i, &l) in draft.match_len[..tried].iter().enumerate().filter(|(_, &l)| l > 0) {
            self.rates.record(l, i < kept);
            if let Some(spec) = own.as_deref_mut() {
                spec.own.record(l, i < kept);
            }
        }
    }
}

/// How far a draft may go: at most `lookups` looked-up tokens and
/// `max_tokens` in all, each looked-up token only while the chance that it
/// and those before it are kept is at least `threshold` (a row's cost over
/// what a kept token saves, see `Scheduler::draft_for`), except one token
/// as a probe where `probe` allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub lookups: usize,
    pub max_tokens: usize,
    pub threshold: f32,
    pub probe: bool,
}

/// Propose a draft after `tokens` (prompt and output so far), each token
/// allowed by `matcher` where there is one: first what the grammar forces
/// now (left to sampling, so drawn and checked), then looked-up tokens with
/// the spans the grammar forces after each (marked forced under
/// `fast_forward`, as commit() appends them). `matcher` is left as it was.
pub fn propose(
    drafter: Drafter,
    tokens: &[u32],
    mut matcher: Option<&mut GrammarMatcher>,
    fast_forward: bool,
    limits: Limits,
    rates: (&KeepRates, &KeepRates),
    step: u64,
) -> Draft {
    let mut draft = Draft::default();
    if limits.lookups == 0 || limits.max_tokens == 0 {
        return draft;
    }
    if let Drafter::Random(seed) = drafter {
        let vocab = matcher.as_ref().map_or(1 << 15, |m| m.vocab_size()) as u64;
        for i in 0..limits.lookups.min(limits.max_tokens) as u64 {
            let t = crate::sampling::random::mix64(seed ^ crate::sampling::random::mix64(step.wrapping_mul(131).wrapping_add(i)));
            // Half of them the context's own tokens (so some are kept), half anything.
            let token = if t & 1 == 0 && !tokens.is_empty() { tokens[(t >> 1) as usize % tokens.len()] } else { ((t >> 1) % vocab) as u32 };
            draft.push(token, false, 1);
        }
        return draft;
    }
    let mut ctx = tokens.to_vec();
    let mut consumed = 0;
    // What the grammar forces here was left to sampling (fast-forward off,
    // or held back): drafted as tokens to draw, which the mask then allows alone.
    if let Some(m) = matcher.as_deref_mut() {
        consumed += force(m, false, &mut draft, &mut ctx, &mut None);
    }
    // Where the current match continues in ctx, and how long it is.
    let mut next: Option<(usize, usize)> = None;
    let mut chance = 1.0f32;
    while draft.looked_up() < limits.lookups && draft.len() < limits.max_tokens {
        if matcher.as_deref().is_some_and(|m| m.is_stopped()) {
            break;
        }
        let Some((at, match_len)) = choose(&ctx, next, matcher.as_deref_mut()) else { break };
        if matcher.is_some() {
            consumed += 1; // choose() consumed it
        }
        chance *= rates.0.chance_for(rates.1, match_len);
        let probe = limits.probe && draft.looked_up() == 0;
        if chance < limits.threshold && !probe {
            break;
        }
        draft.probe = chance < limits.threshold;
        let token = ctx[at];
        draft.push(token, false, match_len);
        ctx.push(token);
        next = Some((at + 1, match_len + 1));
        if let Some(m) = matcher.as_deref_mut() {
            consumed += force(m, fast_forward, &mut draft, &mut ctx, &mut next);
        }
        if draft.probe {
            break;
        }
    }
    if let Some(m) = matcher {
        let _ = m.rollback(consumed);
    }
    if draft.len() > limits.max_tokens {
        draft.truncate(limits.max_tokens);
    }
    draft
}

/// Append to the draft what the grammar forces after its last token, as
/// commit() would (`forced`: marked as appended without a draw); a match
/// goes on where its text equals the span. Returns the tokens consumed.
fn force(m: &mut GrammarMatcher, forced: bool, draft: &mut Draft, ctx: &mut Vec<u32>, next: &mut Option<(usize, usize)>) -> usize {
    let mut consumed = 0;
    for _ in 0..MAX_FF_ROUNDS {
        if m.is_stopped() {
            break;
        }
        let ff = m.forced_tokens();
        if ff.is_empty() {
            break;
        }
        let n = m.advance(&ff).unwrap_or(0);
        consumed += n;
        for &f in &ff[..n] {
            draft.push(f, forced, 0);
            ctx.push(f);
            *next = next.filter(|&(p, _)| p < ctx.len() && ctx[p] == f).map(|(p, l)| (p + 1, l + 1));
        }
        if n < ff.len() {
            break;
        }
    }
    consumed
}

/// The place in `ctx` of the next draft token, and the length of the match
/// behind it: the current match's next token where the grammar allows it,
/// else the token after the latest earlier occurrence of ctx's last n
/// tokens (n from MAX_NGRAM down to 1) that the grammar allows, its match
/// measured back as far as it agrees (at most MAX_MATCH). An allowed token
/// is consumed by `matcher`.
fn choose(ctx: &[u32], next: Option<(usize, usize)>, mut matcher: Option<&mut GrammarMatcher>) -> Option<(usize, usize)> {
    let mut allows = |t: u32| matcher.as_deref_mut().is_none_or(|m| m.try_consume(&[t]) == Ok(1));
    if let Some((p, len)) = next.filter(|&(p, _)| p < ctx.len()) {
        if allows(ctx[p]) {
            return Some((p, len.min(MAX_MATCH)));
        }
    }
    let len = ctx.len();
    let mut tried = Vec::new();
    for n in (1..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &ctx[len - n..];
        let mut found = 0;
        for i in (0..len - n).rev() {
            if &ctx[i..i + n] != suffix {
                continue;
            }
            let at = i + n;
            found += 1;
            if !tried.contains(&ctx[at]) {
                tried.push(ctx[at]);
                if allows(ctx[at]) {
                    let agree = (n..MAX_MATCH.min(i + n)).take_while(|&k| ctx[at - 1 - k] == ctx[len - 1 - k]).count();
                    return Some((at, n + agree));
                }
            }
            if found == CANDIDATES {
                break;
            }
        }
    }
    None
}

/// Per row of a walk: the draw, and the stream after it (None: not drawn).
pub type WalkedRows = (Vec<Option<Sampled>>, Vec<Option<Stream>>);

/// Draw a sequence's rows as steps without a draft would have: row 0 after
/// its last real token, then row r after draft token r - 1 while the draws
/// equal the draft (forced tokens are not drawn). `rows[r]` is row r's
/// logits, `masks[r]` its grammar mask (`constrained`: a row without one is
/// not drawn).
pub fn walk(
    draft: &Draft,
    rows: &[&[f32]],
    masks: &[Option<&[i32]>],
    constrained: bool,
    row: &Row<'_>,
    banned: impl Fn(usize) -> Vec<u32>,
    mut rng: Stream,
) -> WalkedRows {
    let (mut out, mut streams) = (vec![None; draft.len() + 1], vec![None; draft.len() + 1]);
    let mut r = 0;
    loop {
        if constrained && masks[r].is_none() {
            break;
        }
        let mut output = row.output.to_vec();
        output.extend(&draft.tokens[..r]);
        let banned = banned(r);
        let at = Row { output: &output, banned: &banned, ..*row };
        let s = sample_row(rows[r], masks[r], &at, &mut rng);
        let kept = r < draft.len() && s.token == i64::from(draft.tokens[r]);
        (out[r], streams[r]) = (Some(s), Some(rng));
        if !kept {
            break;
        }
        r += 1;
        while r < draft.len() && draft.forced[r] {
            r += 1;
        }
    }
    (out, streams)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::matchers::testing::*;
    use crate::grammar::matchers::GrammarCompiler;

    fn any(lookups: usize) -> Limits {
        Limits { lookups, max_tokens: 16, threshold: 0.0, probe: false }
    }

    #[test]
    fn lookup_continues_the_latest_match() {
        let tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        let d = propose(Drafter::Lookup, &tokens, None, true, any(3), (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!(d.tokens, vec![5, 6, 1]);
        assert_eq!(d.looked_up(), 3);
        assert!(propose(Drafter::Lookup, &[7, 8], None, true, any(3), (&KeepRates::default(), &KeepRates::empty()), 0).is_empty());
    }

    #[test]
    fn the_grammar_chooses_the_match_and_its_forced_spans_join_forced() {
        let (words, eos) = vocab();
        let n = words.len();
        let compiler = GrammarCompiler::new(words, &[eos], n, 4, None).unwrap();
        let g = compiler.compile(&lark(r#"start: "a" ("b" | "c") "xyz" "d""#)).unwrap();
        let mut m = g.matcher();
        let (a, b, c) = (tok("a"), tok("b"), tok("c"));
        let x = tok("x");
        // "a b" occurred last, "a c" before: the grammar allows both, so the
        // latest; with "b" refused (a different grammar) the earlier one.
        let ctx = [a, c, x, a, b, x, a];
        let before = m.compute_mask();
        m.advance(&[a]).unwrap();
        let d = propose(Drafter::Lookup, &ctx, Some(&mut m), true, any(1), (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!(d.tokens[0], b);
        assert_eq!(d.looked_up(), 1);
        assert!(d.forced[1..].iter().all(|&f| f), "the forced span after it: {d:?}");
        assert!(d.len() > 1);
        let off = propose(Drafter::Lookup, &ctx, Some(&mut m), false, any(1), (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!(off.tokens, d.tokens);
        assert!(off.forced.iter().all(|&f| !f));
        m.rollback(1).unwrap();
        assert_eq!(m.compute_mask(), before, "the matcher is left as it was");
        let g2 = compiler.compile(&lark(r#"start: "a" "c" "xyz""#)).unwrap();
        let mut m2 = g2.matcher();
        m2.advance(&[a]).unwrap();
        let d2 = propose(Drafter::Lookup, &ctx, Some(&mut m2), true, any(1), (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!(d2.tokens.first(), Some(&c));
    }

    #[test]
    fn truncating_never_ends_inside_a_forced_span() {
        let mut d = Draft {
            tokens: vec![1, 2, 3, 4, 5],
            forced: vec![false, true, true, false, true],
            match_len: vec![2, 0, 0, 3, 0],
            probe: false,
        };
        assert_eq!(d.drawn_rows(), vec![true, false, false, true, false, true]);
        d.truncate(4);
        assert_eq!(d.tokens, vec![1, 2, 3]);
        assert_eq!(d.looked_up(), 1);
        d.truncate(2);
        assert!(d.is_empty(), "token 1 and 2 are forced after token 0: {d:?}");
    }

    #[test]
    fn rates_learn_by_match_length_and_probes_come_now_and_then() {
        let mut r = KeepRates::default();
        assert!(r.chance(1) < r.chance(3) && r.chance(3) < r.chance(12));
        for _ in 0..200 {
            r.record(2, false);
            r.record(7, true);
        }
        assert!(r.chance(2) < 0.05 && r.chance(7) > 0.95, "{r:?}");
        let mut s = Speculation::default();
        assert!(s.probe_due());
        s.probed();
        let due: Vec<bool> = (0..PROBE_EVERY).map(|_| s.probe_due()).collect();
        assert_eq!(due.iter().filter(|&&d| d).count(), 1);
        assert!(due[PROBE_EVERY as usize - 1]);
    }

    #[test]
    fn drafts_stop_where_their_rows_stop_paying() {
        // A long repeat: the match grows with every token drafted.
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4];
        let all = Limits { lookups: 8, max_tokens: 16, threshold: 0.0, probe: false };
        let d = propose(Drafter::Lookup, &tokens, None, true, all, (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!(d.tokens, vec![5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(&d.match_len[..3], &[4, 5, 6]);
        let dear = Limits { threshold: 0.5, ..all };
        let short = propose(Drafter::Lookup, &tokens, None, true, dear, (&KeepRates::default(), &KeepRates::empty()), 0);
        assert!(!short.is_empty() && short.len() < d.len(), "{short:?}");
        // A one-token match is not worth a row at that cost, but may be probed.
        let weak = [1, 2, 9, 1];
        assert!(propose(Drafter::Lookup, &weak, None, true, dear, (&KeepRates::default(), &KeepRates::empty()), 0).is_empty());
        let probe = propose(Drafter::Lookup, &weak, None, true, Limits { probe: true, ..dear }, (&KeepRates::default(), &KeepRates::empty()), 0);
        assert_eq!((probe.tokens.clone(), probe.probe), (vec![2], true));
    }

    #[test]
    fn drafter_names() {
        assert_eq!(Drafter::parse("lookup"), Ok(Drafter::Lookup));
        assert_eq!(Drafter::parse("random:7"), Ok(Drafter::Random(7)));
        assert!(Drafter::parse("random:x").is_err());
        assert!(Drafter::parse("ngram").is_err());
    }
}
