//! A mixture-of-experts MLP's routing (model/moe.py's twin): which experts
//! each token takes and their weights, from its router logits.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// a softmax over all experts, then the top k (Qwen3-MoE)
    Softmax,
    /// the top k logits, then a softmax over them (gpt-oss)
    SoftmaxTopK,
    /// sigmoids, chosen with a selection bias and expert groups (GLM-4.5)
    Sigmoid,
}

/// How a router's logits choose experts (MoEConfig's fields).
#[derive(Clone, Debug)]
pub struct Routing {
    pub scoring: Scoring,
    /// added to the scores when choosing, not when weighting (GLM)
    pub selection_bias: Option<Vec<f32>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling: f32,
    /// experts are chosen from the best `topk_groups` of `groups` groups
    pub groups: usize,
    pub topk_groups: usize,
}

/// A token's experts and their weights, from its router logits.
pub fn route(m: &Routing, logits: &[f32]) -> Vec<(usize, f32)> {
    let n = logits.len();
    let top = |scores: &[f32], k: usize| -> Vec<usize> {
        let mut idx: Vec<usize> = (0..scores.len()).collect();
        // highest first; equal scores keep the lower index first
        idx.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    };
    let mut chosen: Vec<(usize, f32)> = match m.scoring {
        Scoring::Softmax => {
            let p = softmax(logits);
            top(&p, m.top_k).into_iter().map(|e| (e, p[e])).collect()
        }
        Scoring::SoftmaxTopK => {
            let experts = top(logits, m.top_k);
            let picked: Vec<f32> = experts.iter().map(|&e| logits[e]).collect();
            experts.into_iter().zip(softmax(&picked)).collect()
        }
        Scoring::Sigmoid => {
            let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
            let mut choice: Vec<f32> = match &m.selection_bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            if m.groups > 1 {
                let size = n / m.groups;
                let group_scores: Vec<f32> = choice
                    .chunks_exact(size)
                    .map(|g| {
                        let best = top(g, 2.min(size));
                        best.iter().map(|&i| g[i]).sum()
                    })
                    .collect();
                let keep = top(&group_scores, m.topk_groups);
                for (gi, g) in choice.chunks_exact_mut(size).enumerate() {
                    if !keep.contains(&gi) {
                        g.fill(f32::NEG_INFINITY);
                    }
                }
            }
            top(&choice, m.top_k).into_iter().map(|e| (e, scores[e])).collect()
        }
    };
    if m.norm_topk_prob {
        let eps = if m.scoring == Scoring::Sigmoid { 1e-20 } else { 0.0 };
        let sum: f32 = chosen.iter().map(|c| c.1).sum::<f32>() + eps;
        chosen.iter_mut().for_each(|c| c.1 /= sum);
    }
    chosen.iter_mut().for_each(|c| c.1 *= m.routed_scaling);
    chosen
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}


#[cfg(test)]
mod tests {
    use super::*;

    fn routing(scoring: Scoring) -> Routing {
        Routing { scoring, selection_bias: None, top_k: 2, norm_topk_prob: true, routed_scaling: 1.0, groups: 1, topk_groups: 1 }
    }

    #[test]
    fn each_scoring_picks_the_best_experts_and_weighs_them() {
        let logits = [0.1, 2.0, -1.0, 1.0];
        let close = |a: &[(usize, f32)], b: &[(usize, f32)]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.0 == y.0 && (x.1 - y.1).abs() < 1e-6);
        // a softmax over all four, the top two renormalised
        let e: Vec<f32> = logits.iter().map(|l: &f32| l.exp()).collect();
        let want = [(1, e[1] / (e[1] + e[3])), (3, e[3] / (e[1] + e[3]))];
        assert!(close(&route(&routing(Scoring::Softmax), &logits), &want));
        assert!(close(&route(&routing(Scoring::SoftmaxTopK), &logits), &want));
        // sigmoid: a selection bias moves the choice but not the weights
        let mut r = routing(Scoring::Sigmoid);
        r.selection_bias = Some(vec![0.0, 0.0, 5.0, 0.0]);
        r.norm_topk_prob = false;
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert!(close(&route(&r, &logits), &[(2, s(-1.0)), (1, s(2.0))]));
        // groups: the best group by its top two, then the best experts in it
        r.selection_bias = None;
        r.groups = 2;
        r.topk_groups = 1;
        assert!(close(&route(&r, &[3.0, -5.0, 1.0, 1.0]), &[(2, s(1.0)), (3, s(1.0))]));
    }
}
