//! The scheduler's tests: plans, budgets, the prefix cache, preemption,
//! grammars, and a simulation against a fake model (proptest).

use super::*;
use proptest::prelude::*;

fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 256,
        eos_token_ids: vec![0],
        enable_prefix_caching: true,
        speculation: SpecConfig::default(),
        masks: MaskPolicy::Overlap,
    }
}

fn req(max_tokens: i64) -> RequestParams {
    RequestParams { max_tokens, ..Default::default() }
}

fn prompt(n: usize, salt: i64) -> Vec<i64> {
    (0..n as i64).map(|i| 1 + (i * 7 + salt) % 50).collect()
}

/// Run steps, answering every sampled row with `token`, until idle.
fn drain(s: &mut Scheduler, token: i64) -> Vec<StepOutput> {
    let mut finished = Vec::new();
    for _ in 0..10_000 {
        let Some(plan) = s.schedule() else { break };
        let out = s.update(&vec![token; plan.sample_seq_ids.len()]).unwrap();
        finished.extend(out.into_iter().filter(|o| o.finish_reason.is_some()));
    }
    assert!(!s.has_unfinished());
    finished
}

#[test]
fn prefill_then_decode() {
    let mut s = Scheduler::new(cfg(16, 16)).unwrap();
    s.add_request(7, &prompt(40, 0), &req(3)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.num_tokens, 40);
    assert_eq!(plan.positions, (0..40).collect::<Vec<i64>>());
    assert_eq!(plan.max_blocks, 3);
    assert_eq!(plan.block_tables, vec![0, 1, 2]);
    assert_eq!(plan.slot_mapping[17], 17);
    assert_eq!(plan.context_lens, vec![40]);
    assert_eq!(plan.query_start_loc, vec![0, 40]);
    assert_eq!(plan.logits_indices, vec![39]);
    assert_eq!(plan.sample_seq_ids, vec![7]);
    assert!(!plan.is_decode_only);
    let out = s.update(&[5]).unwrap();
    assert_eq!(out, vec![StepOutput { seq_id: 7, token: 5, finish_reason: None, num_cached_tokens: 0, forced: vec![], more: vec![], more_forced: 0, error: None, closed: false, closing_us: 0 }]);
    let plan = s.schedule().unwrap();
    assert_eq!((plan.input_ids.clone(), plan.positions.clone()), (vec![5], vec![40]));
    assert_eq!(plan.context_lens, vec![41]);
    assert!(plan.is_decode_only);
    s.update(&[6]).unwrap();
    s.schedule().unwrap();
    let out = s.update(&[8]).unwrap();
    assert_eq!(out[0].finish_reason, Some(FinishReason::Length));
    assert!(!s.has_unfinished());
    assert!(s.schedule().is_none());
    assert_eq!(s.bm.num_free_blocks(), 16);
}

#[test]
fn a_prompt_being_computed_is_not_computed_twice() {
    let mut s = Scheduler::new(cfg(32, 16)).unwrap();
    let shared = prompt(40, 0);
    s.add_request(1, &shared, &req(2)).unwrap();
    s.add_request(2, &shared, &req(2)).unwrap();
    let mut other = prompt(40, 3);
    other[0] = 49; // no block in common with `shared`
    s.add_request(3, &other, &req(2)).unwrap();
    // The second copy waits one step (and, FIFO, so does the one behind it)...
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seq_ids, vec![1]);
    s.update(&[5]).unwrap();
    // ...and then finds the first one's two full blocks cached.
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seq_ids, vec![1, 2, 3]);
    assert_eq!(plan.query_start_loc, vec![0, 1, 9, 49]);
    let out = s.update(&[5, 5, 5]).unwrap();
    assert_eq!(out[1].num_cached_tokens, 32);
    assert_eq!(out[2].num_cached_tokens, 0);
    drain(&mut s, 5);
}

#[test]
fn prompts_with_nothing_in_common_start_together() {
    let mut s = Scheduler::new(cfg(32, 16)).unwrap();
    s.add_request(1, &prompt(20, 0), &req(2)).unwrap();
    s.add_request(2, &prompt(20, 1), &req(2)).unwrap();
    // a prompt shorter than a block shares no full block with anything
    s.add_request(3, &prompt(10, 0), &req(2)).unwrap();
    assert_eq!(s.schedule().unwrap().seq_ids, vec![1, 2, 3]);
}

#[test]
fn long_prompts_are_chunked() {
    let mut c = cfg(16, 16);
    c.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(40, 0), &req(2)).unwrap();
    let mut sizes = Vec::new();
    for _ in 0..3 {
        let plan = s.schedule().unwrap();
        sizes.push((plan.num_tokens, plan.logits_indices.len(), plan.positions[0]));
        // Partial chunks sample nothing; update is still fine to call.
        s.update(&vec![3; plan.logits_indices.len()]).unwrap();
    }
    assert_eq!(sizes, vec![(16, 0, 0), (16, 0, 16), (8, 1, 32)]);
}

#[test]
fn decodes_go_before_new_prefills_and_budget_holds() {
    let mut c = cfg(64, 16);
    c.max_num_batched_tokens = 20;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(10, 0), &req(5)).unwrap();
    s.schedule().unwrap();
    s.update(&[3]).unwrap();
    s.add_request(2, &prompt(30, 1), &req(5)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seq_ids, vec![1, 2]);
    assert_eq!(plan.query_start_loc, vec![0, 1, 20]);
    assert_eq!(plan.sample_seq_ids, vec![1]);
    assert_eq!(plan.logits_indices, vec![0]);
}

#[test]
fn max_num_seqs_caps_the_batch() {
    let mut c = cfg(64, 4);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c).unwrap();
    for id in 0..3 {
        s.add_request(id, &prompt(5, id as i64), &req(4)).unwrap();
    }
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seq_ids, vec![0, 1]);
    s.update(&[3, 3]).unwrap();
    assert_eq!(drain(&mut s, 3).len(), 3);
}

#[test]
fn a_plan_left_without_update_is_fed_again() {
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    s.add_request(1, &prompt(5, 0), &req(2)).unwrap();
    s.schedule().unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!((plan.positions.clone(), plan.context_lens.clone()), (vec![4], vec![5]));
    assert_eq!(drain(&mut s, 3).len(), 1);
}

#[test]
fn prefix_cache_hits_leave_one_token() {
    let mut s = Scheduler::new(cfg(16, 16)).unwrap();
    let p = prompt(40, 0);
    s.add_request(1, &p, &req(1)).unwrap();
    drain(&mut s, 3);
    s.add_request(2, &p, &req(1)).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.num_tokens, 8);
    assert_eq!(plan.positions[0], 32);
    assert_eq!(plan.block_tables[..2], [0, 1]);
    let out = s.update(&[3]).unwrap();
    assert_eq!(out[0].num_cached_tokens, 32);
    let stats: HashMap<_, _> = s.stats().into_iter().collect();
    assert_eq!(stats["prefix_cache_hit_tokens"], 32);
    assert_eq!(stats["prefix_cache_queries"], 80);
    // A prompt of exactly two blocks hits only the first.
    s.add_request(3, &p[..32], &req(1)).unwrap();
    assert_eq!(s.schedule().unwrap().num_tokens, 16);
}

#[test]
fn a_limited_prefix_hits_exactly_its_limit_or_nothing() {
    // 48 prompt tokens cached (three blocks); a state known after 16 tokens allows a hit of 16
    // alone, one known after 64 (more than is cached) none
    let mut s = Scheduler::new(cfg(16, 16)).unwrap();
    let p = prompt(60, 0);
    s.add_request(1, &p, &req(1)).unwrap();
    drain(&mut s, 3);
    for (id, limit, start) in [(2, 16, 16), (3, 64, 0), (4, 0, 0), (5, 20, 0)] {
        s.add_request(id, &p, &req(1)).unwrap();
        assert!(s.limit_prefix(id as u64, limit));
        assert_eq!(s.schedule().unwrap().positions[0], start, "limit {limit}");
        drain(&mut s, 3);
    }
    assert!(!s.limit_prefix(99, 16), "an unknown id");
    // held 48 each time: 32 missed with the hit of 16, 48 with each of the three others
    let stats: HashMap<_, _> = s.stats().into_iter().collect();
    assert_eq!(stats["prefix_cache_state_miss_tokens"], 32 + 3 * 48);
}

#[test]
fn chunked_prefill_blocks_are_cached_without_sampling() {
    let mut c = cfg(16, 4);
    c.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(c).unwrap();
    let p = prompt(20, 0);
    s.add_request(1, &p, &req(4)).unwrap();
    let plan = s.schedule().unwrap();
    assert!(plan.logits_indices.is_empty());
    // No update: the next schedule commits the blocks just written.
    s.schedule().unwrap();
    s.add_request(2, &p[..9], &req(4)).unwrap();
    s.update(&[]).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.seq_ids, vec![1, 2]);
    assert_eq!(s.num_cached_tokens(2), Some(8));
}

#[test]
fn preemption_recomputes_newest_and_everything_finishes() {
    let mut c = cfg(6, 4);
    c.max_model_len = 64;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(7, 0), &req(8)).unwrap();
    s.add_request(2, &prompt(7, 1), &req(8)).unwrap();
    let mut saw_preemption = false;
    for _ in 0..100 {
        let Some(plan) = s.schedule() else { break };
        saw_preemption |= s.counters().preemptions > 0;
        s.update(&vec![3; plan.sample_seq_ids.len()]).unwrap();
    }
    assert!(saw_preemption);
    assert!(!s.has_unfinished());
    assert_eq!(s.bm.num_free_blocks(), 6);
}

#[test]
fn stop_conditions() {
    let mut s = Scheduler::new(cfg(64, 4)).unwrap();
    s.add_request(1, &prompt(5, 0), &req(10)).unwrap();
    s.add_request(2, &prompt(5, 1), &RequestParams { stop_token_ids: vec![9], ..req(10) }).unwrap();
    s.add_request(3, &prompt(5, 2), &RequestParams { min_tokens: 2, ..req(10) }).unwrap();
    s.add_request(4, &prompt(5, 3), &RequestParams { ignore_eos: true, ..req(10) }).unwrap();
    s.schedule().unwrap();
    let out = s.update(&[0, 9, 0, 0]).unwrap();
    let reasons: Vec<_> = out.iter().map(|o| o.finish_reason).collect();
    assert_eq!(reasons, vec![Some(FinishReason::Stop), Some(FinishReason::Stop), None, None]);
    s.schedule().unwrap();
    let out = s.update(&[5, -1]).unwrap();
    assert_eq!(out[0].finish_reason, None);
    assert_eq!(out[1].finish_reason, Some(FinishReason::Error));
    s.schedule().unwrap();
    assert_eq!(s.update(&[0]).unwrap()[0].finish_reason, Some(FinishReason::Stop));
}

#[test]
fn length_at_the_context_or_pool_end() {
    let mut c = cfg(2, 4);
    c.max_model_len = 100;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(1, &prompt(6, 0), &req(50)).unwrap();
    let done = drain(&mut s, 3);
    assert_eq!(done[0].finish_reason, Some(FinishReason::Length));
    assert_eq!(s.counters().preemptions, 0);
}

#[test]
fn abort_frees_and_forgets() {
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    s.add_request(1, &prompt(9, 0), &req(10)).unwrap();
    s.add_request(2, &prompt(9, 1), &req(10)).unwrap();
    s.schedule().unwrap();
    assert!(s.abort(1));
    assert!(!s.abort(1));
    // The aborted row is skipped; the other goes on.
    let out = s.update(&[3, 4]).unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].seq_id, 2);
    assert!(s.abort(2));
    assert!(!s.has_unfinished());
    assert_eq!(s.bm.num_free_blocks(), 8);
}

#[test]
fn bad_requests_change_nothing() {
    let mut s = Scheduler::new(cfg(4, 4)).unwrap();
    let cases: Vec<(Vec<i64>, RequestParams, &str)> = vec![
        (vec![], req(1), "empty"),
        (prompt(256, 0), req(1), "at least one must be generated"),
        (prompt(17, 0), req(1), "KV cache holds only 16"),
        (vec![-1], req(1), "prompt token ids"),
        (prompt(3, 0), req(0), "max_tokens"),
        (prompt(3, 0), RequestParams { top_p: 1.5, ..req(1) }, "top_p"),
    ];
    for (p, r, msg) in cases {
        match s.add_request(1, &p, &r) {
            Err(Error::Invalid(m)) => assert!(m.contains(msg), "{m}"),
            other => panic!("expected an error with {msg:?}, got {other:?}"),
        }
    }
    assert!(!s.has_unfinished());
    s.add_request(1, &prompt(3, 0), &req(1)).unwrap();
    let dup = s.add_request(1, &prompt(3, 0), &req(1)).unwrap_err();
    assert!(dup.to_string().contains("already in use"));
    assert!(s.add_request(-1, &prompt(3, 0), &req(1)).is_err());
    assert!(Scheduler::new(SchedulerConfig { block_size: 0, ..cfg(4, 4) }).is_err());
}

#[test]
fn calls_out_of_order_are_errors() {
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    assert!(matches!(s.update(&[1]), Err(Error::State(_))));
    assert!(matches!(s.sample(&[], 0, 4, None), Err(Error::State(_))));
    s.add_request(1, &prompt(3, 0), &req(2)).unwrap();
    s.schedule().unwrap();
    assert!(matches!(s.update(&[1, 2]), Err(Error::Invalid(_))));
    assert!(matches!(s.sample(&[0.0; 8], 2, 4, None), Err(Error::Invalid(_))));
    let out = s.sample(&[0.0, 1.0, 0.5, 0.2], 1, 4, None).unwrap();
    assert_eq!(out[0].token, 1);
    assert_eq!(s.update(&[out[0].token]).unwrap().len(), 1);
}

#[test]
fn sample_bans_end_tokens_before_min_tokens() {
    let mut s = Scheduler::new(cfg(8, 4)).unwrap();
    s.add_request(1, &prompt(3, 0), &RequestParams { min_tokens: 1, ..req(4) }).unwrap();
    s.schedule().unwrap();
    // Token 0 is the end token and has the highest logit.
    let out = s.sample(&[9.0, 1.0, 0.5], 1, 3, None).unwrap();
    assert_eq!(out[0].token, 1);
}

// ---- grammars ------------------------------------------------------

mod constrained {
    use super::*;
    use crate::grammar::matchers::testing::{lark, special, tok, vocab};
    use crate::grammar::matchers::GrammarCompiler;

    fn setup() -> (Scheduler, GrammarCompiler, usize, u32) {
        let (words, eos) = vocab();
        let v = words.len();
        let compiler = GrammarCompiler::new(words, &[eos], v, 8, None).unwrap();
        let mut c = cfg(64, 4);
        c.eos_token_ids = vec![eos as i64];
        (Scheduler::new(c).unwrap(), compiler, v, eos)
    }

    /// Logits that favour `best` (then every other token equally).
    fn favour(v: usize, rows: &[u32]) -> Vec<f32> {
        rows.iter().flat_map(|&best| (0..v).map(move |t| if t as u32 == best { 5.0 } else { 0.0 })).collect()
    }

    /// One step: schedule, masks, sample from `want` logits, update.
    fn step(s: &mut Scheduler, v: usize, want: &[u32]) -> Vec<StepOutput> {
        let plan = s.schedule().unwrap();
        s.start_masks().unwrap();
        let n = plan.sample_seq_ids.len();
        let out = s.sample(&favour(v, &want[..n]), n, v, None).unwrap();
        s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn the_mask_is_hard_and_the_grammar_ends_the_sequence() {
        let (mut s, c, v, _) = setup();
        let g = c.compile(&lark("start: \"yes\" | \"no\"")).unwrap();
        s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
        s.add_request(2, &prompt(5, 1), &req(10)).unwrap();
        // Both favour "a": only the free row may take it.
        let out = step(&mut s, v, &[tok("a"), tok("a")]);
        assert_ne!(out[0].token, i64::from(tok("a")));
        assert_eq!(out[1].token, i64::from(tok("a")));
        // "n" is followed by the forced "o", which completes the grammar:
        // finish "stop" without an end token.
        assert_eq!(out[0].token, i64::from(tok("n")));
        assert_eq!(out[0].forced, vec![tok("o")]);
        assert_eq!(out[0].finish_reason, Some(FinishReason::Stop));
        s.add_constrained(3, &prompt(5, 2), &req(10), Some(&g), Steering::default()).unwrap();
        let out = step(&mut s, v, &[tok("a"), tok("yes")]);
        assert_eq!((out[1].token, out[1].finish_reason), (i64::from(tok("yes")), Some(FinishReason::Stop)));
        let stats: HashMap<_, _> = s.stats().into_iter().collect();
        assert_eq!(stats["mask_rows"], 2);
        assert_eq!(stats["forced_tokens"], 1);
    }

    /// Masks on demand give the tokens of masks computed beforehand, for
    /// greedy and sampled rows, a top-p row among them (always masked), with
    /// and without fast-forward, a free row beside them; rows are checked
    /// instead of masked, some kept, some refused and drawn again.
    #[test]
    fn masks_on_demand_draw_the_same_tokens() {
        let run = |masks: MaskPolicy| {
            let (words, eos) = vocab();
            let v = words.len();
            let compiler = GrammarCompiler::new(words, &[eos], v, 8, None).unwrap();
            let mut c = cfg(64, 4);
            c.eos_token_ids = vec![eos as i64];
            c.masks = masks;
            let mut s = Scheduler::new(c).unwrap();
            let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":8},"age":{"type":"integer"},"ok":{"type":"boolean"}},"required":["name","age","ok"]}"#;
            let g = compiler.compile(&format!("{{\"grammars\": [{{\"json_schema\": {schema}}}]}}")).unwrap();
            let mut outs: HashMap<SeqId, Vec<i64>> = HashMap::new();
            for id in 0..7u64 {
                let p = RequestParams {
                    temperature: [0.0, 0.7, 1.5][id as usize % 3],
                    top_p: if id == 5 { 0.9 } else { 1.0 },
                    seed: Some(i128::from(id)),
                    fast_forward: id % 2 == 0,
                    ..req(40)
                };
                let grammar = (id != 6).then_some(&g);
                let forced = s.add_constrained(id as i128, &prompt(5, id as i64), &p, grammar, Steering::default()).unwrap();
                outs.entry(id).or_default().extend(forced.iter().map(|&t| i64::from(t)));
            }
            let mut state = 7u64;
            for _ in 0..200 {
                let Some(plan) = s.schedule() else { break };
                s.start_masks().unwrap();
                let n = plan.sample_seq_ids.len();
                // logits from a fixed stream: the same in both runs
                let logits: Vec<f32> = (0..n * v)
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (state >> 40) as f32 / (1u64 << 24) as f32 * 6.0
                    })
                    .collect();
                let drawn = s.sample(&logits, n, v, None).unwrap();
                for o in s.update(&drawn.iter().map(|d| d.token).collect::<Vec<_>>()).unwrap() {
                    let out = outs.entry(o.seq_id).or_default();
                    out.push(o.token);
                    out.extend(o.forced.iter().map(|&t| i64::from(t)));
                }
            }
            let stats: HashMap<_, _> = s.stats().into_iter().collect();
            (outs, stats)
        };
        let (overlap, before) = run(MaskPolicy::Overlap);
        let (on_demand, after) = run(MaskPolicy::OnDemand);
        assert_eq!(on_demand, overlap);
        assert_eq!((before["mask_rows_on_demand"], before["mask_rows_refused"]), (0, 0));
        // (uniform random logits: the grammar refuses most draws, yet keeps some)
        assert!(after["mask_rows_on_demand"] > after["mask_rows_refused"], "{after:?}");
        assert!(after["mask_rows_refused"] > 0, "{after:?}");
        assert!(after["mask_rows"] < before["mask_rows"], "{after:?} {before:?}");
    }

    #[test]
    fn fast_forward_appends_forced_tokens_as_a_chunk() {
        let (mut s, c, _, _) = setup();
        let g = c.compile(&lark("start: \"a\" \"name\" \"b\"")).unwrap();
        // "a" is forced from the start: appended to the output at once.
        let forced = s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
        assert!(!forced.is_empty());
        let plan = s.schedule().unwrap();
        assert_eq!(plan.num_tokens, 5 + forced.len());
        assert_eq!(plan.positions.last(), Some(&((4 + forced.len()) as i64)));
        assert_eq!(s.counters().forced_tokens, forced.len());
    }

    #[test]
    fn fast_forward_off_samples_the_same_tokens() {
        let run = |ff: bool| {
            let (mut s, c, v, eos) = setup();
            let g = c.compile(&lark("start: \"ab\" /[0-9]/ \"cd\"")).unwrap();
            let mut toks: Vec<u32> = s.add_constrained(1, &prompt(5, 0), &RequestParams { fast_forward: ff, ..req(20) }, Some(&g), Steering::default()).unwrap();
            for _ in 0..20 {
                let Some(plan) = s.schedule() else { break };
                let n = plan.sample_seq_ids.len();
                let out = s.sample(&favour(v, &vec![tok("7"); n]), n, v, None).unwrap();
                for o in s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap() {
                    toks.extend(u32::try_from(o.token));
                    toks.extend(o.forced);
                }
            }
            let text: Vec<u8> = toks.iter().filter(|&&t| t != eos).flat_map(|&t| vocab().0[t as usize].clone()).collect();
            (String::from_utf8(text).unwrap(), s.counters().forced_tokens)
        };
        let (on, forced_on) = run(true);
        let (off, forced_off) = run(false);
        assert_eq!(on, "ab7cd");
        assert_eq!(off, on);
        assert!(forced_on > 0);
        assert_eq!(forced_off, 0);
    }

    #[test]
    fn a_rejected_token_fails_the_row_with_a_message() {
        let (mut s, c, _, _) = setup();
        let g = c.compile(&lark("start: \"yes\"")).unwrap();
        s.add_constrained(1, &prompt(5, 0), &RequestParams { fast_forward: false, ..req(10) }, Some(&g), Steering::default()).unwrap();
        s.schedule().unwrap();
        let out = s.update(&[i64::from(tok("q"))]).unwrap();
        assert_eq!(out[0].finish_reason, Some(FinishReason::Error));
        assert_eq!(out[0].token, -1);
        assert!(out[0].error.as_deref().unwrap().contains("not allowed"));
        assert!(!s.has_unfinished());
    }

    #[test]
    fn masks_started_then_aborted_or_never_sampled_are_fine() {
        let (mut s, c, v, _) = setup();
        let g = c.compile(&lark("start: /[a-z]+/")).unwrap();
        s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
        s.add_constrained(2, &prompt(5, 1), &req(10), Some(&g), Steering::default()).unwrap();
        s.schedule().unwrap();
        s.start_masks().unwrap();
        s.abort(1);
        let out = s.sample(&favour(v, &[tok("1"), tok("1")]), 2, v, None).unwrap();
        assert_eq!(out[0].token, -1);
        assert!(out[1].token >= 0 && out[1].token != i64::from(tok("1")));
        // A plan whose masks were started but never sampled.
        s.schedule().unwrap();
        s.start_masks().unwrap();
        s.schedule().unwrap();
        let out = step(&mut s, v, &[tok("x")]);
        assert_eq!(out[0].finish_reason, None);
    }

    #[test]
    fn tokens_forced_at_the_start_are_not_counted_as_a_cached_prompt() {
        let (mut s, c, v, _) = setup();
        let g = c.compile(&lark(r#"start: "abcdefgh" /[a-z]+/"#)).unwrap();
        let (p, ff) = (prompt(8, 0), RequestParams { fast_forward: true, ..req(12) });
        for id in [1u64, 2] {
            assert_eq!(s.add_constrained(id.into(), &p, &ff, Some(&g), Steering::default()).unwrap().len(), 8);
            let out = step(&mut s, v, &[tok("x")]);
            // the second finds prompt and forced tokens in the cache
            assert_eq!(out[0].num_cached_tokens, if id == 1 { 0 } else { 8 });
            s.abort(id);
        }
        let stats: HashMap<_, _> = s.stats().into_iter().collect();
        assert_eq!((stats["prefix_cache_hit_tokens"], stats["prefix_cache_queries"]), (8, 16));
    }

    /// Run one closing request whose model always wants `want`; its text.
    fn closed_run(grammar: &str, max_tokens: i64, want: u32) -> (String, Option<FinishReason>, Option<String>) {
        scripted_run(grammar, max_tokens, &[want])
    }

    /// The same, with a model that wants `script[i]` at step i (the last
    /// one from then on).
    fn scripted_run(grammar: &str, max_tokens: i64, script: &[u32]) -> (String, Option<FinishReason>, Option<String>) {
        let (toks, reason, error) = steered_run(grammar, max_tokens, Steering::CLOSE, script);
        let text: Vec<u8> = toks.iter().flat_map(|&t| vocab().0[t as usize].clone()).collect();
        (String::from_utf8(text).unwrap(), reason, error)
    }

    /// Its tokens (end tokens left out), with any `steering`.
    fn steered_run(grammar: &str, max_tokens: i64, steering: Steering, script: &[u32]) -> (Vec<u32>, Option<FinishReason>, Option<String>) {
        let (mut s, c, v, eos) = setup();
        let g = c.compile(grammar).unwrap();
        let mut toks = s.add_constrained(1, &prompt(5, 0), &req(max_tokens), Some(&g), steering).unwrap();
        let mut last = (None, None);
        for i in 0..40 {
            let Some(plan) = s.schedule() else { break };
            let n = plan.sample_seq_ids.len();
            let want = script[i.min(script.len() - 1)];
            let out = s.sample(&favour(v, &vec![want; n]), n, v, None).unwrap();
            for o in s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap() {
                toks.extend(u32::try_from(o.token));
                toks.extend(o.forced);
                last = (o.finish_reason, o.error);
            }
        }
        assert!(toks.len() <= max_tokens as usize, "{toks:?}");
        toks.retain(|&t| t != eos);
        (toks, last.0, last.1)
    }

    fn object_schema() -> String {
        r#"{"grammars": [{"json_schema": {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}}, "required": ["s", "n"], "additionalProperties": false}}]}"#.into()
    }

    #[test]
    fn at_the_budget_the_output_is_closed_not_cut() {
        // The model would write "a" forever inside the string.
        let (text, reason, _) = closed_run(&object_schema(), 20, tok("a"));
        assert_eq!(reason, Some(FinishReason::Stop));
        assert!(text.starts_with("{") && text.contains("\"s\"") && text.ends_with('}'), "{text}");
        assert!(text.replace(' ', "").ends_with(r#"","n":1}"#), "{text}");
        // A regex grammar closes too.
        let (text, reason, _) = closed_run(&lark("start: /x[a-c]+y/"), 6, tok("a"));
        assert_eq!((text.as_str(), reason), ("xaaay", Some(FinishReason::Stop)));
    }

    #[test]
    fn a_completion_through_a_byte_the_model_never_writes_is_found() {
        // The lexeme /[a-z]*-/ ends only with a "-" the model never writes: the search
        // leaves it by its shortest way out, whatever the model wrote into it.
        let g = lark("start: /[a-z]*-/ /[a-z]*/ \"]\"");
        let (text, reason, err) = scripted_run(&g, 12, &[tok("a"), tok("b"), tok("-"), tok("c")]);
        assert_eq!((text.as_str(), reason), ("ab-ccccccc]", Some(FinishReason::Stop)), "{err:?}");
        let (text, reason, error) = closed_run(&g, 8, tok("a"));
        assert_eq!((text.as_str(), reason, error), ("aaaaa-]", Some(FinishReason::Stop), None));
    }

    #[test]
    fn a_step_that_opens_what_cannot_close_in_time_is_taken_back() {
        // After "x" the output may end; "," opens 30 digits that no
        // longer fit: the step is undone and the output ends at "x".
        let g = lark("start: /[a-z]/ (\",\" /[0-9]{30}/)*");
        let (text, reason, error) = scripted_run(&g, 24, &[tok("x"), tok(","), tok("1")]);
        assert_eq!((text.as_str(), reason, error), ("x", Some(FinishReason::Stop), None));
    }

    #[test]
    fn a_reasoning_block_ends_at_its_budget() {
        // The model would reason forever; from output length 4 on, the
        // end token replaces what it samples, and the answer follows.
        let (think, end) = (special("<think>"), special("</think>"));
        let g = lark(&format!("start: <[{think}]> /[a-z]*/ <[{end}]> \"ok\""));
        let steering = Steering { close_on_length: false, closed_as_length: false, reasoning_end: Some((end, 4)) };
        let (toks, reason, _) = steered_run(&g, 20, steering, &[think, tok("a")]);
        let a = tok("a");
        assert_eq!(toks, vec![think, a, a, a, end, tok("o"), tok("k")]);
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn a_reasoning_end_not_allowed_at_its_length_comes_a_token_later() {
        // At the budget the text is half of a pair ("a" of "ac"), as a
        // UTF-8 character half written byte by byte (its second byte
        // not forced: "c" or "d" may follow): the end comes once the
        // pair is whole.
        let (think, end) = (special("<think>"), special("</think>"));
        let g = lark(&format!("start: <[{think}]> /([ab][cd])*/ <[{end}]> \"ok\""));
        let steering = Steering { close_on_length: false, closed_as_length: false, reasoning_end: Some((end, 4)) };
        let (a, c) = (tok("a"), tok("c"));
        // (the grammar forces the block's start: the script is what follows)
        let script: Vec<u32> = [a, c].into_iter().cycle().take(40).collect();
        let (toks, reason, _) = steered_run(&g, 20, steering, &script);
        assert_eq!(toks, vec![think, a, c, a, c, end, tok("o"), tok("k")]);
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn a_budget_below_the_shortest_output_is_refused_before_it_starts() {
        let (mut s, c, _, _) = setup();
        let g = c.compile(&object_schema()).unwrap();
        let err = s.add_constrained(1, &prompt(5, 0), &req(5), Some(&g), Steering::CLOSE).unwrap_err();
        assert!(matches!(&err, Error::Invalid(m) if m.contains("shortest output the grammar allows needs")), "{err:?}");
        assert!(!s.has_unfinished(), "nothing is queued");
        // the same budget is taken where the output may be cut
        s.add_constrained(1, &prompt(5, 0), &req(5), Some(&g), Steering::default()).unwrap();
    }

    #[test]
    fn a_closed_output_ends_on_an_end_token_and_says_it_was_closed() {
        let (mut s, c, v, eos) = setup();
        let g = c.compile(&object_schema()).unwrap();
        for (id, as_length) in [(1u64, false), (2, true)] {
            let steering = Steering { closed_as_length: as_length, ..Steering::CLOSE };
            s.add_constrained(id.into(), &prompt(5, 0), &req(20), Some(&g), steering).unwrap();
            let mut toks = Vec::new();
            let done = loop {
                let out = step(&mut s, v, &[tok("a")]);
                toks.extend(u32::try_from(out[0].token));
                toks.extend(&out[0].forced);
                if out[0].finish_reason.is_some() {
                    break out[0].clone();
                }
            };
            assert!(done.closed && toks.len() <= 20, "{toks:?}");
            if as_length {
                assert_eq!(done.finish_reason, Some(FinishReason::Length));
                assert_ne!(toks.last(), Some(&eos));
            } else {
                // the closing left room for the end token, as the model's own end would
                assert_eq!((done.finish_reason, toks.last()), (Some(FinishReason::Stop), Some(&eos)));
            }
        }
    }

    #[test]
    fn end_tokens_are_allowed_where_the_grammar_accepts_despite_min_tokens() {
        let (mut s, c, v, eos) = setup();
        let g = c.compile(&lark("start: /[a-z]+/")).unwrap();
        let r = RequestParams { min_tokens: 5, ..req(10) };
        s.add_constrained(1, &prompt(5, 0), &r, Some(&g), Steering::default()).unwrap();
        step(&mut s, v, &[tok("x")]);
        let out = step(&mut s, v, &[eos]);
        assert_eq!(out[0].token, i64::from(eos));
        assert_eq!(out[0].finish_reason, Some(FinishReason::Stop));
    }
}

// ---- simulation against a fake model -------------------------------

/// A fake KV cache: each slot remembers the token written there. The
/// "model" reads a row's whole context through its block table, checks
/// it against the sequence's true tokens, and answers with a token that
/// depends only on that context; so every schedule, however chunked,
/// cached or preempted, must give the same outputs.
struct FakeModel {
    slots: Vec<Option<i64>>,
}

impl FakeModel {
    fn step(&mut self, s: &Scheduler, plan: &StepPlan, truth: &HashMap<u64, Vec<i64>>) -> Vec<i64> {
        for (slot, &tok) in plan.slot_mapping.iter().zip(&plan.input_ids) {
            self.slots[*slot as usize] = Some(tok);
        }
        let bs = s.cfg.block_size;
        let mut out = Vec::new();
        for (row, &id) in plan.seq_ids.iter().enumerate() {
            let ctx = plan.context_lens[row] as usize;
            let table = &plan.block_tables[row * plan.max_blocks..(row + 1) * plan.max_blocks];
            let seen: Vec<i64> = (0..ctx)
                .map(|p| self.slots[table[p / bs] as usize * bs + p % bs].expect("slot written"))
                .collect();
            let want = &truth[&(id as u64)][..ctx];
            assert_eq!(&seen[..], want, "KV of seq {id} through its block table");
            let end = plan.query_start_loc[row + 1] as i64 - 1;
            if plan.logits_indices.contains(&end) {
                let h = seen.iter().fold(17i64, |h, &t| (h * 31 + t) % 1_000_003);
                out.push(1 + h % 40);
            }
        }
        out
    }
}

type Outputs = HashMap<u64, Vec<i64>>;

fn simulate(c: SchedulerConfig, reqs: &[(Vec<i64>, i64)], aborts: &[(usize, u64)]) -> Outputs {
    simulate_counting(c, reqs, aborts).0
}

fn simulate_counting(c: SchedulerConfig, reqs: &[(Vec<i64>, i64)], aborts: &[(usize, u64)]) -> (Outputs, Counters) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut model = FakeModel { slots: vec![None; c.num_blocks * c.block_size] };
    let mut truth = HashMap::new();
    for (id, (p, max_tokens)) in reqs.iter().enumerate() {
        s.add_request(id as i128, p, &req(*max_tokens)).unwrap();
        truth.insert(id as u64, p.clone());
    }
    let mut done = HashMap::new();
    for step in 0..5_000 {
        for &(_, id) in aborts.iter().filter(|(at, _)| *at == step) {
            s.abort(id);
        }
        let Some(plan) = s.schedule() else { break };
        assert!(plan.num_tokens <= c.max_num_batched_tokens);
        assert!(plan.seq_ids.len() <= c.max_num_seqs);
        let mut slots = plan.slot_mapping.clone();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), plan.num_tokens, "no two tokens share a slot");
        let tokens = model.step(&s, &plan, &truth);
        for o in s.update(&tokens).unwrap() {
            let t = truth.get_mut(&o.seq_id).unwrap();
            t.push(o.token);
            if o.finish_reason.is_some() {
                done.insert(o.seq_id, t[reqs[o.seq_id as usize].0.len()..].to_vec());
            }
        }
    }
    assert!(!s.has_unfinished(), "everything finishes");
    assert_eq!(s.bm.num_free_blocks(), c.num_blocks, "no leaked blocks");
    (done, s.counters())
}

#[test]
fn tight_pool_preempts_and_hits_yet_matches_a_roomy_one() {
    let reqs: Vec<(Vec<i64>, i64)> = (0..6).map(|i| (prompt(20 + i, (i % 2) as i64 * 3), 12)).collect();
    let roomy = SchedulerConfig {
        num_blocks: 512, block_size: 4, max_num_seqs: 64, max_num_batched_tokens: 4096,
        max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: false,
        speculation: SpecConfig::default(),
        masks: MaskPolicy::Overlap,
    };
    let tight = SchedulerConfig { num_blocks: 14, max_num_seqs: 4, max_num_batched_tokens: 10, enable_prefix_caching: true, ..roomy.clone() };
    let (want, _) = simulate_counting(roomy, &reqs, &[]);
    let (got, counters) = simulate_counting(tight, &reqs, &[]);
    assert_eq!(got, want);
    assert!(counters.preemptions > 0, "{counters:?}");
    assert!(counters.prefix_cache_hit_tokens > 0, "{counters:?}");
}

fn workload() -> impl Strategy<Value = Vec<(Vec<i64>, i64)>> {
    // Prompts drawn from two shared stems so that the cache gets hits.
    let one = (0usize..2, 1usize..30, prop::collection::vec(1i64..6, 0..6), 1i64..12)
        .prop_map(|(stem, keep, tail, max_tokens)| {
            let stems = [prompt(30, 0), prompt(30, 3)];
            let mut p = stems[stem][..keep].to_vec();
            p.extend(tail);
            (p, max_tokens)
        });
    prop::collection::vec(one, 1..8)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn any_schedule_gives_the_same_outputs(
        reqs in workload(),
        num_blocks in 12usize..40,
        budget in 1usize..48,
        max_num_seqs in 1usize..6,
        caching in any::<bool>(),
    ) {
        let roomy = SchedulerConfig {
            num_blocks: 512, block_size: 4, max_num_seqs: 64, max_num_batched_tokens: 4096,
            max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: false,
            speculation: SpecConfig::default(),
            masks: MaskPolicy::Overlap,
        };
        let tight = SchedulerConfig {
            num_blocks, max_num_seqs, max_num_batched_tokens: budget,
            enable_prefix_caching: caching, ..roomy.clone()
        };
        let reference = simulate(roomy, &reqs, &[]);
        prop_assert_eq!(simulate(tight, &reqs, &[]), reference);
    }

    #[test]
    fn aborts_never_leak(reqs in workload(), aborts in prop::collection::vec((0usize..20, 0u64..8), 0..6)) {
        let c = SchedulerConfig {
            num_blocks: 16, block_size: 4, max_num_seqs: 4, max_num_batched_tokens: 16,
            max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: true,
            speculation: SpecConfig::default(),
            masks: MaskPolicy::Overlap,
        };
        simulate(c, &reqs, &aborts);
    }
}

/// A model of logits: the next token follows from the last two (so outputs
/// repeat and lookups find them) and, at every seventh position, from the
/// position too (so some drafts are refused); one token is 5 logits above
/// the rest.
struct LogitsModel {
    slots: Vec<Option<i64>>,
}

const SPEC_VOCAB: usize = 48;

impl LogitsModel {
    fn step(&mut self, s: &Scheduler, plan: &StepPlan, truth: &HashMap<u64, Vec<i64>>) -> Vec<f32> {
        for (i, &slot) in plan.slot_mapping.iter().enumerate() {
            self.slots[slot as usize] = Some(plan.input_ids[i]);
        }
        let bs = s.cfg.block_size;
        let mut logits = Vec::new();
        for &idx in &plan.logits_indices {
            let row = plan.query_start_loc[1..].iter().filter(|&&q| i64::from(q) <= idx).count();
            let pos = plan.positions[idx as usize] as usize;
            let table = &plan.block_tables[row * plan.max_blocks..(row + 1) * plan.max_blocks];
            let seen: Vec<i64> = (0..=pos).map(|p| self.slots[table[p / bs] as usize * bs + p % bs].expect("slot written")).collect();
            let real = &truth[&(plan.seq_ids[row] as u64)];
            let n = real.len().min(seen.len());
            assert_eq!(&seen[..n], &real[..n], "KV of the real tokens through the block table");
            let (a, b) = (seen[pos], if pos > 0 { seen[pos - 1] } else { 0 });
            let h = a * 3 + b + if pos % 7 == 0 { pos as i64 / 7 } else { 0 };
            let mut row_logits = vec![0.0f32; SPEC_VOCAB];
            row_logits[1 + h.rem_euclid(7) as usize] = 5.0;
            logits.extend(row_logits);
        }
        logits
    }
}

/// Run requests (prompt, max_tokens, seed: None is greedy) to the end
/// through sample() and update(); the outputs and counters.
fn simulate_sampled(c: SchedulerConfig, reqs: &[(Vec<i64>, i64, Option<i128>)]) -> (Outputs, Counters) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut model = LogitsModel { slots: vec![None; c.num_blocks * c.block_size] };
    let mut truth = HashMap::new();
    for (id, (p, max_tokens, seed)) in reqs.iter().enumerate() {
        let temperature = if seed.is_some() { 1.0 } else { 0.0 };
        s.add_request(id as i128, p, &RequestParams { temperature, seed: *seed, ..req(*max_tokens) }).unwrap();
        truth.insert(id as u64, p.clone());
    }
    let mut done = HashMap::new();
    for _ in 0..5_000 {
        let Some(plan) = s.schedule() else { break };
        assert!(plan.num_tokens <= c.max_num_batched_tokens);
        let logits = model.step(&s, &plan, &truth);
        let rows = plan.logits_indices.len();
        let drawn: Vec<i64> = s.sample(&logits, rows, SPEC_VOCAB, None).unwrap().iter().map(|d| d.token).collect();
        for o in s.update(&drawn).unwrap() {
            let t = truth.get_mut(&o.seq_id).unwrap();
            t.push(o.token);
            t.extend(o.forced.iter().chain(&o.more).map(|&x| i64::from(x)));
            if o.finish_reason.is_some() {
                done.insert(o.seq_id, t[reqs[o.seq_id as usize].0.len()..].to_vec());
            }
        }
    }
    assert!(!s.has_unfinished(), "everything finishes");
    assert_eq!(s.bm.num_free_blocks(), c.num_blocks, "no leaked blocks");
    (done, s.counters())
}

fn spec_workload() -> impl Strategy<Value = Vec<(Vec<i64>, i64, Option<i128>)>> {
    let one = (workload(), prop::option::of(0i128..1000)).prop_map(|(w, seed)| (w, seed));
    one.prop_map(|(w, seed)| w.into_iter().enumerate().map(|(i, (p, m))| (p, m + 12, seed.map(|s| s + i as i128))).collect())
}

#[test]
fn speculation_keeps_the_outputs_and_keeps_drafts() {
    let reqs: Vec<(Vec<i64>, i64, Option<i128>)> = (0..6).map(|i| (prompt(20 + i, (i % 2) as i64 * 3), 40, (i % 3 == 0).then_some(i as i128))).collect();
    let off = SchedulerConfig { max_model_len: 128, ..cfg(64, 4) };
    let on = SchedulerConfig { speculation: SpecConfig { by_default: true, max_tokens: 6, drafter: Drafter::Lookup }, ..off.clone() };
    let (want, _) = simulate_sampled(off, &reqs);
    let (got, counters) = simulate_sampled(on, &reqs);
    assert_eq!(got, want);
    let d = counters.drafts;
    assert!(d.steps > 0 && d.lookups_kept > 0, "{counters:?}");
    assert!(d.lookups_kept < d.lookups, "some drafts are refused: {counters:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]
    #[test]
    fn any_draft_under_any_schedule_gives_the_outputs_without(
        reqs in spec_workload(),
        num_blocks in 16usize..48,
        budget in 1usize..48,
        max_num_seqs in 1usize..6,
        caching in any::<bool>(),
        max_tokens in 1usize..8,
        random in prop::option::of(0u64..100),
    ) {
        let roomy = SchedulerConfig {
            num_blocks: 512, block_size: 4, max_num_seqs: 64, max_num_batched_tokens: 4096,
            max_model_len: 64, eos_token_ids: vec![0], enable_prefix_caching: false,
            speculation: SpecConfig::default(),
            masks: MaskPolicy::Overlap,
        };
        let drafter = random.map_or(Drafter::Lookup, Drafter::Random);
        let tight = SchedulerConfig {
            num_blocks, max_num_seqs, max_num_batched_tokens: budget, enable_prefix_caching: caching,
            speculation: SpecConfig { by_default: true, max_tokens, drafter },
            ..roomy.clone()
        };
        let (reference, _) = simulate_sampled(roomy, &reqs);
        prop_assert_eq!(simulate_sampled(tight, &reqs).0, reference);
    }
}
