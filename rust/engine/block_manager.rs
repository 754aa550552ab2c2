//! Paged KV blocks: a fixed pool of `block_size`-token blocks with reference
//! counts and a prefix cache.
//!
//! A full block is cached under a hash chained over its parent's hash and its
//! own token ids, so one lookup per block walks a prompt's longest cached
//! prefix. The hash is FNV-1a over the little-endian bytes followed by the
//! splitmix64 finaliser (`sampling::random::mix64`): written out rather than taken
//! from `std::hash`, whose output may change between Rust releases, so a
//! block's hash is the same on every build and platform.
//!
//! The hash only finds a candidate. A hit also checks the block's token ids
//! and the identity of the block it was chained to, so a hash collision
//! (FNV is not collision resistant, and prompts come from clients) can never
//! hand one request another's KV.
//!
//! When asked, the manager records what enters and leaves the cache
//! ([`CacheEvent`]): a router that routes by what each replica holds reads
//! them (vLLM's KV-cache events, published by python/guided/serve/kv_events.py).

use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

/// Identity of a cached block's content: the block id plus a generation that
/// changes whenever the block is evicted, so links to evicted content go stale
/// instead of pointing at whatever the block holds next.
type Link = u64;
const ROOT: Link = u64::MAX;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Stable 64-bit hash of one full block given its parent block's hash
/// (`None` for the first block of a sequence).
pub fn hash_block(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
    };
    match parent {
        Some(p) => eat(&p.to_le_bytes()),
        None => eat(b"root"),
    }
    for t in tokens {
        eat(&t.to_le_bytes());
    }
    crate::sampling::random::mix64(h)
}

/// A change to the prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block entered the cache: its hash, its parent's (`None` for a
    /// sequence's first block) and its token ids.
    Stored { hash: u64, parent: Option<u64>, tokens: Vec<u32> },
    /// A cached block was evicted (its block now holds other content).
    Removed { hash: u64 },
}

/// The blocks one sequence holds, plus what it knows about its full blocks'
/// cache identities (needed to chain the next block's hash).
#[derive(Debug, Clone, Default)]
pub struct SeqBlocks {
    /// Physical block ids in token order.
    pub table: Vec<BlockId>,
    /// Hash of each full, computed block, in order (a prefix of `table`).
    hashes: Vec<u64>,
    /// The cached content each of those blocks matches, `None` once a block
    /// could not be cached (then nothing after it is chained either).
    links: Vec<Option<Link>>,
}

impl SeqBlocks {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// How many leading blocks are computed and hashed, and the last one's hash.
    pub fn hashed(&self) -> (usize, Option<u64>) {
        (self.hashes.len(), self.hashes.last().copied())
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

/// A cached prefix found by [`BlockManager::lookup`]; not yet taken.
#[derive(Debug, Clone, Default)]
pub struct CachedPrefix {
    pub blocks: Vec<BlockId>,
    hashes: Vec<u64>,
    links: Vec<Link>,
}

impl CachedPrefix {
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The hash of its last block (None for an empty prefix).
    pub fn last_hash(&self) -> Option<u64> {
        self.hashes.last().copied()
    }
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    caching: bool,
    ref_counts: Vec<u32>,
    /// Blocks holding nothing worth keeping; popped from the end.
    free: Vec<BlockId>,
    /// Unreferenced cached blocks by the time they were released (oldest
    /// first): still hit candidates, evicted when `free` runs dry.
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    clock: u64,
    cache: HashMap<u64, BlockId>,
    /// Per block: its hash while it is in `cache`.
    hash_of: Vec<Option<u64>>,
    /// Per block, while cached: its token ids and the link of its parent.
    tokens_of: Vec<Vec<u32>>,
    parent_of: Vec<Link>,
    generation: Vec<u32>,
    /// The cache's changes since they were last taken, while recorded.
    events: Option<Vec<CacheEvent>>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        assert!(num_blocks <= BlockId::MAX as usize, "too many blocks");
        BlockManager {
            block_size,
            caching: enable_caching,
            ref_counts: vec![0; num_blocks],
            // Reversed so that blocks are handed out in ascending order.
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            cache: HashMap::new(),
            hash_of: vec![None; num_blocks],
            tokens_of: vec![Vec::new(); num_blocks],
            parent_of: vec![ROOT; num_blocks],
            generation: vec![0; num_blocks],
            events: None,
        }
    }

    /// Record [`CacheEvent`]s from now on (`take_events` drains them).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The cache's changes since the last call, oldest first (none unless recorded).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks that an allocation could use now (free plus evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks whose content is in the prefix cache (referenced or not).
    pub fn num_cached_blocks(&self) -> usize {
        self.cache.len()
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    pub fn is_cached(&self, block: BlockId) -> bool {
        self.hash_of[block as usize].is_some()
    }

    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.ref_counts[block as usize] == 0 && self.is_cached(block)
    }

    pub fn is_free(&self, block: BlockId) -> bool {
        self.ref_counts[block as usize] == 0 && !self.is_cached(block)
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The longest cached prefix of `tokens`, leaving at least one token to
    /// compute (the model needs one to produce logits from).
    pub fn lookup(&self, tokens: &[u32]) -> CachedPrefix {
        let mut found = CachedPrefix::default();
        if !self.caching || tokens.is_empty() {
            return found;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut parent_hash = None;
        let mut parent_link = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let hash = hash_block(parent_hash, chunk);
            let Some(&block) = self.cache.get(&hash) else { break };
            if !self.holds(block, chunk, parent_link) {
                break;
            }
            parent_hash = Some(hash);
            parent_link = self.link(block);
            found.blocks.push(block);
            found.hashes.push(hash);
            found.links.push(parent_link);
        }
        found
    }

    /// `lookup`, but a hit counts only if it is exactly the first `limit` tokens (a multiple of
    /// the block size); otherwise none.
    pub fn lookup_exact(&self, tokens: &[u32], limit: usize) -> CachedPrefix {
        let found = self.lookup(&tokens[..(limit + 1).min(tokens.len())]);
        if found.blocks.len() * self.block_size == limit {
            found
        } else {
            CachedPrefix::default()
        }
    }

    /// The hashes a lookup of `tokens` would chain through, from block
    /// `from` on (`parent`: the hash of block `from - 1`): the full blocks
    /// past a prefix that a sequence computes and then caches. Empty with
    /// caching off.
    pub fn hashes_from(&self, tokens: &[u32], from: usize, parent: Option<u64>) -> Vec<u64> {
        if !self.caching || tokens.is_empty() {
            return Vec::new();
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut parent = parent;
        tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .skip(from)
            .map(|chunk| {
                let hash = hash_block(parent, chunk);
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// Whether a sequence holding nothing yet can take `prefix` and grow to
    /// `num_tokens` tokens.
    pub fn can_admit(&self, prefix: &CachedPrefix, num_tokens: usize) -> bool {
        let fresh = self.blocks_for(num_tokens).saturating_sub(prefix.num_blocks());
        // Taking an unreferenced hit removes it from the evictable pool.
        let idle_hits = prefix.blocks.iter().filter(|&&b| self.ref_count(b) == 0).count();
        fresh + idle_hits <= self.num_free_blocks()
    }

    /// Give an empty sequence the blocks of a cached prefix (ref count + 1).
    pub fn take_prefix(&mut self, seq: &mut SeqBlocks, prefix: CachedPrefix) {
        debug_assert!(seq.is_empty(), "take_prefix on a sequence that holds blocks");
        for &block in &prefix.blocks {
            self.add_ref(block);
        }
        seq.table = prefix.blocks;
        seq.hashes = prefix.hashes;
        seq.links = prefix.links.into_iter().map(Some).collect();
    }

    /// Grow the sequence's table to hold `num_tokens` tokens; all or nothing.
    pub fn grow(&mut self, seq: &mut SeqBlocks, num_tokens: usize) -> bool {
        let needed = self.blocks_for(num_tokens).saturating_sub(seq.len());
        if needed > self.num_free_blocks() {
            return false;
        }
        for _ in 0..needed {
            let block = self.pop_block();
            seq.table.push(block);
        }
        true
    }

    /// Enter every full block among the first `num_computed` tokens (whose
    /// KV is now written) into the cache.
    pub fn commit(&mut self, seq: &mut SeqBlocks, tokens: &[u32], num_computed: usize) {
        let full = (num_computed.min(tokens.len()) / self.block_size).min(seq.len());
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let parent_hash = i.checked_sub(1).map(|p| seq.hashes[p]);
            let parent_link = match i.checked_sub(1) {
                None => Some(ROOT),
                Some(p) => seq.links[p],
            };
            let hash = hash_block(parent_hash, chunk);
            let link = parent_link.and_then(|pl| self.cache_block(seq.table[i], hash, parent_hash, chunk, pl));
            seq.hashes.push(hash);
            seq.links.push(link);
        }
    }

    /// Share all of `seq`'s blocks with a new sequence (ref count + 1 each).
    /// Writing into a shared, partly filled last block is the caller's
    /// business (copy it first).
    pub fn fork(&mut self, seq: &SeqBlocks) -> SeqBlocks {
        for &block in &seq.table {
            self.add_ref(block);
        }
        seq.clone()
    }

    /// Drop the sequence's hold on its blocks. Tail blocks are released
    /// first so that, of one sequence, they are evicted before its head,
    /// which other prompts are more likely to share.
    pub fn free(&mut self, seq: &mut SeqBlocks) {
        for &block in seq.table.iter().rev() {
            self.release(block);
        }
        *seq = SeqBlocks::default();
    }

    fn holds(&self, block: BlockId, tokens: &[u32], parent: Link) -> bool {
        let b = block as usize;
        self.parent_of[b] == parent && self.tokens_of[b] == tokens
    }

    fn link(&self, block: BlockId) -> Link {
        (u64::from(self.generation[block as usize]) << 32) | u64::from(block)
    }

    /// Cache `block` under `hash` unless an identical block already is;
    /// returns the link of the block that holds this content, or `None` on a
    /// hash collision with different content.
    fn cache_block(
        &mut self,
        block: BlockId,
        hash: u64,
        parent_hash: Option<u64>,
        tokens: &[u32],
        parent: Link,
    ) -> Option<Link> {
        if !self.caching {
            return None;
        }
        if let Some(&other) = self.cache.get(&hash) {
            return self.holds(other, tokens, parent).then(|| self.link(other));
        }
        let b = block as usize;
        if self.hash_of[b].is_some() {
            // Already caches other content (a cache hit taken by this
            // sequence is never re-committed, so this is a forked table).
            return None;
        }
        self.cache.insert(hash, block);
        self.hash_of[b] = Some(hash);
        self.tokens_of[b] = tokens.to_vec();
        self.parent_of[b] = parent;
        if let Some(events) = &mut self.events {
            events.push(CacheEvent::Stored { hash, parent: parent_hash, tokens: tokens.to_vec() });
        }
        Some(self.link(block))
    }

    fn add_ref(&mut self, block: BlockId) {
        let b = block as usize;
        if self.ref_counts[b] == 0 {
            self.evictable.remove(&self.released_at[b]);
        }
        self.ref_counts[b] += 1;
    }

    fn release(&mut self, block: BlockId) {
        let b = block as usize;
        assert!(self.ref_counts[b] > 0, "block {block} released more often than taken");
        self.ref_counts[b] -= 1;
        if self.ref_counts[b] > 0 {
            return;
        }
        if self.hash_of[b].is_some() {
            self.clock += 1;
            self.released_at[b] = self.clock;
            self.evictable.insert(self.clock, block);
        } else {
            self.free.push(block);
        }
    }

    /// A block for new content: never-cached first, else evict the least
    /// recently released cached one. Callers check availability first.
    fn pop_block(&mut self) -> BlockId {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (_, block) = self.evictable.pop_first().expect("no free block");
                self.uncache(block);
                block
            }
        };
        self.ref_counts[block as usize] = 1;
        block
    }

    fn uncache(&mut self, block: BlockId) {
        let b = block as usize;
        if let Some(hash) = self.hash_of[b].take() {
            self.cache.remove(&hash);
            if let Some(events) = &mut self.events {
                events.push(CacheEvent::Removed { hash });
            }
        }
        self.tokens_of[b].clear();
        self.parent_of[b] = ROOT;
        self.generation[b] = self.generation[b].wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seq_with(bm: &mut BlockManager, tokens: &[u32]) -> SeqBlocks {
        let mut seq = SeqBlocks::default();
        let prefix = bm.lookup(tokens);
        assert!(bm.can_admit(&prefix, tokens.len()));
        bm.take_prefix(&mut seq, prefix);
        assert!(bm.grow(&mut seq, tokens.len()));
        bm.commit(&mut seq, tokens, tokens.len());
        seq
    }

    #[test]
    fn hash_is_stable() {
        // Pinned so that a change to the hash is a deliberate one.
        assert_eq!(hash_block(None, &[1, 2, 3]), hash_block(None, &[1, 2, 3]));
        assert_ne!(hash_block(None, &[1, 2, 3]), hash_block(Some(0), &[1, 2, 3]));
        assert_eq!(hash_block(None, &[]), 0x4ffc_5316_5c1d_c41b, "{:#x}", hash_block(None, &[]));
    }

    #[test]
    fn allocates_ascending_and_frees() {
        let mut bm = BlockManager::new(8, 4, true);
        let mut seq = SeqBlocks::default();
        assert!(bm.grow(&mut seq, 9));
        assert_eq!(seq.table, vec![0, 1, 2]);
        assert_eq!(bm.num_free_blocks(), 5);
        bm.free(&mut seq);
        assert_eq!(bm.num_free_blocks(), 8);
        assert!(!bm.grow(&mut seq, 40));
        assert!(seq.is_empty(), "a failed grow takes nothing");
    }

    #[test]
    fn prefix_hit_reuses_blocks_and_leaves_one_token() {
        let mut bm = BlockManager::new(16, 4, true);
        let prompt: Vec<u32> = (0..12).collect();
        let mut a = seq_with(&mut bm, &prompt);
        assert_eq!(bm.num_cached_blocks(), 3);
        // Same 12 tokens: only 2 blocks may hit, so one token is computed.
        let hit = bm.lookup(&prompt);
        assert_eq!(hit.blocks, a.table[..2]);
        let longer: Vec<u32> = (0..13).collect();
        assert_eq!(bm.lookup(&longer).blocks, a.table[..3]);
        let mut other = prompt.clone();
        other[5] = 99;
        assert_eq!(bm.lookup(&other).blocks, a.table[..1]);
        bm.free(&mut a);
        assert_eq!(bm.num_free_blocks(), 16);
        assert_eq!(bm.lookup(&longer).num_blocks(), 3, "freed blocks stay cached");
    }

    #[test]
    fn eviction_takes_least_recently_released_and_tail_first() {
        let mut bm = BlockManager::new(4, 2, true);
        let mut a = seq_with(&mut bm, &[1, 2, 3, 4]);
        bm.free(&mut a);
        // Needs 3 fresh blocks: 2 free ones, then the tail of `a` goes first.
        let mut b = SeqBlocks::default();
        assert!(bm.grow(&mut b, 6));
        assert_eq!(bm.lookup(&[1, 2, 3, 4, 5]).num_blocks(), 1);
        assert_eq!(bm.lookup(&[1, 2, 9]).num_blocks(), 1);
        bm.free(&mut b);
    }

    #[test]
    fn recorded_events_chain_stores_and_name_evictions() {
        let mut bm = BlockManager::new(3, 2, true);
        let mut a = seq_with(&mut bm, &[1, 2, 3, 4, 5]);
        assert!(bm.take_events().is_empty(), "nothing is recorded until asked");
        bm.free(&mut a);
        bm.record_events();
        let mut b = seq_with(&mut bm, &[1, 2, 7, 8, 9]);
        let first = hash_block(None, &[1, 2]);
        let second = hash_block(Some(first), &[7, 8]);
        // [1, 2] is a hit; [7, 8] needs a block: the free one, then the LRU tail [3, 4] of `a`
        assert_eq!(bm.take_events(), vec![
            CacheEvent::Removed { hash: hash_block(Some(first), &[3, 4]) },
            CacheEvent::Stored { hash: second, parent: Some(first), tokens: vec![7, 8] },
        ]);
        bm.free(&mut b);
        // the same content again (in another block): already announced
        let mut again = seq_with(&mut bm, &[1, 2, 7, 8]);
        assert!(bm.take_events().is_empty(), "content already cached stores nothing new");
        bm.free(&mut again);
    }

    #[test]
    fn hit_on_evictable_block_takes_it_out_of_the_pool() {
        let mut bm = BlockManager::new(3, 2, true);
        let mut a = seq_with(&mut bm, &[1, 2, 3]);
        bm.free(&mut a);
        let prefix = bm.lookup(&[1, 2, 7]);
        assert_eq!(prefix.num_blocks(), 1);
        // 3 tokens: the hit plus 1 fresh block; 3 blocks allow 7 tokens at most.
        assert!(bm.can_admit(&prefix, 6));
        assert!(!bm.can_admit(&prefix, 7));
        let mut b = SeqBlocks::default();
        bm.take_prefix(&mut b, prefix);
        assert_eq!(bm.num_free_blocks(), 2);
        assert_eq!(bm.ref_count(b.table[0]), 1);
    }

    #[test]
    fn duplicate_content_is_cached_once_and_chains_on() {
        let mut bm = BlockManager::new(16, 2, true);
        let prompt = [1, 2, 3, 4, 5];
        // Two sequences compute the same blocks before either commits.
        let (mut a, mut b) = (SeqBlocks::default(), SeqBlocks::default());
        assert!(bm.grow(&mut a, 5) && bm.grow(&mut b, 5));
        bm.commit(&mut a, &prompt[..2], 2);
        bm.commit(&mut b, &prompt, 5);
        bm.commit(&mut a, &prompt, 5);
        assert_eq!(bm.num_cached_blocks(), 2);
        assert_eq!(bm.lookup(&[1, 2, 3, 4, 9]).blocks, vec![a.table[0], b.table[1]]);
        bm.free(&mut a);
        bm.free(&mut b);
        assert_eq!(bm.num_free_blocks(), 16);
    }

    #[test]
    fn caching_off_never_hits() {
        let mut bm = BlockManager::new(8, 2, false);
        let mut a = seq_with(&mut bm, &[1, 2, 3, 4, 5]);
        assert_eq!(bm.lookup(&[1, 2, 3, 4, 5]).num_blocks(), 0);
        assert_eq!(bm.num_cached_blocks(), 0);
        bm.free(&mut a);
        assert_eq!(bm.free.len(), 8);
    }

    #[test]
    fn fork_shares_blocks() {
        let mut bm = BlockManager::new(8, 2, true);
        let mut a = seq_with(&mut bm, &[1, 2, 3]);
        let mut b = bm.fork(&a);
        assert_eq!(a.table, b.table);
        assert!(a.table.iter().all(|&x| bm.ref_count(x) == 2));
        bm.free(&mut a);
        assert!(b.table.iter().all(|&x| bm.ref_count(x) == 1));
        bm.free(&mut b);
        assert_eq!(bm.num_free_blocks(), 8);
    }

    // ---- property tests --------------------------------------------------

    #[derive(Debug, Clone)]
    enum Op {
        Admit(Vec<u32>),
        Append(usize, Vec<u32>),
        Fork(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // A tiny alphabet so that prompts share prefixes often.
        let tokens = prop::collection::vec(0u32..3, 1..24);
        prop_oneof![
            tokens.clone().prop_map(Op::Admit),
            (any::<usize>(), prop::collection::vec(0u32..3, 1..6)).prop_map(|(i, t)| Op::Append(i, t)),
            any::<usize>().prop_map(Op::Fork),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    struct Live {
        blocks: SeqBlocks,
        tokens: Vec<u32>,
    }

    fn check_invariants(bm: &BlockManager, live: &[Live]) {
        let n = bm.num_blocks();
        let mut owners = vec![0u32; n];
        for s in live {
            for &b in &s.blocks.table {
                owners[b as usize] += 1;
            }
        }
        let (mut free, mut idle) = (0, 0);
        for b in 0..n as BlockId {
            assert_eq!(bm.ref_count(b), owners[b as usize], "ref count of block {b}");
            let states = [bm.is_free(b), bm.is_evictable(b), bm.ref_count(b) > 0];
            assert_eq!(states.iter().filter(|&&x| x).count(), 1, "block {b} in one state");
            free += bm.is_free(b) as usize;
            idle += bm.is_evictable(b) as usize;
        }
        assert_eq!(bm.free.len(), free);
        assert_eq!(bm.evictable.len(), idle);
        for (&hash, &b) in &bm.cache {
            assert_eq!(bm.hash_of[b as usize], Some(hash));
        }
        assert_eq!(bm.hash_of.iter().filter(|h| h.is_some()).count(), bm.cache.len());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn block_accounting_holds(ops in prop::collection::vec(op(), 1..60), caching in any::<bool>()) {
            let bs = 4;
            let mut bm = BlockManager::new(24, bs, caching);
            bm.record_events();
            // the cache as a router rebuilds it from the events
            let mut announced: HashMap<u64, Vec<u32>> = HashMap::new();
            let mut live: Vec<Live> = Vec::new();
            for op in ops {
                match op {
                    Op::Admit(tokens) => {
                        let prefix = bm.lookup(&tokens);
                        let hit = prefix.num_blocks();
                        prop_assert!(hit * bs < tokens.len());
                        // A hit maps to the very blocks a live sequence
                        // computed for that prefix, when one still has them.
                        for s in &live {
                            let same = s.tokens.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
                            let shared = (same / bs).min(hit).min(s.blocks.hashes.len());
                            for i in 0..shared {
                                if bm.cache.get(&s.blocks.hashes[i]) == Some(&s.blocks.table[i]) {
                                    prop_assert_eq!(prefix.blocks[i], s.blocks.table[i]);
                                }
                            }
                        }
                        if !bm.can_admit(&prefix, tokens.len()) {
                            continue;
                        }
                        let mut blocks = SeqBlocks::default();
                        bm.take_prefix(&mut blocks, prefix);
                        prop_assert!(bm.grow(&mut blocks, tokens.len()));
                        bm.commit(&mut blocks, &tokens, tokens.len());
                        live.push(Live { blocks, tokens });
                    }
                    Op::Append(i, more) if !live.is_empty() => {
                        let n = live.len();
                        let s = &mut live[i % n];
                        let before = s.blocks.table.clone();
                        let len = s.tokens.len() + more.len();
                        if bm.grow(&mut s.blocks, len) {
                            s.tokens.extend(more);
                            bm.commit(&mut s.blocks, &s.tokens, len);
                        } else {
                            prop_assert_eq!(&s.blocks.table, &before);
                        }
                    }
                    Op::Fork(i) if !live.is_empty() => {
                        let s = &live[i % live.len()];
                        let blocks = bm.fork(&s.blocks);
                        let tokens = s.tokens.clone();
                        live.push(Live { blocks, tokens });
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let mut s = live.swap_remove(i % live.len());
                        bm.free(&mut s.blocks);
                    }
                    _ => {}
                }
                check_invariants(&bm, &live);
                for event in bm.take_events() {
                    match event {
                        CacheEvent::Stored { hash, tokens, .. } => {
                            prop_assert!(announced.insert(hash, tokens).is_none(), "stored twice");
                        }
                        CacheEvent::Removed { hash } => {
                            prop_assert!(announced.remove(&hash).is_some(), "removed unannounced");
                        }
                    }
                }
                prop_assert_eq!(announced.len(), bm.cache.len());
                for (hash, tokens) in &announced {
                    let block = bm.cache[hash] as usize;
                    prop_assert_eq!(&bm.tokens_of[block], tokens);
                }
            }
            for mut s in live.drain(..) {
                bm.free(&mut s.blocks);
            }
            check_invariants(&bm, &live);
            prop_assert_eq!(bm.num_free_blocks(), bm.num_blocks());
        }

        #[test]
        fn lookup_finds_what_was_committed(tokens in prop::collection::vec(0u32..4, 1..40)) {
            let bs = 4;
            let mut bm = BlockManager::new(16, bs, true);
            let mut s = SeqBlocks::default();
            prop_assert!(bm.grow(&mut s, tokens.len()));
            bm.commit(&mut s, &tokens, tokens.len());
            let mut longer = tokens.clone();
            longer.push(0);
            let hit = bm.lookup(&longer);
            prop_assert_eq!(&hit.blocks[..], &s.table[..tokens.len() / bs]);
            bm.free(&mut s);
            // Still hits after release, as long as nothing was evicted.
            prop_assert_eq!(bm.lookup(&longer).blocks, hit.blocks);
        }
    }
}
