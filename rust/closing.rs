//! Output that is never cut mid-structure: the shortest completion the
//! grammar accepts from a matcher's state, and when to look for it.
//!
//! The search runs on a copy of the matcher, one byte token at a time
//! (depth-first, closers and minimal values first, bytes the grammar forces
//! taken in one go), then retokenizes the bytes into as few tokens as the
//! vocabulary allows. Whatever it returns the grammar has accepted, token by
//! token, and ends in an accepting state: a completion that is a few tokens
//! longer than the optimum is possible, an invalid one is not.

use crate::grammar::GrammarMatcher;

/// Bytes tried first at each point: closers, then the shortest values
/// (`1`, `""`: `1` rather than `0`, which a format may refuse, as year
/// 0000), separators; letters and digits next; whitespace last, so it
/// is only used where the grammar requires it.
const FIRST: &[u8] = b"\"}],:1tfn[{";

/// Byte pushes one search may try (a bound on its cost; about 1 µs each).
const MAX_TRIES: usize = 6000;
/// Alternatives explored below one point before the search backs out of it.
const MAX_CHILDREN: usize = 3;
/// The longest completion searched for, in bytes.
pub const MAX_BYTES: usize = 4096;

/// The order in which bytes are tried.
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

/// The single-byte tokens of the vocabulary, in the order they are tried.
struct ByteTokens<'a> {
    order: Vec<(u8, u32)>,
    by_byte: &'a crate::grammar::ByteTokens,
}

impl<'a> ByteTokens<'a> {
    fn new(m: &'a GrammarMatcher) -> Option<Self> {
        let by_byte = m.byte_tokens();
        let order = byte_order().into_iter().filter_map(|b| by_byte[b as usize].map(|t| (b, t))).collect::<Vec<_>>();
        (!order.is_empty()).then_some(ByteTokens { order, by_byte })
    }

    fn tokens(&self, bytes: &[u8]) -> Option<Vec<u32>> {
        bytes.iter().map(|&b| self.by_byte[b as usize]).collect()
    }
}

struct Search<'a> {
    m: GrammarMatcher,
    bytes: &'a ByteTokens<'a>,
    path: Vec<u8>,
    best: Option<Vec<u8>>,
    tries: usize,
    /// Tries allowed: MAX_TRIES, then, once a completion is found, a little
    /// more than it took (looking for a shorter one).
    max_tries: usize,
}

impl Search<'_> {
    /// The longest `path` may get before this branch is abandoned.
    fn bound(&self, limit: usize) -> usize {
        self.best.as_ref().map_or(limit, |b| b.len().saturating_sub(1))
    }

    fn run(&mut self, limit: usize) {
        if self.m.is_accepting() {
            if self.best.is_none() {
                self.max_tries = self.max_tries.min(2 * self.tries + 100);
            }
            self.best = Some(self.path.clone());
            return;
        }
        if self.path.len() >= self.bound(limit) || self.tries >= self.max_tries {
            return;
        }
        // What the grammar forces is taken whole: no branching there.
        let forced = self.m.forced_bytes();
        if !forced.is_empty() {
            self.push_forced(&forced, limit);
            return;
        }
        // Content bytes among the last three written are tried last:
        // repeating them is how a depth-first search dives into a string or
        // number that never ends (closers may repeat: `]]}`).
        let recent = &self.path[self.path.len().saturating_sub(3)..];
        let stale = |b: u8| !b"\"}]".contains(&b) && recent.contains(&b);
        let order = self.bytes.order.iter().filter(|(b, _)| !stale(*b));
        let order: Vec<(u8, u32)> = order.chain(self.bytes.order.iter().filter(|(b, _)| stale(*b))).copied().collect();
        let mut children = 0;
        for (b, t) in order {
            if self.tries >= self.max_tries || children >= MAX_CHILDREN || self.path.len() >= self.bound(limit) {
                return;
            }
            self.tries += 1;
            if self.m.try_consume(&[t]) != Ok(1) {
                continue;
            }
            children += 1;
            self.path.push(b);
            self.run(limit);
            self.path.pop();
            if self.m.rollback(1).is_err() {
                self.max_tries = 0; // the copy is broken: stop
            }
        }
    }

    fn push_forced(&mut self, forced: &[u8], limit: usize) {
        let Some(toks) = self.bytes.tokens(forced) else { return };
        self.tries += forced.len();
        let n = self.m.try_consume(&toks).unwrap_or(0);
        self.path.extend_from_slice(&forced[..n]);
        if n == toks.len() {
            self.run(limit);
        }
        self.path.truncate(self.path.len() - n);
        if self.m.rollback(n).is_err() {
            self.max_tries = 0;
        }
    }
}

/// A completion: its tokens, and the bytes they stand for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Closing {
    pub tokens: Vec<u32>,
    pub bytes: Vec<u8>,
}

/// The shortest completion found from `m`'s state that the grammar accepts:
/// empty when `m` already accepts; None when none of at most `max_tokens`
/// tokens was found.
pub fn shortest_completion(m: &GrammarMatcher, max_tokens: usize) -> Option<Closing> {
    if m.error().is_some() {
        return None;
    }
    let bytes = ByteTokens::new(m)?;
    let limit = max_tokens.saturating_mul(8).min(MAX_BYTES);
    let mut s = Search { m: m.clone(), bytes: &bytes, path: Vec::new(), best: None, tries: 0, max_tries: MAX_TRIES };
    s.run(limit);
    let best = s.best?;
    // Fewer tokens for the same bytes where the grammar takes them.
    let tokens = match m.fewest_tokens(&best) {
        Some(t) if completes(m, &t) => t,
        _ => bytes.tokens(&best)?,
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
    }

    /// The last completion, or what is left of it after `appended` (bytes
    /// just written that begin it), where it still completes `m` with room
    /// to spare: a cheap check that spares most searches (the model writing
    /// on inside a string leaves its completion as it was).
    pub fn still_fits(&self, m: &GrammarMatcher, appended: &[u8], remaining: usize) -> Option<Closing> {
        let last = &self.last;
        let fits = |c: &Closing| c.tokens.len() + 1 < remaining && completes(m, &c.tokens);
        if !last.tokens.is_empty() && fits(last) {
            return Some(last.clone());
        }
        let rest = last.bytes.strip_prefix(appended).filter(|r| !appended.is_empty() && !r.is_empty())?;
        let c = Closing { tokens: m.fewest_tokens(rest)?, bytes: rest.to_vec() };
        fits(&c).then_some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::testing::*;
    use crate::grammar::GrammarCompiler;

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
    fn the_last_completion_is_kept_while_it_works() {
        let g = schema(r#"{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": false}"#);
        let mut m = after(&g, r#"{"s": "a"#);
        let c = shortest_completion(&m, 50).unwrap();
        let mut closer = Closer::default();
        closer.record(c.clone(), 40);
        m.consume(tok("b")).unwrap(); // still inside the string
        assert_eq!(closer.still_fits(&m, b"b", 40), Some(c.clone()));
        m.consume(tok("\"")).unwrap(); // the string closed: what is left of it
        let rest = closer.still_fits(&m, b"\"", 40).unwrap();
        assert_eq!(&rest.bytes[..], &c.bytes[1..]);
        assert!(closer.still_fits(&m, b"\"", rest.tokens.len() + 1).is_none()); // no room to spare
    }
}
