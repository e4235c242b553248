"""Data pipeline: reading, token cache (one builder, atomic), packing with document masking, DP sampler, batches."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapter import data as D
from adapter.data import token_cache
from adapter.errors import UserError
from adapter.kernels import thd


def _cache(doc_lens):
    """Document d holds tokens 10(d+1), 10(d+1)+1, ...: the owner of every token is readable from its value."""
    toks = np.concatenate([10 * (d + 1) + np.arange(n) for d, n in enumerate(doc_lens)]).astype(np.uint32)
    return D.TokenCache(toks, np.concatenate([[0], np.cumsum(doc_lens)]).astype(np.int64), Path("mem"))


def test_packing_by_hand():
    ds = D.PackedDataset(_cache([3, 5, 2, 7]), 4)  # 17 tokens -> (17-1)//4 = 4 samples
    assert len(ds) == 4
    want = [  # tokens, labels, loss_mask, position_ids, segment_ids
        ([10, 11, 12, 20], [11, 12, 20, 21], [1, 1, 0, 1], [0, 1, 2, 0], [0, 0, 0, 1]),
        ([21, 22, 23, 24], [22, 23, 24, 30], [1, 1, 1, 0], [0, 1, 2, 3], [0, 0, 0, 0]),
        ([30, 31, 40, 41], [31, 40, 41, 42], [1, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1]),
        ([42, 43, 44, 45], [43, 44, 45, 46], [1, 1, 1, 1], [0, 1, 2, 3], [0, 0, 0, 0]),
    ]
    for i, w in enumerate(want):
        got = ds[i]
        for key, expect in zip(("tokens", "labels", "loss_mask", "position_ids", "segment_ids"), w):
            assert got[key].tolist() == expect, (i, key)
    with pytest.raises(IndexError):
        ds[4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 8))
def test_packing_never_crosses_documents(doc_lens, seq_len):
    if sum(doc_lens) < seq_len + 1:
        with pytest.raises(UserError, match="data.files"):
            D.PackedDataset(_cache(doc_lens), seq_len)
        return
    ds = D.PackedDataset(_cache(doc_lens), seq_len)
    for i in range(len(ds)):
        s = ds[i]
        owner_in, owner_lab = s["tokens"] // 10, s["labels"] // 10
        assert (s["loss_mask"] == (owner_in == owner_lab)).all()
        assert (s["segment_ids"] == owner_in - owner_in[0]).all()
        starts = np.r_[True, owner_in[1:] != owner_in[:-1]]
        assert ((s["position_ids"] == 0) == starts).all()
        assert (np.diff(s["position_ids"])[~starts[1:]] == 1).all()


def test_sampler_splits_rounds_across_dp_ranks():
    samplers = [D.DPSampler(50, dp_rank=r, dp_size=3, micro_batch=4, seed=1) for r in range(3)]
    assert samplers[0].batches_per_epoch == 4  # 50 // 12; the 2-sample tail is skipped
    streams = [iter(s) for s in samplers]
    epoch0 = [[next(it) for _ in range(4)] for it in streams]
    flat = [i for rank in epoch0 for b in rank for i in b]
    assert len(flat) == len(set(flat)) == 48
    assert np.concatenate(sum(zip(*epoch0), ())).tolist() == samplers[0].order(0)[:48].tolist()
    nxt = next(streams[0])
    assert samplers[0].epoch == 1 and nxt == samplers[0].order(1)[:4].tolist()
    assert samplers[0].order(1).tolist() != samplers[0].order(0).tolist()
    # a TP/CP peer (same dp_rank) sees exactly the same batches
    peer = iter(D.DPSampler(50, dp_rank=0, dp_size=3, micro_batch=4, seed=1))
    assert [next(peer) for _ in range(5)] == epoch0[0] + [nxt]


def test_sampler_resume_is_exact_and_layout_independent():
    ref = D.DPSampler(40, dp_rank=1, dp_size=2, micro_batch=3, seed=3)
    it = iter(ref)
    head = [next(it) for _ in range(8)]  # crosses an epoch (6 rounds of 6 per epoch)
    state = json.loads(json.dumps(ref.state_dict()))  # survives a JSON round trip
    tail = [next(it) for _ in range(10)]
    again = D.DPSampler(40, dp_rank=1, dp_size=2, micro_batch=3, seed=999)
    again.load_state_dict(state)
    it2 = iter(again)
    assert len(head) == 8 and [next(it2) for _ in range(10)] == tail
    # resuming with dp_size 3, micro_batch 2 continues at the same place in the same permutation
    new = [D.DPSampler(40, dp_rank=r, dp_size=3, micro_batch=2, seed=0) for r in range(3)]
    for s in new:
        s.load_state_dict(state)
    got = sorted(i for s in new for i in next(iter(s)))
    assert got == sorted(ref.order(state["epoch"])[state["offset"]:state["offset"] + 6].tolist())
    with pytest.raises(UserError, match=r"^data\.files=41: .*Fix:"):
        D.DPSampler(41, dp_rank=0, dp_size=1, micro_batch=1).load_state_dict(state)


def test_sampler_refuses_too_little_data():
    with pytest.raises(UserError, match=r"^data\.files=5: .*dp_size×micro_batch = 8"):
        D.DPSampler(5, dp_rank=0, dp_size=2, micro_batch=4)


def test_build_batches_shapes_and_masks():
    ds = D.PackedDataset(_cache([3, 5, 2, 7, 9, 4]), 4)
    batch = next(D.build_batches(ds, D.DPSampler(len(ds), dp_rank=0, dp_size=1, micro_batch=2, shuffle=False)))
    import torch

    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((2, 4), torch.int64), "labels": ((2, 4), torch.int64), "loss_mask": ((2, 4), torch.float32),
        "position_ids": ((2, 4), torch.int64), "segment_ids": ((2, 4), torch.int64)}
    assert thd.cu_seqlens(batch["segment_ids"]).tolist() == [0, 3, 4, 8]  # [0,0,0,1] [0,0,0,0]
    mask = thd.document_attention_mask(batch["segment_ids"])
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].tolist() == [[False, True, True, True], [False, False, True, True],
                                   [False, False, False, True], [True, True, True, False]]


class _Rendered:
    """A dataset whose `collate` does the work (as image-text rows' processor does); row 13 is a bad row."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"row": np.array([i])}

    def collate(self, items):
        import torch

        rows = [int(it["row"][0]) for it in items]
        if 13 in rows:
            raise UserError("datasets[0] row 13: the image cannot be read. Fix: mend or drop the row")
        return {"tokens": torch.tensor(rows)[:, None] * torch.ones(1, 3, dtype=torch.int64)}


def test_worker_batches_equal_and_resume_exact():
    """Micro-batches rendered ahead by worker processes: the same batches in the same order, the sampler's state
    that of the batches handed over (not of those rendered ahead), and a worker's UserError raised as it is."""
    def run(workers, n=12, take=5, state=None):
        s = D.DPSampler(n, dp_rank=1, dp_size=2, micro_batch=2, seed=3)
        if state:
            s.load_state_dict(state)
        it = D.build_batches(_Rendered(n), s, workers=workers, prefetch=3)
        got = [next(it)["tokens"][:, 0].tolist() for _ in range(take)]
        return got, s.state_dict()

    plain, plain_state = run(0)
    ahead, ahead_state = run(2)
    assert ahead == plain and ahead_state == plain_state  # 5 of 6 batches an epoch handed over: mid-epoch 2
    assert run(2, state=ahead_state)[0] == run(0, state=plain_state)[0]  # resumed: the same next batches
    # a cluster's SIGTERM reaches the workers too: they stay, and the step the signal asks to finish gets its batches
    import multiprocessing
    import os
    import signal

    it = D.build_batches(_Rendered(12), D.DPSampler(12, dp_rank=0, dp_size=1, micro_batch=2, shuffle=False),
                         workers=1, stop_signals=(int(signal.SIGTERM),))
    assert next(it)["tokens"][:, 0].tolist() == [0, 1]
    workers = multiprocessing.active_children()
    assert workers
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
    import time

    time.sleep(0.5)
    assert [next(it)["tokens"][0, 0].item() for _ in range(4)] == [2, 4, 6, 8] and all(w.is_alive() for w in workers)
    it.close()
    with pytest.raises(UserError, match="^datasets\\[0\\] row 13: the image cannot be read"):
        for _ in D.build_batches(_Rendered(16), D.DPSampler(16, dp_rank=0, dp_size=1, micro_batch=16,
                                                            shuffle=False), workers=1):
            pass


# --- files, tokenizer, cache ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from adapter.demo.build import DEMO_TEXT, train_tokenizer

    return train_tokenizer([DEMO_TEXT], tmp_path_factory.mktemp("t") / "tok", vocab_size=300)


@pytest.fixture
def corpus(tmp_path):
    docs = ["In the beginning.", "Two\nlines here.", "Third document, and the last of the txt file.", "Fourth."]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[:2]) + "\n")
    (tmp_path / "b.txt").write_text(f"{docs[2]}\n\n \n{docs[3]}\n")
    return tmp_path, docs


def test_cache_tokenises_each_document_with_eos(tok_dir, corpus):
    from transformers import AutoTokenizer

    root, docs = corpus
    cache = D.build_token_cache([root / "a.jsonl", root / "b.txt"], tok_dir, root / "cache", text_key="body",
                                progress=False)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(cache.doc_offsets) == len(docs) + 1 and cache.tokens.dtype == np.uint32
    for d, text in enumerate(docs):
        ids = cache.tokens[cache.doc_offsets[d]:cache.doc_offsets[d + 1]].tolist()
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    manifest = json.loads((cache.path / "manifest.json").read_text())
    assert manifest["num_documents"] == 4 and manifest["num_tokens"] == len(cache.tokens)


def test_cache_is_reused_and_keyed_on_file_contents(tok_dir, corpus, monkeypatch):
    root, _ = corpus
    files = [root / "b.txt"]
    first = D.build_token_cache(files, tok_dir, root / "cache", progress=False)
    (root / "cache" / ".tokens-x.tmp-1").mkdir()  # a crashed builder's leftover is ignored
    monkeypatch.setattr(token_cache, "_tokenize_into", lambda *a: pytest.fail("re-tokenised"))
    assert D.build_token_cache(files, tok_dir, root / "cache").path == first.path
    monkeypatch.undo()
    (root / "b.txt").write_text("Changed text, longer than before.\n")
    assert D.build_token_cache(files, tok_dir, root / "cache", progress=False).path != first.path


def _two_ranks(fn):
    """Run fn(builder, barrier) as builder and non-builder threads; the non-builder starts first."""
    barrier, out = threading.Barrier(2, timeout=60), {}

    def run(builder):
        try:
            out[builder] = fn(builder, barrier.wait)
        except Exception as e:  # noqa: BLE001
            out[builder] = e

    threads = [threading.Thread(target=run, args=(b,)) for b in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[True], out[False]


def test_only_the_builder_tokenises_and_others_wait(tok_dir, corpus):
    root, _ = corpus
    built, waited = _two_ranks(lambda builder, barrier: D.build_token_cache(
        [root / "a.jsonl"], tok_dir, root / "cache", text_key="body", builder=builder, barrier=barrier,
        progress=False))
    assert built.path == waited.path and (waited.tokens == built.tokens).all()


def test_builder_error_reaches_every_rank(tok_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    errs = _two_ranks(lambda builder, barrier: D.build_token_cache(
        [tmp_path / "bad.jsonl"], tok_dir, tmp_path / "cache", builder=builder, barrier=barrier, progress=False))
    assert all(isinstance(e, UserError) for e in errs), errs
    assert str(errs[0]) == str(errs[1])
    assert str(errs[0]).startswith(f"data.files='{tmp_path / 'bad.jsonl'}:2': line is not valid JSON")
    assert not any(p.name.startswith("tokens-") and p.is_dir() for p in (tmp_path / "cache").iterdir())


@pytest.mark.parametrize("setup, match", [
    (lambda p: None, r"^data\.files='.*missing\.jsonl': no such file\. Fix:"),
    (lambda p: (p / "missing.jsonl").write_text("\n\n"), r"^data\.files=\[.*\]: no documents"),
    (lambda p: (p / "missing.jsonl").write_text('{"content": "x"}\n'), r"^data\.text_key='text': .*line 1"),
    (lambda p: (p / "missing.jsonl").write_text('[\n {"text": "a"},\n {"text": "b"}\n]\n'),
     r"^data\.files='.*missing\.jsonl': is one JSON array, not JSON Lines \(one object per line\)\. Fix: convert it, "
     r"e\.g\. jq -c '\.\[\]' missing\.jsonl > missing-lines\.jsonl, and list that file$"),
    (lambda p: (p / "missing.jsonl").write_text('[{"text": "a"}, {"text": "b"}]\n'), r"is one JSON array, not JSON"),
])
def test_user_errors_name_the_key(tok_dir, tmp_path, setup, match):
    setup(tmp_path)
    with pytest.raises(UserError, match=match) as e:
        D.build_token_cache([tmp_path / "missing.jsonl"], tok_dir, tmp_path / "cache", progress=False)
    assert "\n" not in str(e.value)


def test_full_disk_is_one_line_and_no_partial_cache_is_left(tok_dir, corpus, tmp_path, monkeypatch):
    """ENOSPC while the cache is written (after tokens.u32, at the offsets): one line naming data.cache_dir, what
    was written and what was free; the temporary directory is gone, so no later run can take it as a cache."""
    import errno
    import os

    root, _ = corpus

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(token_cache.np, "save", full)
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        D.build_token_cache([root / "a.jsonl"], tok_dir, cache, text_key="body", progress=False)
    assert re.fullmatch(rf"data\.cache_dir='{re.escape(str(cache))}': no space left on the disk \(or quota\) while "
                        r"writing the token cache \(\d+ bytes were written when it filled, .* were free when it "
                        r"started\); the partial output was removed\. Fix: free space there, or point "
                        r"data\.cache_dir at a disk with room for it", str(e.value)), str(e.value)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".error")] == []
    monkeypatch.undo()
    assert len(D.build_token_cache([root / "a.jsonl"], tok_dir, cache, text_key="body", progress=False).doc_offsets)


def test_cache_dir_that_cannot_be_made_is_one_line(tok_dir, corpus, tmp_path):
    root, _ = corpus
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^data\.cache_dir='.*file/cache': cannot write the token cache there "
                       r"\(.*\)\. Fix: point data\.cache_dir at a writable directory$"):
        D.build_token_cache([root / "a.jsonl"], tok_dir, tmp_path / "file" / "cache", text_key="body", progress=False)


def test_other_user_errors(tok_dir, tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"^data\.files=.*unknown file type '\.csv'"):
        D.expand_files([tmp_path / "x.csv"])
    with pytest.raises(UserError, match=r"^data\.files=\[\]: no data files"):
        D.expand_files([])
    with pytest.raises(UserError, match=r"^model=.*no tokenizer files"):
        D.cache_key([], tmp_path, "t")
    (tmp_path / "short.txt").write_text("hi\n")
    with pytest.raises(UserError, match=r"^data\.files=.*fewer than one sample of seq_len\+1=4097"):
        D.open_dataset(tmp_path / "short.txt", tok_dir, tmp_path / "c", 4096, progress=False)


def test_parquet(tok_dir, tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(UserError, match=r"^data\.files=.*needs pyarrow.*Fix: pip install pyarrow"):
            D.build_token_cache([tmp_path / "d.parquet"], tok_dir, tmp_path / "c", progress=False)
        return
    pq.write_table(pa.table({"text": ["one doc", "", "two docs"]}), tmp_path / "d.parquet")
    cache = D.build_token_cache([tmp_path / "d.parquet"], tok_dir, tmp_path / "c", progress=False)
    assert len(cache.doc_offsets) == 3


def test_directory_expands_sorted(tmp_path):
    for name in ("b.txt", "a.jsonl", "notes.csv", "sub/c.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    assert [p.name for p in D.expand_files(tmp_path)] == ["a.jsonl", "b.txt", "c.md"]
