"""bench/vs_trl.py's pure parts: the CPU stand-in for TRL's varlen flash attention, the reward, the table."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from bench import vs_trl  # noqa: E402


def _sdpa(q, k, v, mask):
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def test_cpu_varlen_attention_matches_causal_attention_per_segment():
    vs_trl.patch_trl_for_cpu()
    from trl.experimental.async_grpo import packing

    attn = packing._flash_attn().flash_attn_varlen_func
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = attn(q, k, v, cu, cu, 6, 6, causal=True)
    for s, e in ((0, 4), (4, 10)):
        mask = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        torch.testing.assert_close(out[s:e], _sdpa(q[s:e], k[s:e], v[s:e], mask))
    # Fewer queries than keys (a tree row's branch): aligned bottom-right, as flash attention does.
    out = attn(q[:2], k[:5], v[:5], cu[:2] // 2, torch.tensor([0, 5], dtype=torch.int32), 2, 5, causal=True)
    torch.testing.assert_close(out, _sdpa(q[:2], k[:5], v[:5], torch.ones(2, 5, dtype=torch.bool).tril(3)))


def test_reward_scores_decoded_ids_like_exact_answer():
    class Tok:
        def batch_decode(self, ids, skip_special_tokens):
            return ["".join(map(str, row)) for row in ids]

    reward = vs_trl.ExactAnswerOfIds(Tok())
    assert reward(completions=[[], []], completion_ids=[[4, 6], [4, 7]], answer=["46", "46"]) == [1.0, 0.0]


def test_checkpoint_rows_and_table():
    points = {
        20: {"accuracy": 0.7, "wall_s": 10.0, "samples": 2560},
        10: {"accuracy": 0.6, "wall_s": 5.0, "samples": 1280},
    }
    rows = vs_trl.checkpoint_rows(points, 0.5)
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[1]["gain"] == pytest.approx(0.2)
    assert rows[1]["gain_per_1k_samples"] == pytest.approx(0.2 / 2.56)
    trl = vs_trl.checkpoint_rows({10: {**points[10], "wall_s": 50.0}, 20: {**points[20], "wall_s": 100.0}}, 0.5)
    table = vs_trl.table_rows([{"seed": 1, "spotrl": rows, "trl": trl}])
    assert table[0][-1] == "10.0x" and table[1][3] == "+0.000"
