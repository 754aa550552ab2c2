//! Output that is never cut mid-structure: a short completion the grammar
//! accepts from a matcher's state, and when to look for it.
//!
//! The search moves a copy of the matcher's Earley parser a lexeme at a
//! time, not a byte at a time: from the lexer's state it reads the
//! automaton (llguidance's DFA over the lexemes the parser allows there) and
//! takes, for each lexeme that may end, the shortest bytes that end it, so a
//! pattern (`[a-z]+@[a-z]+\.com`), a format (e-mail, date, uuid) or a
//! `minLength` string is left by its shortest way out whatever the model
//! wrote into it. Where a lexeme may end, the bytes that start the next one
//! are tried (closers first); the special tokens the grammar names (the end
//! of a reasoning block, of a call, of the calls block) are tried as single
//! steps. Depth-first, closers and listed keys first, bounded by the best
//! completion found so far (branch and bound), the first pass leaving out
//! the keys an object would take as additional ones. The bytes found are
//! then retokenized into as few tokens as the vocabulary allows. Whatever it
//! returns the grammar has accepted, token by token, and ends in an
//! accepting state: a completion a few tokens longer than the optimum is
//! possible, an invalid one is not.

use std::collections::{HashMap, HashSet};

/// The ways to end a lexeme found from each lexer state, and whether it may
/// end there (see [`Cursor::endings`]).
type Endings = HashMap<StateID, std::rc::Rc<(Vec<Vec<u8>>, bool)>>;

/// Where a lexeme may end: the bytes that end it, and those that start the
/// next one where it may end as it stands.
struct Ways {
    endings: std::rc::Rc<(Vec<Vec<u8>>, bool)>,
    next: Vec<u8>,
}

use llguidance::derivre::StateID;
use llguidance::earley::{BiasComputer, Parser};
use llguidance::toktrie::{Recognizer, SimpleVob, TokTrie};

use crate::grammar::matchers::GrammarMatcher;

/// Bytes tried first where a lexeme may end and the next begin: closers
/// (`<` opens a closing tag: `</tool_calls>`), then separators and the
/// shortest values; letters and digits next; whitespace last, so it is only
/// used where the grammar requires it.
const FIRST: &[u8] = b"\"}]>,:1tfn<[{";

/// Parser steps one search may take in all (a bound on its cost).
const MAX_TRIES: usize = 12_000;
/// Parser steps of one round (one bound on the completion's length).
const ROUND_TRIES: usize = 1_500;
/// The bound of the first round; each next round doubles it.
const FIRST_BOUND: usize = 32;
/// How far one lexeme's ways out are looked for in its automaton: states
/// visited at most, ways kept (one per set of lexemes still possible: an
/// object's listed keys where a key starts), and how much longer than the
/// shortest way another may be. Each new state costs the lexer fuel; a
/// search that runs its copy out of fuel (a pattern with `.` inside a JSON
/// string builds states fast) is run again with the lean reach.
#[derive(Clone, Copy)]
struct Reach {
    states: usize,
    endings: usize,
    span: usize,
}

const FULL: Reach = Reach { states: 512, endings: 64, span: 32 };
const LEAN: Reach = Reach { states: 64, endings: 16, span: 8 };
/// The longest completion searched for, in bytes.
pub const MAX_BYTES: usize = 4096;
/// How a special token is written among bytes (toktrie's raw form:
/// `0xff` `[id]`), so one byte string holds a whole completion.
const MARKER: u8 = 0xff;

/// The order in which bytes start a lexeme: closers first (see [`FIRST`]).
fn byte_order() -> Vec<u8> {
    let mut order: Vec<u8> = FIRST.to_vec();
    let rest = (b'a'..=b'z').chain(b'A'..=b'Z').chain(b'0'..=b'9').chain(b'!'..=b'~').chain(*b" \n\t\r");
    let rest = rest.chain(0x80..=0xfe).chain(0x01..=0x1f);
    for b in rest {
        if !order.contains(&b) {
            order.push(b);
        }
    }
    order
}

/// The order in which bytes continue a lexeme (which of the equally short
/// ways to end it is taken): letters and digits first, so that a value
/// written to fill a pattern, a format or a minimum length reads as one
/// (`a@a.aa`, `aaa`, not `}@1`); `1` before `0`, which a format may refuse
/// (year 0000).
fn content_order() -> Vec<u8> {
    let mut order: Vec<u8> = Vec::new();
    let rest = (b'a'..=b'z').chain(*b"10").chain(b'2'..=b'9').chain(b'A'..=b'Z').chain(FIRST.iter().copied());
    let rest = rest.chain(b'!'..=b'~').chain(*b" \n\t\r").chain(0x80..=0xfe).chain(0x01..=0x1f);
    for b in rest {
        if !order.contains(&b) {
            order.push(b);
        }
    }
    order
}

/// The special token written at the start of `bytes` (`0xff[id]`), and
/// how many bytes it takes.
fn special_at(bytes: &[u8]) -> Option<(usize, u32)> {
    let rest = bytes.strip_prefix(&[MARKER, b'['])?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if rest.get(digits) != Some(&b']') || digits == 0 {
        return None;
    }
    let id = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    Some((digits + 3, id))
}

/// One token per byte, special tokens (`0xff[id]`) as themselves.
fn byte_tokens(m: &GrammarMatcher, bytes: &[u8]) -> Option<Vec<u32>> {
    let by_byte = m.byte_tokens();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some((len, t)) = special_at(&bytes[i..]) {
            out.push(t);
            i += len;
        } else {
            out.push(by_byte[bytes[i] as usize]?);
            i += 1;
        }
    }
    Some(out)
}

/// `bytes` in as few tokens as the vocabulary allows: each run of plain
/// bytes retokenized, each special token kept.
fn fewest_tokens(m: &GrammarMatcher, bytes: &[u8]) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    let (mut i, mut run) = (0, 0);
    while i < bytes.len() {
        match special_at(&bytes[i..]) {
            Some((len, t)) => {
                out.extend(m.fewest_tokens(&bytes[run..i])?);
                out.push(t);
                i += len;
                run = i;
            }
            None => i += 1,
        }
    }
    out.extend(m.fewest_tokens(&bytes[run..])?);
    Some(out)
}

/// A copy of the Earley parser moved forward and back by whole steps.
struct Cursor<'a> {
    p: Parser,
    trie: &'a TokTrie,
    /// Bytes written (special tokens as `0xff[id]`), and the parser bytes each step took.
    path: Vec<u8>,
    steps: Vec<(usize, usize)>,
    /// Bytes the parser held before the search (the output so far).
    before: Vec<u8>,
}

impl Cursor<'_> {
    /// Take `bytes` (one special token where `special` is given); false, and
    /// nothing taken, where the grammar refuses them.
    fn push(&mut self, bytes: &[u8], special: Option<u32>) -> bool {
        let start = self.p.get_bytes().len();
        let trie = self.trie;
        let raw = special.map_or(bytes, |t| trie.token(t));
        let tok = special.unwrap_or(llguidance::toktrie::INVALID_TOKEN);
        let ok = matches!(self.p.apply_token(raw, tok), Ok(0)) && self.p.get_error().is_none();
        let taken = self.p.get_bytes().len() - start;
        if !ok {
            if taken > 0 {
                let _ = self.p.rollback(taken);
            }
            return false;
        }
        self.steps.push((bytes.len(), taken));
        self.path.extend_from_slice(bytes);
        true
    }

    fn pop(&mut self) {
        if let Some((written, taken)) = self.steps.pop() {
            self.path.truncate(self.path.len() - written);
            let _ = self.p.rollback(taken);
        }
    }

    fn accepting(&mut self) -> bool {
        self.p.is_accepting()
    }

    /// The ways the lexeme being written may end, shortest first: for each
    /// set of lexemes still possible where it may end, the shortest bytes
    /// that get there (read off the lexer's automaton, which the parser
    /// limited to the lexemes it allows), and, where it may end as it
    /// stands, the bytes the parser takes to start the next lexeme (in
    /// `order`). The first depend on the lexer's state alone (kept in
    /// `cache`), the second on the parser's too.
    fn endings(&mut self, content: &[u8], order: &[u8], reach: Reach, cache: &mut Endings) -> Ways {
        let start = self.p.with_recognizer(|r| r.lexer_state());
        let found = match cache.get(&start) {
            Some(hit) => hit.clone(),
            None => {
                // ASCII first: the bytes of UTF-8 characters (and `.` in a pattern) multiply states
                let ascii: Vec<u8> = content.iter().copied().filter(|&b| b.is_ascii() && (b >= 0x20 || b"\n\t".contains(&b))).collect();
                let mut found = self.lexer_endings(start, &ascii, reach);
                if found.0.is_empty() && ascii.len() < content.len() {
                    found = self.lexer_endings(start, content, reach);
                }
                let found = std::rc::Rc::new(found);
                cache.insert(start, found.clone());
                found
            }
        };
        // (what the parser takes next depends on more than the lexer's state)
        let next = if found.1 { self.next_lexeme_bytes(start, order) } else { Vec::new() };
        Ways { endings: found, next }
    }

    /// The bytes in `order` that end the lexeme in state `start` and that
    /// the parser takes as the start of the next (tried speculatively).
    fn next_lexeme_bytes(&mut self, start: StateID, order: &[u8]) -> Vec<u8> {
        self.p.with_recognizer(|r| {
            r.trie_started("closing");
            let mut out = Vec::new();
            for &b in order {
                if r.lexer_mut().transition_start_state(start, Some(b), &None).is_dead() && r.try_push_byte(b) {
                    r.pop_bytes(1);
                    out.push(b);
                }
            }
            r.trie_finished();
            out
        })
    }

    fn lexer_endings(&mut self, start: StateID, order: &[u8], reach: Reach) -> (Vec<Vec<u8>>, bool) {
        self.p.with_recognizer(|r| {
            let lx = r.lexer_mut();
            let here = !lx.try_lexeme_end(start).is_error();
            let mut seen = HashSet::from([start]);
            let mut layer = vec![(start, Vec::new())];
            let mut found: Vec<Vec<u8>> = Vec::new();
            let mut kinds: HashSet<(bool, Vec<usize>)> = HashSet::new();
            if here {
                // where it may end already, writing on to end it as the same lexemes is no way out
                kinds.insert((false, lx.possible_lexemes(start).iter().map(|i| i.as_usize()).collect()));
            }
            let mut first_len = None;
            while !layer.is_empty() && seen.len() < reach.states && found.len() < reach.endings {
                if first_len.is_some_and(|n: usize| layer[0].1.len() > n + reach.span) {
                    break;
                }
                let mut next = Vec::new();
                for (s, w) in layer {
                    for &b in order {
                        let t = lx.transition_start_state(s, Some(b), &None);
                        if t.is_dead() {
                            continue;
                        }
                        let mut w2 = w.clone();
                        w2.push(b);
                        // a lazy lexeme (a suffix, a special token) ends on this byte
                        let ends = t.has_lowest_match() || !lx.try_lexeme_end(t).is_error();
                        if ends {
                            let kind = (t.has_lowest_match(), lx.possible_lexemes(t).iter().map(|i| i.as_usize()).collect());
                            if kinds.insert(kind) {
                                first_len.get_or_insert(w2.len());
                                found.push(w2.clone());
                            }
                        }
                        if !t.has_lowest_match() && seen.insert(t) {
                            next.push((t, w2));
                        }
                    }
                }
                layer = next;
            }
            (found, here)
        })
    }
}


/// A mask computer that computes nothing: llguidance refuels the lexer
/// before it calls one.
struct Refuel<'a>(&'a TokTrie);

impl BiasComputer for Refuel<'_> {
    fn compute_bias(&self, _: &mut llguidance::earley::ParserRecognizer<'_>, _: &[u8]) -> SimpleVob {
        self.0.alloc_token_set()
    }

    fn trie(&self) -> &TokTrie {
        self.0
    }
}

struct Search<'a> {
    c: Cursor<'a>,
    hints: std::sync::Arc<crate::grammar::matchers::Hints>,
    /// Bytes tried where a lexeme may end, and within one, in order (those
    /// the vocabulary has as single tokens).
    order: &'a [u8],
    content: &'a [u8],
    endings: &'a mut Endings,
    best: Option<Vec<u8>>,
    tries: usize,
    /// Tries allowed: MAX_TRIES, then, once a completion is found, a little
    /// more than it took (looking for a shorter one).
    max_tries: usize,
    /// Leave out keys the grammar does not list (an object's additional keys).
    listed_keys_only: bool,
    reach: Reach,
    /// The parser's copy failed (see [`Reach`]).
    broken: bool,
}

impl Search<'_> {
    /// The longest the path may get before this branch is abandoned.
    fn bound(&self, limit: usize) -> usize {
        self.best.as_ref().map_or(limit, |b| b.len().saturating_sub(1))
    }

    fn run(&mut self, limit: usize) {
        if self.c.accepting() {
            if self.best.is_none() {
                self.max_tries = self.max_tries.min(2 * self.tries + 200);
            }
            if self.best.as_ref().is_none_or(|b| self.c.path.len() < b.len()) {
                self.best = Some(self.c.path.clone());
            }
            return;
        }
        if self.c.path.len() >= self.bound(limit) || self.tries >= self.max_tries {
            return;
        }
        // At the start, one step that ends it all (text that may end here, a
        // closer) before any branch dives: a special token tried first may
        // open a call where a single byte of text would have done.
        if self.c.path.is_empty() && self.ends_in_one_step() {
            return;
        }
        // Special tokens and lazy rules' suffixes first: they end what is open.
        let hints = self.hints.clone();
        for &t in &hints.specials {
            let bytes = self.c.trie.decode_raw(&[t]);
            self.step(&bytes, Some(t), limit);
        }
        for suffix in &hints.suffixes {
            self.step(suffix, None, limit);
        }
        let ways = self.c.endings(self.content, self.order, self.reach, self.endings);
        if self.c.p.get_error().is_some() {
            // the copy's lexer ran out of fuel or states: nothing it says now holds
            self.broken = true;
            self.max_tries = 0;
            return;
        }
        // the lexeme may end here: the next one starts (closers first)
        let additional = self.is_additional_key();
        for &b in &ways.next {
            if !(b == b':' && additional) {
                self.step(&[b], None, limit);
            }
        }
        let endings = &ways.endings.0;
        // Closers first (by their first byte, as single bytes are tried), then
        // the shorter; listed keys before other endings (an additional key is
        // shorter: `""`).
        let rank = |w: &&Vec<u8>| (self.order.iter().position(|&b| b == w[0]), w.len());
        let (mut keys, mut rest): (Vec<_>, Vec<_>) = endings.iter().partition(|w| self.listed_key(w).is_some());
        // listed keys in the grammar's order: an object's required keys come first
        keys.sort_by_key(|w| self.listed_key(w).map(|i| (!self.hints.required.contains(&self.hints.keys[i]), i)));
        rest.sort_by_key(rank);
        for w in keys.iter().chain(&rest) {
            if !(w[0] == b':' && additional) {
                self.step(w, None, limit);
            }
        }
    }

    /// Whether the key just written (the JSON string before the path's end)
    /// is one the grammar does not list, when only listed keys are written.
    fn is_additional_key(&self) -> bool {
        if !self.listed_keys_only || self.hints.keys.is_empty() {
            return false;
        }
        let text = [&self.c.before[..], &self.c.path[..]].concat();
        let end = text.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
        match last_string(&text[..end]) {
            Some(key) => !self.hints.keys.iter().any(|k| k[..] == key[..]),
            None => false,
        }
    }

    /// Where the key that writing `w` completes stands among the keys the grammar lists.
    fn listed_key(&self, w: &[u8]) -> Option<usize> {
        if self.hints.keys.is_empty() || w.last() != Some(&b'"') {
            return None;
        }
        let text = [&self.c.before[..], &self.c.path[..], w].concat();
        let key = last_string(&text)?;
        self.hints.keys.iter().position(|k| k[..] == key[..])
    }

    /// Take one step and search on from there.
    fn step(&mut self, bytes: &[u8], special: Option<u32>, limit: usize) {
        if self.tries >= self.max_tries || self.c.path.len() + bytes.len() > self.bound(limit) {
            return;
        }
        self.tries += 1;
        if self.c.push(bytes, special) {
            self.run(limit);
            self.c.pop();
        }
    }

    /// Whether a special token or a closer byte takes the parser to an
    /// accepting state; if so it is the best completion below this point.
    fn ends_in_one_step(&mut self) -> bool {
        let specials = self.hints.specials.iter().map(|&t| (self.c.trie.decode_raw(&[t]), Some(t)));
        let closers = FIRST.iter().filter(|b| self.order.contains(b)).map(|&b| (vec![b], None));
        let steps: Vec<(Vec<u8>, Option<u32>)> = specials.chain(closers).collect();
        for (bytes, special) in steps {
            self.tries += 1;
            if !self.c.push(&bytes, special) {
                continue;
            }
            let accepting = self.c.accepting();
            self.c.pop();
            if accepting {
                self.best = Some(bytes);
                return true;
            }
        }
        false
    }
}

/// The JSON string `text` ends with (quotes included), where it ends with one.
fn last_string(text: &[u8]) -> Option<&[u8]> {
    let end = text.len().checked_sub(1).filter(|&i| text[i] == b'"')?;
    let mut i = end;
    while i > 0 {
        i -= 1;
        if text[i] == b'"' {
            let escapes = text[..i].iter().rev().take_while(|&&b| b == b'\\').count();
            if escapes % 2 == 0 {
                return Some(&text[i..=end]);
            }
        }
    }
    None
}

/// A completion: its tokens, and the bytes they stand for (special tokens
/// as `0xff[id]`, as [`GrammarMatcher::bytes_of`] writes them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Closing {
    pub tokens: Vec<u32>,
    pub bytes: Vec<u8>,
}

/// The search with one [`Reach`]: Err where the parser's copy failed (a
/// search with less reach may still find one), Ok(None) where none was found.
fn search(m: &GrammarMatcher, max_tokens: usize, reach: Reach) -> Result<Option<Vec<u8>>, ()> {
    let Some(mut p) = m.earley() else { return Ok(None) };
    let trie = m.trie();
    // The copy's lexer has what fuel the last mask left: one mask's worth for
    // the search (a non-empty start: nothing is computed or cached).
    p.compute_bias(&Refuel(trie), b"x");
    // Bytes the parser forced but no token has taken yet are the completion's first.
    let pending = p.currently_forced_bytes().to_vec();
    // (the tail the key checks read: the last string before the completion)
    let written = &p.get_bytes()[..p.get_bytes().len() - pending.len()];
    let before = written[written.len().saturating_sub(1024)..].to_vec();
    let by_byte = m.byte_tokens();
    let single = |order: Vec<u8>| order.into_iter().filter(|&b| by_byte[b as usize].is_some()).collect::<Vec<u8>>();
    let (order, content) = (single(byte_order()), single(content_order()));
    let limit = max_tokens.saturating_mul(8).min(MAX_BYTES);
    let mut endings = Endings::new();
    let mut tries = 0;
    // Additional keys are never needed to complete an object, so the search
    // first leaves them out (a key of another object would otherwise be
    // written as one); then with them. Each pass in rounds of a doubling
    // bound on the length: a round finds a completion within its bound if
    // one does, so the first found is at most about twice the shortest.
    let mut best = None;
    'passes: for listed_keys_only in [true, false] {
        let mut bound = FIRST_BOUND.min(limit);
        while tries < MAX_TRIES {
            let c = Cursor { p: p.clone(), trie, path: Vec::new(), steps: Vec::new(), before: before.clone() };
            let max_tries = ROUND_TRIES.min(MAX_TRIES - tries);
            let mut s = Search { c, hints: m.hints(), order: &order, content: &content, endings: &mut endings,
                                 best: None, tries: 0, max_tries, listed_keys_only, reach, broken: false };
            if !pending.is_empty() && !s.c.push(&pending, None) {
                return Ok(None);
            }
            s.run(bound);
            tries += s.tries;
            if s.broken {
                return Err(());
            }
            if s.best.is_some() {
                best = s.best;
                break 'passes;
            }
            if bound >= limit {
                break;
            }
            bound = (bound * 2).min(limit);
        }
    }
    Ok(best)
}

/// The shortest completion found from `m`'s state that the grammar accepts:
/// empty when `m` already accepts; None when none of at most `max_tokens`
/// tokens was found.
pub fn shortest_completion(m: &GrammarMatcher, max_tokens: usize) -> Option<Closing> {
    let best = [FULL, LEAN].into_iter().find_map(|reach| search(m, max_tokens, reach).transpose())?.ok()?;
    // Fewer tokens for the same bytes where the grammar takes them.
    let tokens = match fewest_tokens(m, &best) {
        Some(t) if completes(m, &t) => t,
        _ => byte_tokens(m, &best).filter(|t| completes(m, t))?,
    };
    (tokens.len() <= max_tokens).then_some(Closing { tokens, bytes: best })
}

/// Whether `tokens` take `m` (left as it is) to a state that may end.
pub fn completes(m: &GrammarMatcher, tokens: &[u32]) -> bool {
    let mut check = m.clone();
    check.try_consume(tokens) == Ok(tokens.len()) && check.is_accepting()
}

/// When to look for a completion, and the last one found: every step once
/// the budget left is within twice its length (plus a margin), and now and
/// then before that, often enough that the completion cannot outgrow the
/// budget unnoticed.
#[derive(Debug, Clone, Default)]
pub struct Closer {
    /// The last completion found (or checked to still work).
    pub last: Closing,
    /// Budget left when it was found.
    pub checked_at: usize,
    /// No completion has been found yet (the output is cut at the budget
    /// unless a later search finds one).
    pub missed: bool,
    /// Tokens of the budget kept for the end token written after the
    /// closing (0 or 1), so a closed output ends as one the model ended.
    pub reserve: usize,
    /// Microseconds spent on this request's closing (searches, fit checks).
    pub spent_us: u64,
}

const MARGIN: usize = 16;

impl Closer {
    pub fn due(&self, remaining: usize) -> bool {
        let len = self.last.tokens.len();
        let slack = remaining.saturating_sub(len);
        remaining <= 2 * len + MARGIN || self.checked_at.saturating_sub(remaining) * 4 >= slack
    }

    pub fn record(&mut self, closing: Closing, remaining: usize) {
        self.last = closing;
        self.checked_at = remaining;
        self.missed = false;
    }

    /// A search found nothing (and none was ever found): try again later.
    pub fn record_miss(&mut self, remaining: usize) {
        self.checked_at = remaining;
        self.missed = true;
    }

    /// The last completion, or what is left of it after `appended` (bytes
    /// just written that begin it), or else a rest of it (see [`rests`]),
    /// where it still completes `m` with room to spare: cheap checks that
    /// spare most searches (the model writing on inside a string leaves its
    /// completion as it was; one that wrote a value of its own where the
    /// completion had a short one leaves the rest of it).
    pub fn still_fits(&self, m: &mut GrammarMatcher, appended: &[u8], remaining: usize) -> Option<Closing> {
        self.kept(m, appended, |n| n + 1 < remaining)
    }

    /// [`Self::still_fits`] with no room to spare: what is left of the last
    /// completion, where it still completes `m` in at most `left` tokens.
    /// The search is bounded and may miss a completion that exists (it
    /// follows one branch first: a tool whose arguments are long before a
    /// shorter one); a completion already checked does not depend on it.
    pub fn still_closes(&self, m: &mut GrammarMatcher, appended: &[u8], left: usize) -> Option<Closing> {
        self.kept(m, appended, |n| n <= left)
    }

    /// What closes the output from `m` in at most `left` tokens: a search's
    /// completion (`searched`) where it leaves room, else the shorter of it
    /// and what is left of the last one (see [`Self::still_closes`]).
    pub fn closing_within(&self, m: &mut GrammarMatcher, searched: Option<Closing>, appended: &[u8], left: usize) -> Option<Closing> {
        if searched.as_ref().is_some_and(|t| t.tokens.len() < left) {
            return searched;
        }
        let kept = if self.missed { None } else { self.still_closes(m, appended, left) };
        searched.into_iter().chain(kept).min_by_key(|c| c.tokens.len())
    }

    /// The last completion, or a part of it, that completes `m` in a number
    /// of tokens `room` takes.
    fn kept(&self, m: &mut GrammarMatcher, appended: &[u8], room: impl Fn(usize) -> bool) -> Option<Closing> {
        let last = &self.last;
        if last.tokens.is_empty() && room(0) && m.is_accepting() {
            return Some(Closing::default()); // no copy of the matcher needed
        }
        let fits = |m: &mut GrammarMatcher, c: &Closing| room(c.tokens.len()) && m.completed_by(&c.tokens);
        if fits(m, last) {
            return Some(last.clone());
        }
        let after = last.bytes.strip_prefix(appended).filter(|r| !appended.is_empty() && !r.is_empty());
        for bytes in after.into_iter().map(<[u8]>::to_vec).chain(rests(&last.bytes)) {
            if let Some(tokens) = fewest_tokens(m, &bytes) {
                let c = Closing { tokens, bytes };
                if fits(m, &c) {
                    return Some(c);
                }
            }
        }
        None
    }
}

/// Where a value, key or container ends in JSON text, and what may follow.
const BOUNDARIES: &[u8] = b"\",:]}";

/// The rests of a completion worth trying from a later state, shortest
/// first: what starts or follows each place where a value or key ends in
/// it, alone or after a `"` that ends a string the model left open.
fn rests(bytes: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    let at = move |i: usize| BOUNDARIES.contains(&bytes[i]);
    let cuts = (1..bytes.len()).rev().filter(move |&i| at(i - 1) || at(i));
    cuts.flat_map(move |i| [bytes[i..].to_vec(), [b"\"", &bytes[i..]].concat()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::matchers::testing::*;
    use crate::grammar::matchers::GrammarCompiler;

    fn compiler() -> GrammarCompiler {
        let (words, eos) = vocab();
        let n = words.len();
        GrammarCompiler::new(words, &[eos], n, 4, None).unwrap()
    }

    fn text(toks: &[u32]) -> String {
        let (words, _) = vocab();
        toks.iter().map(|&t| String::from_utf8_lossy(&words[t as usize]).into_owned()).collect()
    }

    fn schema(s: &str) -> String {
        format!("{{\"grammars\": [{{\"json_schema\": {s}}}]}}")
    }

    fn after(g: &str, prefix: &str) -> GrammarMatcher {
        let c = compiler();
        let mut m = c.compile(g).unwrap().matcher();
        for b in prefix.bytes() {
            m.consume(tok(&(b as char).to_string())).unwrap();
        }
        m
    }

    #[test]
    fn closes_the_open_string_and_fills_required_properties() {
        let g = schema(r#"{"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"], "additionalProperties": false}"#);
        let m = after(&g, r#"{"name": "ab"#);
        let c = shortest_completion(&m, 50).unwrap();
        let t = text(&c.tokens);
        assert_eq!(t.as_bytes(), &c.bytes[..]);
        assert_eq!(t.replace(' ', ""), r#"","n":1}"#, "{t}");
    }

    /// An object as grammar/json_schema/writer.py writes it: listed keys in any order (a
    /// parametric rule, bit i once key i is written), additional keys after the first one.
    const ANY_ORDER: &str = r#"%llguidance {"ignore_once": true}
%ignore /[ ]{1,8}/
start: obj
obj: "{" ka rest::0x1 "}" | "{" kb rest::0x2 "}"
rest::_ : "" %if is_ones([0:2])
    | "," ka rest::set_bit(0) %if bit_clear(0)
    | "," kb rest::set_bit(1) %if bit_clear(1)
    | "," extra rest::_
ka: "\"zeta\"" ":" %json {"type": "string"}
kb: "\"b\"" ":" inner
inner: "{" kc "}"
kc: "\"c\"" ":" %json {"type": "string", "pattern": "^[0-9]{3}$"}
extra: XKEY ":" %json {"type": "integer"}
XKEY: /"[a-z]*"/ & ~("\"zeta\"" | "\"b\"")
"#;

    #[test]
    fn an_object_in_any_order_closes_with_its_listed_keys_not_additional_ones() {
        let g = lark(ANY_ORDER);
        // one key byte at a time the search would write additional keys ("":1,"":1,...)
        for (prefix, want) in [("{", r#""zeta":"","b":{"c":"000"}}"#), (r#"{"b":{"c":"123"},"#, r#""zeta":""}"#),
                               (r#"{"b":{"c":"123"},"q":1,"#, r#""zeta":""}"#), (r#"{"ze"#, r#"ta":"","b":{"c":"000"}}"#)] {
            let m = after(&g, prefix);
            let c = shortest_completion(&m, 80).unwrap_or_else(|| panic!("none after {prefix}"));
            let t = text(&c.tokens);
            assert!(completes(&m, &c.tokens));
            // as short as the listed keys allow, in either order, and no key of its own
            assert_eq!(t.len(), want.len(), "after {prefix}: {t}");
            let keys = t.split("\":").map(|k| &k[k.rfind('"').map_or(0, |i| i + 1)..]);
            assert!(keys.take(t.matches("\":").count()).all(|k| ["zeta", "b", "c", "ta"].contains(&k)), "{t}");
        }
    }

    #[test]
    fn hints_read_listed_keys() {
        let c = compiler();
        let m = c.compile(&lark(ANY_ORDER)).unwrap().matcher();
        let h = m.hints();
        assert_eq!(h.keys, vec![b"\"zeta\"".to_vec(), b"\"b\"".to_vec(), b"\"c\"".to_vec()]);
        assert!(h.required.is_empty());
    }

    #[test]
    fn accepting_needs_nothing_and_too_long_is_none() {
        let g = lark("start: \"ab\" | \"abcdef\"");
        let m = after(&g, "ab");
        assert_eq!(shortest_completion(&m, 5), Some(Closing::default()));
        let g = lark("start: \"abcdefgh\"");
        let m = after(&g, "a");
        assert!(shortest_completion(&m, 3).is_none());
        assert_eq!(text(&shortest_completion(&m, 7).unwrap().tokens), "bcdefgh");
    }

    #[test]
    fn regexes_need_their_minimum() {
        let g = lark("start: /x[a-c]{3}[0-9]+z/");
        let m = after(&g, "x");
        let t = text(&shortest_completion(&m, 20).unwrap().tokens);
        assert_eq!(t.len(), 5, "{t}");
        assert!(t.ends_with('z'));
    }

    fn with_json(lark: &str, args: &str) -> String {
        format!("{{\"grammars\": [{{\"lark_grammar\": {lark:?}}}, {{\"name\": \"args\", \"json_schema\": {args}}}]}}")
    }

    #[test]
    fn a_chat_answer_closes_through_its_special_tokens() {
        // reasoning, then one call in special tokens around JSON arguments
        let (think, end_think) = (special("<think>"), special("</think>"));
        let (call, end_call) = (special("<call>"), special("</call>"));
        let lark = format!("start: <[{think}]> /[a-z ]*/ <[{end_think}]> \"\\n\" <[{call}]> @args <[{end_call}]>\n");
        let g = with_json(&lark, r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#);
        let c = compiler();
        let mut m = c.compile(&g).unwrap().matcher();
        m.consume(think).unwrap();
        m.consume(tok("a")).unwrap();
        let closing = shortest_completion(&m, 30).unwrap();
        assert!(completes(&m, &closing.tokens));
        // the speculative check the closer makes each step agrees, special tokens and all
        assert!(m.completed_by(&closing.tokens) && !m.completed_by(&closing.tokens[..closing.tokens.len() - 1]));
        assert_eq!(closing.tokens.first(), Some(&end_think), "{}", text(&closing.tokens));
        assert_eq!(closing.tokens.last(), Some(&end_call));
        // inside the arguments: the value, the object and the call close
        for t in [end_think, tok("\n"), call, tok("{"), tok("\"")] {
            m.consume(t).unwrap();
        }
        let closing = shortest_completion(&m, 30).unwrap();
        assert!(completes(&m, &closing.tokens));
        assert_eq!(closing.tokens.last(), Some(&end_call));
    }

    #[test]
    fn text_that_may_end_beats_a_call_its_special_token_would_open() {
        let (call, end_call) = (special("<call>"), special("</call>"));
        let lark = format!("start: /[a-z\"]+/ | <[{call}]> @args <[{end_call}]>\n");
        let g = with_json(&lark, r#"{"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}"#);
        let m = compiler().compile(&g).unwrap().matcher();
        assert_eq!(shortest_completion(&m, 30).unwrap().bytes, b"\"");
    }

    #[test]
    fn a_block_of_repeated_calls_closes_after_one() {
        // after each call, "{" (another call) is tried before "<" (the end)
        let g = with_json("start: \"<calls>\\n\" (\"{\\\"a\\\": \" @args \"}\\n\")+ \"</calls>\"\n",
                          r#"{"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}"#);
        let m = compiler().compile(&g).unwrap().matcher();
        let closing = shortest_completion(&m, 200).unwrap();
        assert_eq!(text(&closing.tokens).replace(' ', ""), "<calls>\n{\"a\":{\"b\":\"\"}}\n</calls>");
    }

    #[test]
    fn a_lazy_rule_closes_with_its_suffix() {
        let g = lark("start: \"<p>\" v \"</f>\"\nv[suffix=\"\\n</p>\\n\"]: /(?s:.*)/\n");
        let m = after(&g, "<p>ab");
        let closing = shortest_completion(&m, 30).unwrap();
        assert_eq!(closing.bytes, b"\n</p>\n</f>", "{}", text(&closing.tokens));
    }

    #[test]
    fn due_near_the_budget_and_now_and_then_before() {
        let ten = Closing { tokens: vec![0; 10], bytes: vec![b'a'; 10] };
        let mut c = Closer::default();
        c.record(ten.clone(), 200);
        assert!(!c.due(199));
        assert!(c.due(150)); // a quarter of the slack has passed
        c.record(ten, 150);
        assert!(c.due(36) && !c.due(140));
    }

    #[test]
    fn a_value_of_the_models_own_leaves_the_rest_of_the_completion() {
        let g = schema(r#"{"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"], "additionalProperties": false}"#);
        let mut m = after(&g, r#"{"n": "#);
        let c = shortest_completion(&m, 50).unwrap();
        assert!(c.bytes.starts_with(b"1"), "{:?}", String::from_utf8_lossy(&c.bytes));
        let mut closer = Closer::default();
        closer.record(c.clone(), 40);
        // the model writes 0 where the completion had 1 (01 is no number): the rest after it closes
        m.consume(tok("0")).unwrap();
        let kept = closer.still_fits(&mut m, b"0", 40).unwrap();
        assert_eq!(&kept.bytes[..], &c.bytes[1..]);
        assert!(completes(&m, &kept.tokens));
        // inside a string of its own: a quote before the rest
        let mut m = after(&g, r#"{"n": 1, "s": "ab"#);
        closer.record(shortest_completion(&after(&g, r#"{"n": 1, "#), 50).unwrap(), 40);
        let kept = closer.still_fits(&mut m, b"", 40).unwrap();
        assert!(completes(&m, &kept.tokens) && kept.bytes.starts_with(b"\""));
    }

    #[test]
    fn the_last_completion_closes_with_no_room_to_spare() {
        let g = schema(r#"{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": false}"#);
        let mut m = after(&g, r#"{"s": "a"#);
        let c = shortest_completion(&m, 50).unwrap();
        let n = c.tokens.len();
        let mut closer = Closer::default();
        closer.record(c.clone(), 40);
        // no room for a token beside it, so it no longer fits; it still closes the output
        assert!(closer.still_fits(&mut m, b"", n + 1).is_none());
        assert_eq!(closer.still_closes(&mut m, b"", n), Some(c.clone()));
        assert!(closer.still_closes(&mut m, b"", n - 1).is_none());
        // a search that missed it does not lose it; one that found a completion with room is taken
        assert_eq!(closer.closing_within(&mut m, None, b"", n), Some(c.clone()));
        let roomy = Closing { tokens: c.tokens[..1].to_vec(), bytes: c.bytes[..1].to_vec() };
        assert_eq!(closer.closing_within(&mut m, Some(roomy.clone()), b"", n), Some(roomy));
        // none was ever found: nothing is kept
        closer.record_miss(n);
        assert_eq!(closer.closing_within(&mut m, None, b"", n), None);
    }

    #[test]
    fn the_last_completion_is_kept_while_it_works() {
        let g = schema(r#"{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": false}"#);
        let mut m = after(&g, r#"{"s": "a"#);
        let c = shortest_completion(&m, 50).unwrap();
        let mut closer = Closer::default();
        closer.record(c.clone(), 40);
        m.consume(tok("b")).unwrap(); // still inside the string
        assert_eq!(closer.still_fits(&mut m, b"b", 40), Some(c.clone()));
        m.consume(tok("\"")).unwrap(); // the string closed: what is left of it
        let rest = closer.still_fits(&mut m, b"\"", 40).unwrap();
        assert_eq!(&rest.bytes[..], &c.bytes[1..]);
        assert!(closer.still_fits(&mut m, b"\"", rest.tokens.len() + 1).is_none()); // no room to spare
    }
}
