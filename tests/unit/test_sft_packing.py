"""SFT samples: best-fit bins never split an example, positions and segments restart, an example's last position
and the padding are never trained, and the (tokens, labels, loss_mask) items give plain transformers' loss."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter.data.sft.bins import SFTDataset, best_fit, targets, write_split
from tests.helpers.runs import vocab_of


def test_targets_shift_inside_examples_only():
    labels = np.array([-100, 11, 12, -100, 21, 22, 23])  # examples [0,3) and [3,7)
    assert targets(labels, np.array([0, 3, 7])).tolist() == [11, 12, -1, 21, 22, 23, -1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=40), st.integers(16, 24))
def test_best_fit_partitions_within_capacity(lengths, cap):
    bins = best_fit(np.array(lengths), cap)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap and b == sorted(b) for b in bins)
    assert len(bins) <= 2 * sum(lengths) / cap + 1  # any fit rule leaves bins at most half empty on average


def _examples(lengths, trained_bits):
    """Example e holds tokens 100(e+1)+j: the owner of every token is readable from its value."""
    ids = np.concatenate([100 * (e + 1) + np.arange(n) for e, n in enumerate(lengths)]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    labels = np.where(np.resize(np.asarray(trained_bits, bool), len(ids)), ids, -100)
    return ids, labels, offsets


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=30), st.lists(st.booleans(), min_size=1, max_size=7),
       st.booleans())
def test_samples_keep_examples_whole_and_mask_boundaries(tmp_path_factory, lengths, bits, pack):
    seq = 12
    ids, labels, offsets = _examples(lengths, bits)
    d = tmp_path_factory.mktemp("split")
    stats = write_split(d, ids, targets(labels, offsets), offsets, seq, pack)
    ds = SFTDataset(d, seq, pad_id=7)
    assert stats["packing_efficiency"] == round(sum(lengths) / (len(ds) * seq), 4)
    if not pack:
        assert len(ds) == len(lengths)
    seen, trained = [], 0
    for i in range(len(ds)):
        s = ds[i]
        assert {k: (v.shape, v.dtype.kind) for k, v in s.items()} == {
            "tokens": ((seq,), "i"), "labels": ((seq,), "i"), "loss_mask": ((seq,), "f"),
            "position_ids": ((seq,), "i"), "segment_ids": ((seq,), "i"), "attention_mask": ((seq,), "i")}
        owner = np.where(s["tokens"] >= 100, s["tokens"] // 100 - 1, -1)  # -1: padding (token 7)
        n = int((owner >= 0).sum())
        assert (owner[:n] >= 0).all() and (s["tokens"][n:] == 7).all()  # examples first, then padding
        assert (s["attention_mask"] == (owner >= 0)).all()  # the real tokens, as a collator's attention_mask
        starts = np.r_[True, owner[1:] != owner[:-1]]
        assert ((s["position_ids"] == 0) == starts).all() and (np.diff(s["position_ids"])[~starts[1:]] == 1).all()
        assert (s["segment_ids"] == np.cumsum(starts) - 1).all()
        for e in np.unique(owner[:n]):
            where = np.flatnonzero(owner == e)
            assert len(where) == lengths[e] and (np.diff(where) == 1).all()  # whole, in one bin
            assert s["loss_mask"][where[-1]] == 0  # never predicts the next example's first token
            seen.append(int(e))
        m = s["loss_mask"] > 0
        assert not m[n:].any() and (s["labels"][~m] == 0).all()  # padding never trained
        nxt = np.r_[s["tokens"][1:], -1]
        assert (s["labels"][m] == nxt[m]).all() and (owner[m] == np.r_[owner[1:], -2][m]).all()
        trained += int(m.sum())
    assert sorted(seen) == list(range(len(lengths)))
    assert trained == stats["trained_tokens"] == int((targets(labels, offsets) >= 0).sum())


def test_items_give_transformers_loss_with_its_own_assistant_mask(tmp_path):
    """Reference: plain transformers on each example, labels from its `return_assistant_tokens_mask` on a marked
    template. Our samples (rendered with the unmarked template, packed) must give the same summed loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.data.sft import prepare
    from adapter.demo.build import CHAT_DATA
    from tests.helpers.sft_data import axolotl_cfg, tiny_model

    model_dir = tiny_model(tmp_path, weights=True)
    marked = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
              "{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}")
    cfg = axolotl_cfg(model_dir, [{"path": str(CHAT_DATA), "type": "chat_template", "chat_template": "chatml"}],
                      tmp_path, sample_packing=True, sequence_len=256, special_tokens={"eos_token": "<|im_end|>"})
    data = prepare(cfg, model_dir, vocab_of(cfg), progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(model_dir))
    reference = {}
    for line in CHAT_DATA.read_text().splitlines():
        ref = tok.apply_chat_template(json.loads(line)["messages"], chat_template=marked, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        reference[tuple(ref["input_ids"])] = ref["assistant_masks"]
    checked = 0
    with torch.no_grad():
        for i in range(len(data.train)):
            s, bounds = data.train[i], data.train.examples(i)
            for a, b in zip(bounds[:-1], bounds[1:]):
                ids = torch.as_tensor(s["tokens"][a:b])[None]
                mask = reference[tuple(ids[0].tolist())]
                hf_labels = torch.where(torch.as_tensor(mask, dtype=torch.bool), ids[0], -100)[None]
                out = model(input_ids=ids, labels=hf_labels)
                n = int((hf_labels[0, 1:] != -100).sum())
                logits = out.logits[0].float()
                ours = torch.nn.functional.cross_entropy(logits, torch.as_tensor(s["labels"][a:b]), reduction="none")
                ours = (ours * torch.as_tensor(s["loss_mask"][a:b])).sum()
                assert int(s["loss_mask"][a:b].sum()) == n
                assert torch.allclose(ours, out.loss * n, rtol=1e-5), (i, float(ours), float(out.loss * n))
                checked += 1
    assert checked == data.stats["train"]["examples"] == 52 and data.stats["train"]["bins"] < 52  # packed


@pytest.mark.parametrize("pack", [True, False])
def test_unpacked_samples_hold_one_example_each(tmp_path, pack):
    ids, labels, offsets = _examples([5, 3, 4, 2], [False, True])
    write_split(tmp_path, ids, targets(labels, offsets), offsets, 8, pack)
    ds = SFTDataset(tmp_path, 8, pad_id=0)
    assert len(ds) == (2 if pack else 4)  # best fit: [5, 3] fill one bin, [4, 2] the next
    if not pack:
        assert ds[1]["tokens"].tolist() == [200, 201, 202, 0, 0, 0, 0, 0]
        assert ds[1]["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        assert ds[1]["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
        # labels of 200, 201, 202 are (trained, not, trained): position 1 predicts 202; the last position nothing
        assert ds[1]["loss_mask"].tolist() == [0, 1, 0, 0, 0, 0, 0, 0] and ds[1]["labels"][1] == 202


def test_trim_tail_keeps_every_trained_position_in_whole_multiples():
    import torch

    from adapter.data.sft.bins import trim_tail

    mask = torch.zeros(3, 256)
    mask[0, 3:10] = 1
    mask[2, 100:131] = 1  # the micro-batch's last trained position: 130
    batch = {"tokens": torch.arange(768).reshape(3, 256), "loss_mask": mask, "labels": torch.ones(3, 256)}
    cut = trim_tail(batch, 64)
    assert {k: tuple(v.shape) for k, v in cut.items()} == {k: (3, 192) for k in batch}
    assert cut["loss_mask"].sum() == mask.sum() and torch.equal(cut["tokens"], batch["tokens"][:, :192])
    assert trim_tail(batch, 200)["tokens"].shape == (3, 200) and trim_tail(batch, 256) is batch  # whole: as is
    assert trim_tail({**batch, "loss_mask": torch.zeros(3, 256)}, 64)["tokens"].shape == (3, 64)  # nothing trained
