"""The layout-free form of a TP-split parameter (adapter/models/mapping.py's merge_blocks / cut_blocks, which
adapter/train/reshard.py and the packed LoRA adapters use): merging the pieces of one tp and cutting
for another gives what the other tp's build holds, for plain, [gate; up] and vocabulary-padded tensors."""
from __future__ import annotations

import pytest
import torch

from adapter.errors import UserError
from adapter.models.mapping import cut_blocks as cut
from adapter.models.mapping import merge_blocks as merge
from adapter.train.reshard import repad


def _pieces(whole, axis, parts, tp):
    return [cut(whole, axis, parts, tp, r) for r in range(tp)]


@pytest.mark.parametrize("axis,parts", [(0, 1), (1, 1), (0, 2), (None, 1)])
@pytest.mark.parametrize("tp_from,tp_to", [(1, 2), (2, 4), (4, 2), (2, 1)])
def test_merge_then_cut_moves_between_tps(axis, parts, tp_from, tp_to):
    whole = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    again = merge(_pieces(whole, axis, parts, tp_from), axis, parts)
    assert torch.equal(again, whole)
    for r, piece in enumerate(_pieces(again, axis, parts, tp_to)):
        assert torch.equal(piece, cut(whole, axis, parts, tp_to, r))


def test_gate_up_pieces_are_per_rank_blocks():
    """Rank r of [gate; up] holds [gate_r; up_r]: a plain chunk of the concatenation (the negative control) differs."""
    gate, up = torch.zeros(4, 2), torch.ones(4, 2)
    whole = torch.cat([gate, up])
    first = cut(whole, 0, 2, 2, 0)
    assert torch.equal(first, torch.cat([gate[:2], up[:2]]))
    assert not torch.equal(first, whole.chunk(2)[0])
    assert torch.equal(merge([first, cut(whole, 0, 2, 2, 1)], 0, 2), whole)


def test_vocabulary_padding_is_redone_for_the_new_tp():
    real = torch.randn(10, 4)
    padded = torch.cat([real, torch.zeros(6, 4)])  # 16 rows: padded for the saved tp
    again = repad(padded, 12, 10, "embedding.word_embeddings.weight", "load_dir", "ck")
    assert again.shape == (12, 4) and torch.equal(again[:10], real) and not again[10:].any()
    assert repad(padded, 16, 10, "e", "load_dir", "ck") is padded
    padded[12, 0] = 1.0  # a padding row that trained cannot be dropped
    with pytest.raises(UserError, match="non-zero rows in its vocabulary padding"):
        repad(padded, 12, 10, "embedding.word_embeddings.weight", "load_dir", "ck")
