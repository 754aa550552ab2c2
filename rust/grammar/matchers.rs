//! Grammar-constrained decoding on top of llguidance: the tokenizer
//! environment (built once per model), a compile cache shared by all
//! requests, and one matcher per constrained sequence.
//!
//! Every llguidance call goes through [`guard`]: an error or a panic inside
//! llguidance becomes an `Err(String)` for that one request (DESIGN rule 12).

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{ParserFactory, TokenParser};

/// Canonical tokenization of a string (the model's own tokenizer). Forced
/// bytes are turned into tokens with it, so that fast-forwarded tokens are
/// the ones the model would see for that text. None: it failed (greedy
/// longest-match tokenization is used instead).
pub type TokenizeFn = Arc<dyn Fn(&str) -> Option<Vec<u32>> + Send + Sync>;

/// Run an llguidance call; errors and panics become a message.
fn guard<T>(f: impl FnOnce() -> anyhow_like::Result<T>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(panic_message(&p)),
    }
}

/// llguidance returns `anyhow::Result`; we only need its Display.
mod anyhow_like {
    pub type Result<T> = std::result::Result<T, Box<dyn std::fmt::Display>>;

    pub fn wrap<T, E: std::fmt::Display + 'static>(r: std::result::Result<T, E>) -> Result<T> {
        r.map_err(|e| Box::new(e) as Box<dyn std::fmt::Display>)
    }
}
use anyhow_like::wrap;

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    let msg = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error in the grammar engine: {msg}")
}

/// The model's vocabulary as llguidance sees it.
struct Env {
    trie: TokTrie,
    tokenize: Option<TokenizeFn>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match &self.tokenize {
            Some(f) => self.trie.tokenize_with_greedy_fallback(s, |s| {
                f(s).unwrap_or_else(|| self.trie.greedy_tokenize(s.as_bytes()))
            }),
            None => self.trie.greedy_tokenize(s),
        }
    }

    // Without a tokenizer, greedy longest-match stands in for it: good
    // enough for forcing (the grammar accepts any tokenization of the bytes).
    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

/// Words of one mask row: ceil(vocab / 32).
pub fn mask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Compiles grammars for one model; compiled grammars are kept in an LRU
/// cache keyed by the grammar text (failures too, so a bad grammar sent
/// again fails fast).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    byte_tokens: Arc<ByteTokens>,
    cache: Mutex<Lru>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: usize,
    pub misses: usize,
    pub size: usize,
    pub capacity: usize,
}

type Compiled = Result<Grammar, String>;

struct Lru {
    map: HashMap<String, Compiled>,
    order: VecDeque<String>,
    capacity: usize,
    hits: usize,
    misses: usize,
}

impl Lru {
    fn get(&mut self, key: &str) -> Option<Compiled> {
        let v = self.map.get(key)?.clone();
        if let Some(i) = self.order.iter().position(|k| k == key) {
            let k = self.order.remove(i).expect("index is in range");
            self.order.push_back(k);
        }
        Some(v)
    }

    fn put(&mut self, key: String, v: Compiled) {
        if self.capacity == 0 {
            return;
        }
        if self.map.insert(key.clone(), v).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

impl GrammarCompiler {
    /// `token_bytes[i]` is what token i stands for; special tokens are given
    /// as `0xff` followed by their text. `vocab_size` may exceed the list
    /// (a padded embedding): the extra ids are never allowed.
    pub fn new(
        token_bytes: Vec<Vec<u8>>,
        end_token_ids: &[u32],
        vocab_size: usize,
        cache_size: usize,
        tokenize: Option<TokenizeFn>,
    ) -> Result<Self, String> {
        if token_bytes.len() > vocab_size {
            return Err(format!("{} token strings for a vocabulary of {vocab_size}", token_bytes.len()));
        }
        if end_token_ids.is_empty() {
            return Err("at least one end token is needed: a grammar could never end".into());
        }
        if let Some(t) = end_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!("end token {t} is outside the vocabulary of {vocab_size}"));
        }
        let mut words = token_bytes;
        words.resize(vocab_size, Vec::new());
        let byte_tokens = Arc::new(byte_tokens(&words, end_token_ids));
        let factory = guard(|| {
            let info = TokRxInfo::new(vocab_size as u32, end_token_ids[0]);
            let trie = TokTrie::from(&info, &words).with_eos_tokens(end_token_ids);
            let env: TokEnv = Arc::new(Env { trie, tokenize });
            let mut caps = InferenceCapabilities::default();
            caps.ff_tokens = true;
            let slices = llguidance::earley::SlicedBiasComputer::general_slices();
            let mut f = wrap(ParserFactory::new(&env, caps, &slices))?;
            f.quiet();
            Ok(f)
        })?;
        let cache = Lru {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity: cache_size,
            hits: 0,
            misses: 0,
        };
        Ok(GrammarCompiler { factory: Arc::new(factory), vocab_size, byte_tokens, cache: Mutex::new(cache) })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Compile a llguidance TopLevelGrammar (JSON) or a bare Lark grammar.
    pub fn compile(&self, grammar: &str) -> Result<Grammar, String> {
        {
            let mut cache = self.lock();
            if let Some(hit) = cache.get(grammar) {
                cache.hits += 1;
                return hit;
            }
        }
        // Compiled outside the lock: a slow grammar does not hold up others.
        let compiled = self.compile_uncached(grammar);
        let mut cache = self.lock();
        cache.misses += 1;
        cache.put(grammar.to_string(), compiled.clone());
        compiled
    }

    fn compile_uncached(&self, text: &str) -> Result<Grammar, String> {
        let factory = &self.factory;
        let (parser, hints) = guard(|| {
            let top = wrap(TopLevelGrammar::from_lark_or_grammar_list(text))?;
            let hints = Hints::of(&top);
            let mut parser = wrap(factory.create_parser(top))?;
            if parser.is_fresh() {
                parser.start_without_prompt();
            }
            Ok((parser, hints))
        })?;
        if let Some(e) = parser.error_message() {
            return Err(e);
        }
        let shared = Shared { byte_tokens: self.byte_tokens.clone(), hints: Arc::new(hints) };
        Ok(Grammar { proto: Arc::new(Mutex::new(parser)), vocab_size: self.vocab_size, shared, starts: Default::default() })
    }

    pub fn cache_stats(&self) -> CacheStats {
        let c = self.lock();
        CacheStats { hits: c.hits, misses: c.misses, size: c.map.len(), capacity: c.capacity }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A compiled grammar: a fresh matcher to copy for each request.
#[derive(Clone)]
pub struct Grammar {
    proto: Arc<Mutex<TokenParser>>,
    vocab_size: usize,
    shared: Shared,
    /// The first closing search of each request starts from the same state
    /// for every request of this grammar (crate::grammar::closing): its result, per
    /// (tokens forced at the start, budget).
    starts: Arc<Mutex<HashMap<(usize, usize), Option<Vec<u32>>>>>,
}

/// Budgets whose first closing one grammar keeps (then it starts over).
const MAX_STARTS: usize = 64;

impl Grammar {
    pub fn matcher(&self) -> GrammarMatcher {
        let p = self.proto.lock().unwrap_or_else(|e| e.into_inner()).clone();
        GrammarMatcher { p, vocab_size: self.vocab_size, error: None, shared: self.shared.clone() }
    }

    /// `search()` for the state `key` names (tokens forced at the start,
    /// budget), run once per grammar and key.
    pub fn from_start(&self, key: (usize, usize), search: impl FnOnce() -> Option<Vec<u32>>) -> Option<Vec<u32>> {
        let lock = || self.starts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hit) = lock().get(&key) {
            return hit.clone();
        }
        let found = search();
        let mut starts = lock();
        if starts.len() >= MAX_STARTS {
            starts.clear();
        }
        starts.insert(key, found.clone());
        found
    }
}

/// What every matcher of one grammar shares.
#[derive(Clone)]
struct Shared {
    byte_tokens: Arc<ByteTokens>,
    hints: Arc<Hints>,
}

/// What the closing search (crate::grammar::closing) tries whole at each point,
/// read from the grammar: the special tokens its Lark text names (`<[id]>`:
/// the end of a reasoning block, of a call, of the calls), the suffixes
/// that end a lazy rule (`suffix="\n</parameter>\n"`) and the keys JSON
/// objects list. Only a hint: what the search takes, the parser has
/// accepted.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Hints {
    pub specials: Vec<u32>,
    pub suffixes: Vec<Vec<u8>>,
    /// JSON keys an object lists (`"name"`, quotes included): where a key starts, the search
    /// writes them before others, and refuses a key not listed in its first pass (an
    /// additional key is never needed to close an object).
    pub keys: Vec<Vec<u8>>,
    /// Those of them some object requires (tried before the others).
    pub required: Vec<Vec<u8>>,
}

/// Listed keys kept per grammar (each is tried where a key may start).
const MAX_KEYS: usize = 64;

impl Hints {
    fn of(top: &TopLevelGrammar) -> Hints {
        let mut h = Hints::default();
        for g in &top.grammars {
            if let Some(lark) = g.lark_grammar.as_deref() {
                h.read(lark);
            }
        }
        h
    }

    fn read(&mut self, lark: &str) {
        for (i, _) in lark.match_indices("<[") {
            let digits: String = lark[i + 2..].chars().take_while(|c| c.is_ascii_digit()).collect();
            let closed = lark[i + 2 + digits.len()..].starts_with("]>");
            if let (true, Ok(t)) = (closed, digits.parse::<u32>()) {
                if !self.specials.contains(&t) {
                    self.specials.push(t);
                }
            }
        }
        // a listed key: a Lark literal holding a JSON string, then the key separator (the
        // member rules of grammar/json_schema/writer.py: `"\"name\"" ":" value`)
        for (i, _) in lark.match_indices("\"\\\"") {
            let Some((text, len)) = json_literal_at(&lark[i..]) else { continue };
            let rest = lark[i + len..].trim_start();
            let is_key = text.len() >= 2 && text.starts_with('"') && text.ends_with('"')
                && (rest.starts_with("\":") || rest.starts_with("\": "));
            if is_key && self.keys.len() < MAX_KEYS && !self.keys.contains(&text.as_bytes().to_vec()) {
                self.keys.push(text.into_bytes());
            }
        }
        self.read_required(lark);
        for (i, m) in lark.match_indices("suffix=\"") {
            let s = &lark[i + m.len() - 1..];
            if let Some(text) = json_string_prefix(s) {
                if !text.is_empty() && !self.suffixes.contains(&text.as_bytes().to_vec()) {
                    self.suffixes.push(text.into_bytes());
                }
            }
        }
    }

    /// The keys an object requires, from grammar/json_schema/writer.py's
    /// object rules: `rest::_ : "" %if is_ones([0:r])` ends the object once
    /// bits 0..r-1 are set, and `| ", " member_k rest::set_bit(i)` sets bit i
    /// by writing member_k (`member_k: "\"key\"" ": " value`).
    fn read_required(&mut self, lark: &str) {
        let mut members: HashMap<&str, String> = HashMap::new();
        let mut required_members: Vec<&str> = Vec::new();
        let mut need = 0usize;
        for line in lark.lines() {
            if !line.starts_with(' ') {
                need = line.find("%if is_ones([0:").and_then(|i| {
                    line[i + 15..].split(']').next()?.parse().ok()
                }).unwrap_or(0);
                if let Some((name, body)) = line.split_once(": ") {
                    if name.starts_with("member_") {
                        if let Some((key, _)) = json_literal_at(body.trim_start()) {
                            members.insert(name, key);
                        }
                    }
                }
                continue;
            }
            let Some(at) = line.find("::set_bit(") else { continue };
            let bit: Option<usize> = line[at + 10..].split(')').next().and_then(|b| b.parse().ok());
            let member = line.split_whitespace().find(|w| w.starts_with("member_"));
            if let (Some(bit), Some(member)) = (bit, member) {
                if bit < need {
                    required_members.push(member);
                }
            }
        }
        for m in required_members {
            if let Some(key) = members.get(m) {
                if !self.required.contains(&key.as_bytes().to_vec()) {
                    self.required.push(key.as_bytes().to_vec());
                }
            }
        }
    }
}

/// The JSON string literal `s` starts with, decoded.
fn json_string_prefix(s: &str) -> Option<String> {
    json_literal_at(s).map(|(text, _)| text)
}

/// The string a JSON string literal at the start of `s` holds, and the literal's length.
fn json_literal_at(s: &str) -> Option<(String, usize)> {
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return serde_json::from_str(&s[..=i]).ok().map(|text| (text, i + 1)),
            _ => {}
        }
    }
    None
}

/// The grammar state of one sequence (llguidance's token parser, driven as
/// its `Matcher` drives it; held directly so that the closing search can
/// read the Earley parser and its lexer). Once an error is recorded the
/// matcher allows nothing and keeps the first message.
#[derive(Clone)]
pub struct GrammarMatcher {
    p: TokenParser,
    vocab_size: usize,
    error: Option<String>,
    shared: Shared,
}

/// The token of each single byte, where the vocabulary has one (end
/// tokens excluded).
pub type ByteTokens = [Option<u32>; 256];

fn byte_tokens(words: &[Vec<u8>], end_token_ids: &[u32]) -> ByteTokens {
    let mut out = [None; 256];
    for (i, w) in words.iter().enumerate() {
        if let [b] = w[..] {
            if out[b as usize].is_none() && !end_token_ids.contains(&(i as u32)) {
                out[b as usize] = Some(i as u32);
            }
        }
    }
    out
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher").field("error", &self.error).finish_non_exhaustive()
    }
}

impl GrammarMatcher {
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn words(&self) -> usize {
        mask_words(self.vocab_size)
    }

    fn fail(&mut self, msg: String) -> String {
        self.error.get_or_insert(msg).clone()
    }

    /// Run one call on the token parser: an error or a panic is recorded
    /// (the matcher then allows nothing) and returned as its message.
    fn run<T>(&mut self, f: impl FnOnce(&mut TokenParser) -> anyhow_like::Result<T>) -> Result<T, String> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let p = &mut self.p;
        match catch_unwind(AssertUnwindSafe(|| f(p))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let msg = self.p.augment_err(e);
                Err(self.fail(msg))
            }
            Err(panic) => Err(self.fail(panic_message(&panic))),
        }
    }

    /// Write the allowed-token bitmask into `out` (`words()` long): bit j of
    /// word i allows token 32·i + j. On error the row is all zero.
    pub fn fill_mask(&mut self, out: &mut [i32]) -> Result<(), String> {
        out.fill(0);
        // A stopped matcher allows only the end tokens.
        let v = self.run(|p| match p.stop_reason() {
            StopReason::NotStopped => wrap(p.compute_mask()),
            _ => Ok(p.token_env.tok_trie().eos_token_set()),
        })?;
        for (o, &w) in out.iter_mut().zip(v.as_slice()) {
            *o = w as i32;
        }
        clear_past(out, self.vocab_size);
        if out.iter().all(|&w| w == 0) {
            return Err(self.fail("the grammar allows no token here".into()));
        }
        Ok(())
    }

    /// [`fill_mask`](Self::fill_mask) at a state reached by draft tokens
    /// (engine/speculative.rs), which are rolled back after: a state there that
    /// allows nothing is not kept as the matcher's error.
    pub fn fill_draft_mask(&mut self, out: &mut [i32]) -> bool {
        let failed_before = self.error.is_some();
        let ok = self.fill_mask(out).is_ok();
        if !ok && !failed_before {
            self.error = None;
        }
        ok
    }

    /// Whether this state's mask is exactly the tokens [`allows`](Self::allows)
    /// says yes to, so that it need not be computed to check one token. Not
    /// where bytes are forced: llguidance's mask then holds only the tokens
    /// of their canonical tokenization (or that begin with its last, partial
    /// token), where the parser would take any token of them. Not once the
    /// matcher stopped or failed either (its mask is then the end tokens, or
    /// nothing with its error).
    pub fn mask_is_checkable(&mut self) -> bool {
        if self.is_stopped() {
            return false;
        }
        let p = &self.p;
        // llguidance's TokenParser::can_force_bytes: only then does its mask force bytes as
        // forced_bytes() computes them.
        let forces = !p.parser.grammar().lexer_spec().no_forcing && p.token_env.tokenize_is_canonical();
        forces && self.forced_bytes().is_empty() && !self.is_stopped()
    }

    /// Whether the mask at this state allows `token`, checked without
    /// computing the mask: exact where [`mask_is_checkable`](Self::mask_is_checkable)
    /// (the parser takes the token's bytes, or it is an end token where the
    /// grammar may end). Nothing changes, unless llguidance fails here,
    /// which is then the matcher's error, as the mask's would be.
    pub fn allows(&mut self, token: u32) -> bool {
        (token as usize) < self.vocab_size.min(self.trie().vocab_size())
            && self.run(|p| wrap(p.validate_token(token))).unwrap_or(false)
    }

    pub fn compute_mask(&mut self) -> (Vec<i32>, Option<String>) {
        let mut out = vec![0i32; self.words()];
        let err = self.fill_mask(&mut out).err();
        (out, err)
    }

    /// Advance by one token; Err if the grammar rejects it.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        self.run(|p| {
            consume_one(p, token)?;
            wrap(p.check_stop()).map(|_| ())
        })
    }

    /// Consume as many of `tokens` as the grammar accepts, stopping at the
    /// first it rejects (which leaves the state as it was, not in error).
    pub fn try_consume(&mut self, tokens: &[u32]) -> Result<usize, String> {
        self.run(|p| {
            for (i, &t) in tokens.iter().enumerate() {
                if !wrap(p.validate_token(t))? {
                    return Ok(i);
                }
                consume_one(p, t)?;
                wrap(p.check_stop())?;
            }
            Ok(tokens.len())
        })
    }

    /// Consume all of `tokens` (sampled under this grammar's mask, or forced
    /// by it). Each is checked first, so a rejected one leaves the state
    /// intact; one the check refuses but the parser takes (an end token the
    /// grammar names, which the check treats as end-of-output) is consumed
    /// directly. Returns how many were consumed before a rejection.
    pub fn advance(&mut self, tokens: &[u32]) -> Result<usize, String> {
        let mut done = 0;
        while done < tokens.len() {
            done += self.try_consume(&tokens[done..])?;
            if done < tokens.len() {
                if self.consume(tokens[done]).is_err() {
                    return Ok(done);
                }
                done += 1;
            }
        }
        Ok(done)
    }

    /// Tokens the grammar forces next (also caches them for the next mask,
    /// so the mask thread need not tokenize).
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        self.run(|p| Ok(p.compute_ff_tokens())).unwrap_or_default()
    }

    pub fn is_accepting(&mut self) -> bool {
        self.run(|p| Ok(p.is_accepting())).unwrap_or(false)
    }

    /// True once the grammar cannot go on (completed or failed).
    pub fn is_stopped(&self) -> bool {
        self.error.is_some() || self.p.stop_reason() != StopReason::NotStopped
    }

    pub fn error(&self) -> Option<String> {
        self.error.clone()
    }

    /// Whether `tokens` take the grammar to a state that may end, checked
    /// speculatively on this state (no copy, nothing consumed): the tokens
    /// and an end token after them are all accepted.
    pub fn completed_by(&mut self, tokens: &[u32]) -> bool {
        let Some(&end) = self.trie().eos_tokens().first() else { return false };
        if tokens.is_empty() {
            return self.is_accepting();
        }
        let with_end: Vec<u32> = tokens.iter().copied().chain([end]).collect();
        self.run(|p| wrap(p.validate_tokens_raw(&with_end))) == Ok(with_end.len())
    }

    pub fn rollback(&mut self, n: usize) -> Result<(), String> {
        self.run(|p| wrap(p.rollback(n)))
    }

    /// Bytes the grammar forces next (any tokenization of them is accepted).
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        self.run(|p| Ok(p.force_bytes())).unwrap_or_default()
    }

    /// The bytes of `tokens` (special tokens as 0xff and their name).
    pub fn bytes_of(&self, tokens: &[u32]) -> Vec<u8> {
        self.trie().decode_raw(tokens)
    }

    pub fn trie(&self) -> &TokTrie {
        self.p.token_env.tok_trie()
    }

    /// A copy of the Earley parser at this state, with a lexer of its own
    /// (for the closing search, which moves it byte by byte and explores
    /// its automaton: a lexer out of fuel or states there is the search's
    /// loss alone, never that of the requests sharing the grammar); None
    /// once the matcher failed.
    pub fn earley(&self) -> Option<llguidance::earley::Parser> {
        self.error.is_none().then(|| self.p.parser.deep_clone())
    }

    /// The single-byte tokens of the vocabulary.
    pub fn byte_tokens(&self) -> &ByteTokens {
        &self.shared.byte_tokens
    }

    /// What the closing search tries whole (see [`Hints`]).
    pub fn hints(&self) -> Arc<Hints> {
        self.shared.hints.clone()
    }

    /// `bytes` in as few (non-special) tokens as the vocabulary allows.
    pub fn fewest_tokens(&self, bytes: &[u8]) -> Option<Vec<u32>> {
        let trie = self.trie();
        // best[i]: the fewest tokens for bytes[..i], and the last of them.
        let mut best: Vec<Option<(usize, u32)>> = vec![None; bytes.len() + 1];
        best[0] = Some((0, 0));
        for i in 0..bytes.len() {
            let Some((n, _)) = best[i] else { continue };
            for t in trie.all_prefixes(&bytes[i..]) {
                let j = i + trie.token_len(t);
                if trie.is_special_token(t) || j == i || j > bytes.len() {
                    continue;
                }
                if best[j].is_none_or(|(m, _)| n + 1 < m) {
                    best[j] = Some((n + 1, t));
                }
            }
        }
        let mut out = Vec::new();
        let mut i = bytes.len();
        while i > 0 {
            let (_, t) = best[i]?;
            out.push(t);
            i -= trie.token_len(t);
        }
        out.reverse();
        Some(out)
    }
}

/// One token into the parser, as llguidance's `Matcher` takes it (no backtracking).
fn consume_one(p: &mut TokenParser, token: u32) -> anyhow_like::Result<()> {
    let backtrack = wrap(p.consume_token(token))?;
    if backtrack != 0 {
        return Err(Box::new(format!("unexpected backtracking by {backtrack} tokens")));
    }
    Ok(())
}

/// Bits for token ids >= vocab_size are never set.
fn clear_past(out: &mut [i32], vocab_size: usize) {
    let full = vocab_size / 32;
    if full < out.len() {
        let rem = vocab_size % 32;
        out[full] &= if rem == 0 { 0 } else { ((1u32 << rem) - 1) as i32 };
        out[full + 1..].fill(0);
    }
}

/// Fast-forward stops after this many rounds of forced tokens; the rest is
/// sampled (a bound against a grammar that keeps forcing).
pub const MAX_FF_ROUNDS: usize = 64;

/// A tiny vocabulary for unit tests here and in the scheduler.
#[cfg(test)]
pub mod testing {

    /// Single bytes a-z, digits, punctuation, a few multi-byte tokens and an
    /// end token (the last).
    pub fn vocab() -> (Vec<Vec<u8>>, u32) {
        let mut words: Vec<Vec<u8>> = Vec::new();
        for b in b"abcdefghijklmnopqrstuvwxyz0123456789{}[]\":, \n-." {
            words.push(vec![*b]);
        }
        for w in ["\"name\"", "\"age\"", "true", "false", "null", "yes", "no", "<", ">", "/", "="] {
            words.push(w.as_bytes().to_vec());
        }
        for w in ["<think>", "</think>", "<call>", "</call>"] {
            words.push([b"\xff", w.as_bytes()].concat());
        }
        words.push(b"\xff<|end|>".to_vec());
        let eos = words.len() as u32 - 1;
        (words, eos)
    }

    /// The id of a token of [`vocab`].
    pub fn tok(s: &str) -> u32 {
        let (words, _) = vocab();
        words.iter().position(|w| w == s.as_bytes()).unwrap() as u32
    }

    /// The id of a special token of [`vocab`] (`<call>`, ...).
    pub fn special(s: &str) -> u32 {
        let (words, _) = vocab();
        let want = [b"\xff", s.as_bytes()].concat();
        words.iter().position(|w| *w == want).unwrap() as u32
    }

    pub fn lark(body: &str) -> String {
        format!("{{\"grammars\": [{{\"lark_grammar\": {body:?}}}]}}")
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    fn compiler() -> (GrammarCompiler, u32) {
        let (words, eos) = vocab();
        let n = words.len();
        (GrammarCompiler::new(words, &[eos], n + 7, 4, None).unwrap(), eos)
    }

    fn allowed(m: &mut GrammarMatcher) -> Vec<u32> {
        let (mask, _) = m.compute_mask();
        (0..m.vocab_size() as u32).filter(|&t| (mask[t as usize / 32] as u32) >> (t % 32) & 1 == 1).collect()
    }

    #[test]
    fn choice_masks_and_ends() {
        let (c, eos) = compiler();
        let g = c.compile(&lark("start: \"yes\" | \"no\"")).unwrap();
        let mut m = g.matcher();
        let a = allowed(&mut m);
        assert!(a.contains(&tok("yes")) && a.contains(&tok("no")) && a.contains(&tok("y")));
        assert!(!a.contains(&tok("a")) && !a.contains(&eos));
        m.consume(tok("no")).unwrap();
        assert!(m.is_accepting());
        // "no" cannot be extended: the grammar is done, only the end token is left.
        assert!(m.is_stopped());
        assert_eq!(allowed(&mut m), vec![eos]);
    }

    #[test]
    fn the_first_closing_is_searched_once_per_grammar_and_key() {
        let (c, _) = compiler();
        let text = lark("start: \"yes\"");
        let (g, again) = (c.compile(&text).unwrap(), c.compile(&text).unwrap());
        let searches = std::cell::Cell::new(0);
        let search = || {
            searches.set(searches.get() + 1);
            Some(vec![tok("yes")])
        };
        assert_eq!(g.from_start((0, 8), search), Some(vec![tok("yes")]));
        // the compile cache's copy shares it; another budget is searched
        assert_eq!(again.from_start((0, 8), search), Some(vec![tok("yes")]));
        assert_eq!(searches.get(), 1);
        again.from_start((0, 9), search);
        assert_eq!(searches.get(), 2);
    }

    /// `allows` is the mask wherever `mask_is_checkable` says so (on-demand
    /// masks keep a token by it: one it allowed that the mask refuses would
    /// change an answer), over random walks of grammars with lexemes, JSON,
    /// special tokens and forced text; the walks reach both kinds of state.
    #[test]
    fn allows_is_the_mask_where_it_is_checkable() {
        let (c, eos) = compiler();
        let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":6},"age":{"type":"integer"},"ok":{"type":"boolean"}},"required":["name","age"]}"#;
        let grammars = [
            format!("{{\"grammars\": [{{\"json_schema\": {schema}}}]}}"),
            lark(r#"start: "<" /[a-z]+/ ">" ("=" /[0-9]{1,3}/)? | "yes" | "no""#),
            lark(r#"start: <think> /[a-z ]*/ </think> ("none" | <call> "{" "\"name\"" ":" /"[a-z]+"/ "}" </call>)"#),
        ];
        let (mut checkable, mut forced) = (0, 0);
        for (gi, text) in grammars.iter().enumerate() {
            let g = c.compile(text).unwrap();
            for seed in 0..12u64 {
                let mut m = g.matcher();
                let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(gi as u64 + 1);
                for _ in 0..40 {
                    if m.mask_is_checkable() {
                        checkable += 1;
                        let by_check: Vec<u32> = (0..m.vocab_size() as u32).filter(|&t| m.allows(t)).collect();
                        assert_eq!(by_check, allowed(&mut m), "grammar {gi}, seed {seed}");
                    } else {
                        forced += 1;
                    }
                    let a = allowed(&mut m);
                    if a.is_empty() || m.is_stopped() {
                        break;
                    }
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let t = a[(state >> 33) as usize % a.len()];
                    if t == eos {
                        break;
                    }
                    assert_eq!(m.advance(&[t]), Ok(1));
                }
            }
        }
        assert!(checkable > 100 && forced > 20, "{checkable} checkable, {forced} forced states");
    }

    #[test]
    fn rejected_token_is_an_error_not_a_panic() {
        let (c, _) = compiler();
        let mut m = c.compile(&lark("start: \"yes\"")).unwrap().matcher();
        assert!(m.consume(tok("q")).is_err());
        assert!(m.error().is_some());
        let (mask, err) = m.compute_mask();
        assert!(mask.iter().all(|&w| w == 0) && err.is_some());
    }

    #[test]
    fn bad_grammars_are_messages_and_cached() {
        let (c, _) = compiler();
        let e = c.compile(&lark("start: foo")).err().unwrap();
        assert!(e.contains("foo"), "{e}");
        assert!(c.compile("{\"grammars\": 3}").is_err());
        assert!(c.compile("").is_err());
        c.compile(&lark("start: foo")).err().unwrap();
        let s = c.cache_stats();
        assert_eq!((s.hits, s.misses), (1, 3));
    }

    #[test]
    fn lru_evicts_the_oldest() {
        let (c, _) = compiler();
        for i in 0..6 {
            c.compile(&lark(&format!("start: \"a{i}\""))).unwrap();
        }
        assert_eq!(c.cache_stats().size, 4);
        c.compile(&lark("start: \"a5\"")).unwrap();
        c.compile(&lark("start: \"a0\"")).unwrap();
        let s = c.cache_stats();
        assert_eq!((s.hits, s.misses), (1, 7));
    }

    #[test]
    fn json_schema_forces_keys() {
        let (c, _) = compiler();
        let schema = r#"{"grammars": [{"json_schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false}}]}"#;
        let mut m = c.compile(schema).unwrap().matcher();
        let forced = m.forced_tokens();
        assert!(!forced.is_empty());
        for t in forced {
            m.consume(t).unwrap();
        }
        // `{"name":` may be forced; after it a string value must start.
        let a = allowed(&mut m);
        assert!(a.contains(&tok("\"")) || a.contains(&tok(":")), "{a:?}");
    }

    #[test]
    fn padded_vocab_ids_are_never_allowed() {
        let (c, _) = compiler();
        let mut m = c.compile(&lark("start: /[a-z]+/")).unwrap().matcher();
        let (words, _) = vocab();
        let a = allowed(&mut m);
        assert!(a.iter().all(|&t| (t as usize) < words.len()));
        assert_eq!(m.words(), (words.len() + 7).div_ceil(32));
    }

    #[test]
    fn hints_name_the_special_tokens_and_suffixes() {
        let g = r#"{"grammars": [{"lark_grammar": "start: <[44]> a <[45]> <[44]>\na[suffix=\"\\n</p>\\\"x\"]: /(?s:.*)/\n"}]}"#;
        let top = TopLevelGrammar::from_lark_or_grammar_list(g).unwrap();
        let h = Hints::of(&top);
        assert_eq!(h.specials, vec![44, 45]);
        assert_eq!(h.suffixes, vec![b"\n</p>\"x".to_vec()]);
    }

    #[test]
    fn rollback_restores_the_state() {
        let (c, _) = compiler();
        let mut m = c.compile(&lark("start: \"ab\" | \"cd\"")).unwrap().matcher();
        m.consume(tok("a")).unwrap();
        assert_eq!(m.try_consume(&[tok("q")]), Ok(0));
        assert!(m.error().is_none());
        m.rollback(1).unwrap();
        m.consume(tok("c")).unwrap();
        m.consume(tok("d")).unwrap();
        assert!(m.is_accepting());
    }

    #[test]
    fn bad_vocabularies_are_refused() {
        let (words, eos) = vocab();
        assert!(GrammarCompiler::new(words.clone(), &[], 100, 1, None).is_err());
        assert!(GrammarCompiler::new(words.clone(), &[eos], 3, 1, None).is_err());
        assert!(GrammarCompiler::new(words, &[500], 100, 1, None).is_err());
    }
}
