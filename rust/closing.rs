//! Output that is never cut mid-structure: the shortest completion the
//! grammar accepts from a matcher's state, and when to look for it.
//!
//! The search runs on a copy of the matcher (depth-first, closers and
//! minimal values first, what the grammar forces taken in one go). Each
//! step is a single-byte token, a special token the grammar names (the end
//! of a reasoning block, of a call, of the calls block) or a suffix that
//! ends a lazy rule (see [`crate::grammar::Hints`]), so a whole chat answer
//! closes as a JSON value does. The bytes found are then retokenized into as
//! few tokens as the vocabulary allows. Whatever it returns the grammar has
//! accepted, token by token, and ends in an accepting state: a completion a
//! few tokens longer than the optimum is possible, an invalid one is not.

use crate::grammar::GrammarMatcher;

/// Bytes tried first at each point: closers (`<` opens a closing tag:
/// `</tool_calls>`), then the shortest values (`1`, `""`: `1` rather than
/// `0`, which a format may refuse, as year 0000), separators; letters and
/// digits next; whitespace last, so it is only used where the grammar
/// requires it.
const FIRST: &[u8] = b"\"}],:1tfn<[{";

/// Steps one search may try (a bound on its cost; about 1 µs each).
const MAX_TRIES: usize = 6000;
/// Alternatives explored below one point before the search backs out of it.
const MAX_CHILDREN: usize = 3;
/// The longest completion searched for, in bytes.
pub const MAX_BYTES: usize = 4096;
/// The bound of the first, shorter search.
const SHORT_BYTES: usize = 512;
/// How a special token is written among bytes (toktrie's raw form:
/// `0xff` `[id]`), so one byte string holds a whole completion.
const MARKER: u8 = 0xff;

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

    /// One token per byte, special tokens (`0xff[id]`) as themselves.
    fn tokens(&self, bytes: &[u8]) -> Option<Vec<u32>> {
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if let Some((len, t)) = special_at(&bytes[i..]) {
                out.push(t);
                i += len;
            } else {
                out.push(self.by_byte[bytes[i] as usize]?);
                i += 1;
            }
        }
        Some(out)
    }
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

/// Where the innermost object still open in `path` starts (0 when it opened before the path).
fn open_object(path: &[u8], in_string: bool) -> usize {
    let (mut depth, mut in_string, mut escaped) = (0usize, in_string, false);
    let mut starts = vec![0];
    for (i, &b) in path.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_string => escaped = true,
            b'"' => in_string = !in_string,
            _ if in_string => {}
            b'{' | b'[' => {
                depth += 1;
                starts.push(i);
            }
            b'}' | b']' if depth > 0 => {
                depth -= 1;
                starts.pop();
            }
            b'}' | b']' => starts = vec![i + 1],
            _ => {}
        }
    }
    *starts.last().unwrap_or(&0)
}

/// The last key (quotes included) written at the top level of `object`, and where it starts;
/// `object` starts at its `{` (or inside it, where the object opened before the path).
fn last_key(object: &[u8], in_string: bool) -> Option<(usize, Vec<u8>)> {
    let (mut depth, mut in_string, mut escaped, mut start) = (0usize, in_string, false, 0);
    let top = usize::from(object.first() == Some(&b'{'));
    let mut key = None;
    for (i, &b) in object.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_string => escaped = true,
            b'"' if in_string => {
                in_string = false;
                let rest = object[i + 1..].iter().find(|c| !c.is_ascii_whitespace());
                if depth == top && rest == Some(&b':') {
                    key = Some((start, object[start..=i].to_vec()));
                }
            }
            b'"' => {
                in_string = true;
                start = i;
            }
            _ if in_string => {}
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    key
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

struct Search<'a> {
    m: GrammarMatcher,
    bytes: &'a ByteTokens<'a>,
    hints: std::sync::Arc<crate::grammar::Hints>,
    path: Vec<u8>,
    best: Option<Vec<u8>>,
    tries: usize,
    /// Tries allowed: MAX_TRIES, then, once a completion is found, a little
    /// more than it took (looking for a shorter one).
    max_tries: usize,
    /// Abandon a branch that has written a key its object takes again (an additional key).
    listed_keys_only: bool,
    /// Where such a key starts in `path`: everything below it is abandoned.
    abandon: Option<usize>,
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
            // (forced bytes may have taken this path past the bound)
            if self.best.as_ref().is_none_or(|b| self.path.len() < b.len()) {
                self.best = Some(self.path.clone());
            }
            return;
        }
        if self.path.len() >= self.bound(limit) || self.tries >= self.max_tries {
            return;
        }
        // What the grammar forces is taken whole: no branching there.
        let forced = self.m.forced_bytes();
        if !forced.is_empty() {
            if let Some(toks) = self.bytes.tokens(&forced) {
                self.child(&forced, &toks, limit);
                return;
            }
        }
        // At the start, one step that ends it all (text that may end here,
        // a closer) before any branch dives: a special token tried first
        // may open a call where a single byte of text would have done.
        if self.path.is_empty() && self.ends_in_one_step() {
            return;
        }
        let mut children = 0;
        // Special tokens and suffixes first: they end what is open.
        let hints = self.hints.clone();
        for &t in &hints.specials {
            let bytes = self.m.bytes_of(&[t]);
            if self.try_child(&bytes, &[t], limit, &mut children) {
                return;
            }
        }
        for suffix in &hints.suffixes {
            if self.try_whole(suffix, limit, &mut children) {
                return;
            }
        }
        // Where a key may start, the keys the grammar lists: one byte at a time the search
        // would write additional keys (`"":1,"":1,...`) and never the required ones.
        let last = self.path.iter().rev().find(|b| !b.is_ascii_whitespace()).copied();
        // where a key may start: the innermost open object, read once for both uses below
        let object = matches!(last, None | Some(b'{' | b',')).then(|| {
            let in_string = starts_in_string(&self.path);
            (open_object(&self.path, in_string), in_string)
        });
        if let (true, Some((start, in_string))) = (self.listed_keys_only && last == Some(b','), object) {
            if let Some(at) = self.additional_key(start, in_string) {
                self.abandon = Some(at);
                return;
            }
        }
        if self.path.is_empty() {
            // inside a key already begun (`{"`): the keys without their opening quote
            for key in &hints.keys {
                if self.try_whole(&[&key[1..], b":"].concat(), limit, &mut 0) {
                    return;
                }
            }
        }
        if let Some((start, _)) = object {
            // Which keys this object lists and which it would take as additional is not known
            // here (an additional key is abandoned at the next comma). Each is tried with the
            // key separator, so that at the start a string value does not take it.
            if last == Some(b'{') {   // an object that may stay empty: closed first
                if let Some(t) = self.bytes.by_byte[b'}' as usize] {
                    if self.try_child(b"}", &[t], limit, &mut children) {
                        return;
                    }
                }
            }
            for key in &hints.keys {
                // a key this object already has would be another object's, written as additional
                let written = self.path[start..].windows(key.len()).any(|w| w == &key[..]);
                if !written && self.try_whole(&[&key[..], b":"].concat(), limit, &mut 0) {
                    return;
                }
            }
        }
        // Content bytes among the last three written are tried last:
        // repeating them is how a depth-first search dives into a string or
        // number that never ends (closers may repeat: `]]}`).
        let recent = &self.path[self.path.len().saturating_sub(3)..];
        let stale = |b: u8| !b"\"}]".contains(&b) && recent.contains(&b);
        let order = self.bytes.order.iter().filter(|(b, _)| !stale(*b));
        let order: Vec<(u8, u32)> = order.chain(self.bytes.order.iter().filter(|(b, _)| stale(*b))).copied().collect();
        // Pattern examples where a string may start, right after the
        // string's own closer (an empty string) was tried; never after one
        // another (inside a free string that would dive forever).
        let examples = if matches!(self.path.last(), None | Some(b'"')) { &hints.examples[..] } else { &[] };
        for (i, (b, t)) in order.into_iter().enumerate() {
            // whitespace only where nothing else goes on (a grammar that requires it): a run
            // of optional whitespace before each of the other children multiplies the search
            if b.is_ascii_whitespace() && children > 0 {
                continue;
            }
            if self.try_child(&[b], &[t], limit, &mut children) {
                return;
            }
            if i == 0 && examples.iter().any(|e| self.try_whole(e, limit, &mut children)) {
                return;
            }
        }
    }

    /// Where the last key written in the innermost open object of `path` (which starts at
    /// `start`) starts, if the object would take it again: a listed key is taken once, so it
    /// was an additional one.
    fn additional_key(&mut self, start: usize, in_string: bool) -> Option<usize> {
        let (at, key) = last_key(&self.path[start..], in_string && start == 0)?;
        let toks = self.bytes.tokens(&key)?;
        self.tries += toks.len();
        let n = self.m.try_consume(&toks).unwrap_or(0);
        if n > 0 && self.m.rollback(n).is_err() {
            self.max_tries = 0;
        }
        (n == toks.len()).then_some(start + at)
    }

    /// [`Self::try_child`] for a string of bytes taken whole.
    fn try_whole(&mut self, bytes: &[u8], limit: usize, children: &mut usize) -> bool {
        match self.bytes.tokens(bytes) {
            Some(toks) => self.try_child(bytes, &toks, limit, children),
            None => false,
        }
    }

    /// Whether a special token or a closer byte takes the matcher to an
    /// accepting state; if so it is the best completion below this point.
    fn ends_in_one_step(&mut self) -> bool {
        let closers = FIRST.iter().filter_map(|&b| self.bytes.by_byte[b as usize].map(|t| (vec![b], t)));
        let specials = self.hints.specials.iter().map(|&t| (self.m.bytes_of(&[t]), t));
        let steps: Vec<(Vec<u8>, u32)> = specials.chain(closers).collect();
        for (bytes, t) in steps {
            self.tries += 1;
            if self.m.try_consume(&[t]) != Ok(1) {
                continue;
            }
            let accepting = self.m.is_accepting();
            if self.m.rollback(1).is_err() {
                self.max_tries = 0;
                return false;
            }
            if accepting {
                self.best = Some([&self.path[..], &bytes].concat());
                return true;
            }
        }
        false
    }

    /// Explore below `bytes` (`toks`) where the grammar takes them; true
    /// when this point has been explored enough.
    fn try_child(&mut self, bytes: &[u8], toks: &[u32], limit: usize, children: &mut usize) -> bool {
        match self.abandon {
            Some(at) if self.path.len() > at => return true,   // still below an additional key
            Some(_) => self.abandon = None,
            None => {}
        }
        if self.tries >= self.max_tries || *children >= MAX_CHILDREN || self.path.len() >= self.bound(limit) {
            return true;
        }
        let taken = self.child(bytes, toks, limit);
        if self.abandon == Some(self.path.len()) {
            self.abandon = None;    // the child wrote an additional key: it does not count
        } else if taken {
            *children += 1;
        }
        false
    }

    /// Take `toks` (written `bytes`) and search on from there; false when
    /// the grammar does not take them all.
    fn child(&mut self, bytes: &[u8], toks: &[u32], limit: usize) -> bool {
        self.tries += toks.len();
        let n = self.m.try_consume(toks).unwrap_or(0);
        let whole = n == toks.len();
        if whole {
            self.path.extend_from_slice(bytes);
            self.run(limit);
            self.path.truncate(self.path.len() - bytes.len());
        }
        if n > 0 && self.m.rollback(n).is_err() {
            self.max_tries = 0; // the copy is broken: stop
        }
        whole
    }
}

/// A completion: its tokens, and the bytes they stand for (special tokens
/// as `0xff[id]`, as [`GrammarMatcher::bytes_of`] writes them).
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
    // A short bound first: a branch that repeats (one more call, one more
    // item) is then cut early instead of using up every try.
    // Additional keys are never needed to complete an object, so the search first leaves
    // them out (a key of another object would otherwise be written as one); then with them.
    let runs = [(limit.min(SHORT_BYTES), true), (limit, true), (limit, false)];
    let best = runs.into_iter().find_map(|(bound, listed_keys_only)| {
        let mut s = Search { m: m.clone(), bytes: &bytes, hints: m.hints(), path: Vec::new(), best: None,
                             tries: 0, max_tries: MAX_TRIES, listed_keys_only, abandon: None };
        s.run(bound);
        s.best
    })?;
    // Fewer tokens for the same bytes where the grammar takes them.
    let tokens = match fewest_tokens(m, &best) {
        Some(t) if completes(m, &t) => t,
        _ => bytes.tokens(&best)?,
    };
    (tokens.len() <= max_tokens).then_some(Closing { tokens, bytes: best })
}

/// Whether `path` (JSON text) starts inside a string begun before it: the reading under which
/// fewer bytes outside strings are ones JSON never has there (letters other than those of
/// true, false, null and exponents).
fn starts_in_string(path: &[u8]) -> bool {
    let stray = |in_string: bool| {
        let (mut in_string, mut escaped, mut count) = (in_string, false, 0);
        for &b in path {
            match b {
                _ if escaped => escaped = false,
                b'\\' if in_string => escaped = true,
                b'"' => in_string = !in_string,
                _ if in_string => {}
                b if b.is_ascii_alphabetic() && !b"truefalsnE".contains(&b) => count += 1,
                _ => {}
            }
        }
        count
    };
    stray(true) < stray(false)
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
    /// just written that begin it), where it still completes `m` with room
    /// to spare: a cheap check that spares most searches (the model writing
    /// on inside a string leaves its completion as it was).
    pub fn still_fits(&self, m: &mut GrammarMatcher, appended: &[u8], remaining: usize) -> Option<Closing> {
        let last = &self.last;
        if last.tokens.is_empty() && remaining > 1 && m.is_accepting() {
            return Some(Closing::default()); // no copy of the matcher needed
        }
        let fits = |c: &Closing| c.tokens.len() + 1 < remaining && completes(m, &c.tokens);
        if fits(last) {
            return Some(last.clone());
        }
        let rest = last.bytes.strip_prefix(appended).filter(|r| !appended.is_empty() && !r.is_empty())?;
        let c = Closing { tokens: fewest_tokens(m, rest)?, bytes: rest.to_vec() };
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
            assert_eq!(text(&c.tokens), want, "after {prefix}");
        }
    }

    #[test]
    fn hints_read_listed_keys_and_the_patterns_of_embedded_schemas() {
        let c = compiler();
        let m = c.compile(&lark(ANY_ORDER)).unwrap().matcher();
        let h = m.hints();
        assert_eq!(h.keys, vec![b"\"zeta\"".to_vec(), b"\"b\"".to_vec(), b"\"c\"".to_vec()]);
        assert_eq!(h.examples, vec![b"000".to_vec()]);
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
