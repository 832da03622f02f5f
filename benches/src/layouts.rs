//! The state-dict layouts of the PyTorch anchors that move a model's weights
//! (`torch_handoff_bench.py`, `torch_refit_bench.py`): the shape of every tensor, in order, and the
//! bytes of one element.

/// The layouts by name: a GPT-2-small-like model in fp32 (`gpt2`), a Llama-7B-shaped one in bf16
/// (`7b`), and a mixture of experts in bf16 (`moe`: 24 layers of 128 experts, 9 387 tensors).
pub const NAMES: [&str; 3] = ["gpt2", "7b", "moe"];

/// The shapes of layout `name` and the bytes of one element, or `None` for an unknown name.
#[must_use]
pub fn shapes(name: &str) -> Option<(Vec<Vec<u64>>, u64)> {
    let mut shapes: Vec<Vec<u64>> = Vec::new();
    match name {
        "gpt2" => {
            let (d, v, layers) = (768, 50257, 12);
            shapes.extend([vec![v, d], vec![1024, d]]);
            for _ in 0..layers {
                shapes.extend([
                    vec![d],
                    vec![d],
                    vec![d, 3 * d],
                    vec![3 * d],
                    vec![d, d],
                    vec![d],
                    vec![d],
                    vec![d],
                    vec![d, 4 * d],
                    vec![4 * d],
                    vec![4 * d, d],
                    vec![d],
                ]);
            }
            shapes.extend([vec![d], vec![d]]);
            Some((shapes, 4))
        }
        "7b" => {
            let (d, f, v, layers) = (4096, 11008, 32000, 32);
            shapes.push(vec![v, d]);
            for _ in 0..layers {
                shapes.extend([vec![d, d], vec![d, d], vec![d, d], vec![d, d]]);
                shapes.extend([vec![f, d], vec![f, d], vec![d, f], vec![d], vec![d]]);
            }
            shapes.extend([vec![d], vec![v, d]]);
            Some((shapes, 2))
        }
        "moe" => {
            let (d, f, v, layers, experts) = (2048, 768, 151936, 24, 128);
            shapes.push(vec![v, d]);
            for _ in 0..layers {
                shapes.extend([vec![d, d], vec![d, d], vec![d, d], vec![d, d]]);
                shapes.extend([vec![d], vec![d], vec![experts, d]]);
                for _ in 0..experts {
                    shapes.extend([vec![f, d], vec![f, d], vec![d, f]]);
                }
            }
            shapes.extend([vec![d], vec![v, d]]);
            Some((shapes, 2))
        }
        _ => None,
    }
}

/// The bytes of each tensor of layout `name` (empty for an unknown name).
#[must_use]
pub fn sizes(name: &str) -> Vec<usize> {
    shapes(name).map_or_else(Vec::new, |(shapes, elem)| {
        shapes
            .iter()
            .map(|s| (s.iter().product::<u64>() * elem) as usize)
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_anchors_counts() {
        let count = |n| shapes(n).unwrap().0.len();
        assert_eq!((count("gpt2"), count("7b"), count("moe")), (148, 291, 9387));
        assert_eq!(sizes("7b").iter().sum::<usize>(), 13_476_831_232);
        assert_eq!(sizes("moe").iter().sum::<usize>(), 31_053_778_944);
        assert_eq!(sizes("gpt2").iter().sum::<usize>(), 497_759_232);
    }
}
