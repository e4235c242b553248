"""SFT prepare: sources (files, directories, save_to_disk, the local hub cache), filtering counts, the held-out
split, the cache (reused, keyed on contents, one builder), and every bad input as one line, exit 2, nothing left."""
from __future__ import annotations

import errno
import importlib
import json
import os
import re
import threading
from pathlib import Path

import pytest

from adapter import cli
from adapter.data.sft import prepare as prepare_for
from adapter.demo.build import ALPACA_DATA, CHAT_DATA
from adapter.errors import UserError
from tests.helpers.runs import vocab_of
from tests.helpers.sft_data import axolotl_cfg, tiny_model, write_jsonl


def prepare(cfg, model, **kw):
    """The SFT preparation against the model's own vocabulary, as the trainer and `preprocess` call it."""
    return prepare_for(cfg, model, vocab_of(cfg), **kw)


prep_mod = importlib.import_module("adapter.data.sft.prepare")  # the module (the package exports the function)
CHAT = {"path": str(CHAT_DATA), "type": "chat_template", "chat_template": "chatml"}
ALPACA = {"path": str(ALPACA_DATA), "type": "alpaca"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("sft-prep"))


def test_two_datasets_packed_with_stats_and_template(model, tmp_path):
    cfg = axolotl_cfg(model, [CHAT, ALPACA], tmp_path, sample_packing=True, sequence_len=256)
    data = prepare(cfg, model, progress=False)
    chat, alp = data.stats["datasets"]
    assert (chat["rows"], chat["kept"], alp["rows"], alp["kept"]) == (52, 52, 12, 12)
    assert data.stats["total"] == {"rows": 64, "examples": 64, "dropped_too_long": 0, "truncated": 0,
                                   "too_short": 0, "no_trained_token": 0, "kept": 64, "duplicates": 0,
                                   "trained_tokens": data.stats["train"]["trained_tokens"]}
    t = data.stats["train"]
    assert t["examples"] == 64 and t["bins"] == len(data.train) < 64 and data.val is None
    assert t["packing_efficiency"] == round(t["tokens"] / (t["bins"] * 256), 4) > 0.8
    assert t["trained_tokens"] == sum(int(data.train[i]["loss_mask"].sum()) for i in range(len(data.train)))
    assert data.chat_template == prep_mod.templates.CHATML and not data.reused
    assert any("train_on_inputs: false, the default" in n for n in data.notes)
    assert any("no EOS (<|end_of_text|>)" in n for n in data.notes)  # chatml turns end with <|im_end|>
    assert cfg.document_attention  # packed SFT data confines attention to each example


def test_cache_is_reused_and_keyed_on_file_contents(model, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi.", "output": "Hi."}] * 3)
    cfg = axolotl_cfg(model, [{"path": str(src), "type": "alpaca"}], tmp_path)
    first = prepare(cfg, model, progress=False)
    monkeypatch.setattr(prep_mod, "_build", lambda *a: pytest.fail("re-tokenised"))
    again = prepare(cfg, model, progress=False)
    assert again.reused and again.path == first.path
    monkeypatch.undo()
    write_jsonl(src, [{"instruction": "Say hello.", "output": "Hello there."}] * 3)
    changed = prepare(cfg, model, progress=False)
    assert changed.path != first.path and not changed.reused
    other = axolotl_cfg(model, [{"path": str(src), "type": "alpaca"}], tmp_path, train_on_inputs=True)
    assert prepare(other, model, progress=False).path != changed.path  # a config key that changes the result


def test_one_builder_others_wait_and_errors_reach_every_rank(model, tmp_path):
    barrier, out = threading.Barrier(2, timeout=60), {}

    def rank(builder, cfg):
        try:
            out[builder] = prepare(cfg, model, builder=builder, barrier=barrier.wait, progress=False)
        except Exception as e:  # noqa: BLE001
            out[builder] = e

    for cfg in (axolotl_cfg(model, [ALPACA], tmp_path / "ok"),
                axolotl_cfg(model, [ALPACA], tmp_path / "bad", sequence_len=16)):
        threads = [threading.Thread(target=rank, args=(b, cfg)) for b in (False, True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if isinstance(out[True], Exception):
            assert isinstance(out[False], UserError) and str(out[False]) == str(out[True])
            assert str(out[True]).startswith("datasets=") and "no example left after filtering" in str(out[True])
        else:
            assert out[True].path == out[False].path and out[False].reused is False


def test_val_split_is_deterministic_disjoint_and_counted(model, tmp_path):
    def split(seed, size):
        data = prepare(axolotl_cfg(model, [ALPACA], tmp_path, val_set_size=size, seed=seed, sequence_len=256), model,
                       progress=False)
        take = lambda ds: sorted(tuple(ds[i]["tokens"][ds[i]["tokens"] != ds.pad_id].tolist())  # noqa: E731
                                 for i in range(len(ds)))
        return take(data.train), take(data.val)
    train, val = split(1, 3)
    assert len(val) == 3 and len(train) == 9 and not set(train) & set(val)
    assert split(1, 3) == (train, val) and split(2, 3)[1] != val
    assert len(split(1, 0.25)[1]) == 3  # ceil(0.25 * 12)


def test_test_datasets_deduplication_and_min_sample_len(model, tmp_path):
    """Axolotl's test_datasets are the eval set (nothing held out of datasets); dataset_exact_deduplication keeps
    one of identical examples, train and test each on its own; min_sample_len drops shorter examples, counted."""
    hi = {"instruction": "Say hi.", "output": "Hi."}
    src = write_jsonl(tmp_path / "a.jsonl", [hi] * 3 + [{"instruction": "Name the first day.",
                                                         "output": "The day God made the light."},
                                                        {"instruction": "Who?", "output": "God."}])
    test = write_jsonl(tmp_path / "t.jsonl", [hi, hi, {"instruction": "What came first?", "output": "Light."}])
    entries = [{"path": str(src), "type": "alpaca"}]
    tests = [{"path": str(test), "type": "alpaca"}]
    plain = prepare(axolotl_cfg(model, entries, tmp_path, test_datasets=tests), model, progress=False)
    assert (plain.stats["train"]["examples"], plain.stats["val"]["examples"]) == (5, 3)  # all of datasets trains
    assert any("eval set: 3 examples from test_datasets" in n for n in plain.notes)
    assert [d["dataset"] for d in plain.stats["datasets"]] == ["datasets[0]", "test_datasets[0]"]
    dedup = prepare(axolotl_cfg(model, entries, tmp_path, test_datasets=tests, dataset_exact_deduplication=True),
                    model, progress=False)
    assert (dedup.stats["train"]["examples"], dedup.stats["val"]["examples"]) == (3, 2)
    assert dedup.stats["total"]["duplicates"] == 3 and dedup.path != plain.path
    assert any("dataset_exact_deduplication: 2 duplicate training examples dropped, 1 in the test datasets" in n
               for n in dedup.notes)
    lengths = sorted(int(b - a) for i in range(len(plain.train)) for a, b in zip(plain.train.examples(i)[:-1],
                                                                                plain.train.examples(i)[1:]))
    shortest = lengths.count(lengths[0])
    short = prepare(axolotl_cfg(model, entries, tmp_path, test_datasets=tests, min_sample_len=lengths[0] + 1),
                    model, progress=False)
    assert short.stats["train"]["examples"] == 5 - shortest and short.stats["datasets"][0]["too_short"] == shortest
    assert any(f"{shortest} examples shorter than min_sample_len={lengths[0] + 1} dropped" in n for n in short.notes)
    with pytest.raises(UserError, match=r"^test_datasets\[0\]\.typo="):
        axolotl_cfg(model, entries, tmp_path, test_datasets=[{"path": str(test), "type": "alpaca", "typo": 1}])


def test_over_long_dropped_or_truncated_and_untrained_skipped(model, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "Tell me Genesis. " * 20},
                          {"role": "assistant", "content": "In the beginning."}]},
            {"messages": [{"role": "user", "content": "Only a question, no answer."}]}]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    entry = [{"path": str(src), "type": "chat_template", "chat_template": "chatml"}]
    dropped = prepare(axolotl_cfg(model, entry, tmp_path, sequence_len=64), model, progress=False)
    st = dropped.stats["datasets"][0]
    assert (st["dropped_too_long"], st["no_trained_token"], st["kept"]) == (1, 1, 1)
    assert any("1 examples longer than sequence_len=64 dropped" in n for n in dropped.notes)
    assert any("1 examples without a trained token skipped" in n for n in dropped.notes)
    cut = prepare(axolotl_cfg(model, entry, tmp_path, sequence_len=64, excess_length_strategy="truncate"), model,
                  progress=False)
    st = cut.stats["datasets"][0]
    # the long one loses its answer to the cut: truncated, then skipped as untrained (never a 0/0 loss)
    assert (st["truncated"], st["no_trained_token"], st["kept"]) == (1, 2, 1)
    assert all(cut.train[i]["loss_mask"].sum() > 0 for i in range(len(cut.train)))
    with pytest.raises(UserError, match=r"^excess_length_strategy='raise': datasets\[0\] example 1 has \d+ tokens"):
        prepare(axolotl_cfg(model, entry, tmp_path, sequence_len=64, excess_length_strategy="raise"), model,
                progress=False)


def test_sources_directory_saved_parquet_data_files_and_hub_cache(model, tmp_path, monkeypatch):
    import datasets

    rows = [{"instruction": f"Count to {i}.", "output": " ".join(str(k) for k in range(i))} for i in range(1, 7)]
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "part1.jsonl", rows[:3])
    write_jsonl(d / "part2.jsonl", rows[3:])
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "saved"))
    snap = tmp_path / "hf" / "hub" / "datasets--acme--count" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    write_jsonl(snap / "train.jsonl", rows[:4])
    write_jsonl(snap / "test.jsonl", rows[4:])
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for entry, n in (({"path": str(d)}, 6), ({"path": str(d), "data_files": ["part2.jsonl"]}, 3),
                     ({"path": str(tmp_path / "rows.parquet")}, 6), ({"path": str(tmp_path / "saved")}, 2),
                     ({"path": str(tmp_path / "saved"), "split": "test"}, 4), ({"path": "acme/count"}, 4),
                     ({"path": "acme/count", "split": "test"}, 2)):
        data = prepare(axolotl_cfg(model, [{**entry, "type": "alpaca"}], tmp_path), model, progress=False)
        assert data.stats["datasets"][0]["rows"] == n, entry


# --- bad input through the CLI: one line, exit 2, nothing half-written ----------------------------------------------

BAD = {
    "unknown type": ({"type": "alpaka"}, {}, r"^datasets\[0\]\.type='alpaka': unknown dataset type\. Fix: use one of"),
    "sharegpt": ({"type": "sharegpt"}, {}, r"datasets\[0\]\.type='sharegpt': sharegpt is deprecated.*"
                 r"message_property_mappings"),
    "unknown key": ({"conversation": "chatml"}, {}, r"^datasets\[0\]\.conversation='chatml': a dataset key"),
    "missing field": ({"type": "chat_template", "field_messages": "conversations", "chat_template": "chatml"}, {},
                      r"^datasets\[0\]\.field_messages='conversations': .* has no column 'conversations' "
                      r"\(its columns: instruction, input, output\)"),
    "hub name offline": ({"path": "acme/not-here"}, {}, r"^datasets\[0\]\.path='acme/not-here': not a local file or "
                         r"directory, and no snapshot .* Fix: on a machine with network run `hf download "
                         r"acme/not-here"),
    "empty after filtering": ({}, {"sequence_len": 16}, r"^datasets=\[.*\]: no example left after filtering "
                              r"\(12 longer than sequence_len=16 dropped"),
    "val too large": ({}, {"val_set_size": 12}, r"^val_set_size=12\.0: holds out 12 of the 12 examples"),
    "no trained token anywhere": ({"type": "chat_template", "chat_template": "chatml",
                                   "path": "CONVS", "roles_to_train": ["tool"]}, {},
                                  r"no example left after filtering \(0 longer .* 52 without a trained token\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_status_2_and_nothing_written(model, tmp_path, capsys, monkeypatch, case):
    entry, top, match = BAD[case]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    ds = {"path": str(ALPACA_DATA), "type": "alpaca", **entry}
    if ds["path"] == "CONVS":
        ds["path"] = str(CHAT_DATA)
    raw = {"base_model": str(model), "sequence_len": 256, "datasets": [ds], "learning_rate": 1e-5,
           "dataset_prepared_path": str(tmp_path / "prepared"), **top}
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert cli.main(["preprocess", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nd-adapter: error: "), err
    assert re.search(match, err.removeprefix("nd-adapter: error: ")), err
    left = list((tmp_path / "prepared").glob("*")) if (tmp_path / "prepared").exists() else []
    assert not [p for p in left if p.is_dir()], left  # at most the builder's error note for the other ranks


def _preprocess(model, tmp_path, capsys, entry: dict, command: str = "preprocess", **top) -> str:
    """`nd-adapter <command>` on one dataset entry: asserts exit status 2 and one line, returns the message, and
    that no directory was left under the prepared path (at most the builder's error note for the other ranks)."""
    raw = {"base_model": str(model), "sequence_len": 256, "datasets": [entry], "learning_rate": 1e-5,
           "dataset_prepared_path": str(tmp_path / "prepared"), **top}
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert cli.main([command, "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nd-adapter: error: "), err
    left = list((tmp_path / "prepared").iterdir()) if (tmp_path / "prepared").exists() else []
    assert not [p for p in left if p.is_dir() or not p.name.endswith(".error")], left
    return err.removeprefix("nd-adapter: error: ")


ROW = (json.dumps({"instruction": "Say hi.", "output": "Hi."}) + "\n").encode()
CHAT_ENTRY = {"type": "chat_template", "chat_template": "chatml"}
FILES = {  # file name (a trailing / : a directory of two such empty files), bytes, entry keys, message
    "empty chat file": ("c.jsonl", b"", CHAT_ENTRY,
                        r"^datasets\[0\]\.path='.*c\.jsonl': the file is empty \(0 bytes\)\. Fix: point path at a "
                        r"file with rows, or remove the entry$"),
    "blank alpaca file": ("a.jsonl", b"\n  \n", {"type": "alpaca"}, r"'.*a\.jsonl': the file is empty \(blank lines"),
    "empty completion file": ("t.jsonl", b"", {"type": "completion"}, r"'.*t\.jsonl': the file is empty"),
    "empty csv": ("a.csv", b"", {"type": "alpaca"}, r"'.*a\.csv': the file is empty"),
    "directory of empty files": ("d/", b"", {"type": "alpaca"},
                                 r"^datasets\[0\]\.path='.*d': its data files are all empty \(a\.jsonl, b\.jsonl\)"),
    "csv header alone": ("a.csv", b"instruction,output\n", {"type": "alpaca"},
                         r"^datasets\[0\]\.path='.*a\.csv': holds no rows \(a header alone\)\. Fix:"),
    "empty JSON array": ("a.json", b"[]", {"type": "alpaca"}, r"'.*a\.json': holds no rows \(e\.g\. an empty JSON"),
    "split selecting no rows": ("a.jsonl", ROW, {"type": "alpaca", "split": "train[:0]"},
                                r"^datasets\[0\]\.split='train\[:0\]': selects no rows of .*a\.jsonl"),
    "not UTF-8": ("a.jsonl", ROW + '{"instruction": "Caf\xe9?", "output": "Oui."}\n'.encode("latin-1"),
                  {"type": "alpaca"}, r"'.*a\.jsonl': is not UTF-8 text \(line 2 holds the byte 'e9'.*Fix: convert"),
    "broken JSON line": ("a.jsonl", ROW + b"{oops\n", {"type": "alpaca"},
                         r"^datasets\[0\]\.path='.*a\.jsonl': line 2 is not valid JSON \(Expecting property name"),
    "role that is not a name": ("c.jsonl", json.dumps({"messages": [{"role": ["user"], "content": "Hi"}]}).encode(),
                                CHAT_ENTRY, r"^datasets\[0\]\.message_property_mappings=.*row 0 message 0's 'role' is "
                                r"list, not a role name"),
    "no messages": ("c.jsonl", json.dumps({"messages": []}).encode(), CHAT_ENTRY,
                    r"^datasets\[0\]='row 0': its list of messages \(messages\) is empty"),
    "only empty texts": ("t.jsonl", json.dumps({"text": ""}).encode(), {"type": "completion"},
                         r"no example left after filtering \(1 empty \(no text\), 0 longer .* Fix: give the empty "
                         r"rows their text"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_bad_files_are_one_line_status_2_and_nothing_written(model, tmp_path, capsys, case):
    """Files that reached a library's traceback (StopIteration, UnicodeDecodeError, an unhashable role), two lines
    (datasets' own log line), or a line blaming the file's format for what is an empty file or split."""
    name, content, entry, match = FILES[case]
    if name.endswith("/"):
        (tmp_path / name).mkdir()
        for f in ("a.jsonl", "b.jsonl"):
            (tmp_path / name / f).write_bytes(content)
    else:
        (tmp_path / name).write_bytes(content)
    err = _preprocess(model, tmp_path, capsys, {"path": str(tmp_path / name.rstrip("/")), **entry})
    assert re.search(match, err), err


def test_empty_chat_file_stops_train_before_any_process(model, tmp_path, capsys, monkeypatch):
    """`nd-adapter train`'s preflight names the empty file before starting a process, and the preparation every
    rank runs (launch/train.py has no preflight) says the same line."""
    from adapter.train import spawn

    (tmp_path / "c.jsonl").write_bytes(b"")
    monkeypatch.setattr(spawn, "spawn", lambda *a, **k: pytest.fail("processes started"))
    entry = {"path": str(tmp_path / "c.jsonl"), **CHAT_ENTRY}
    err = _preprocess(model, tmp_path, capsys, entry, command="train")
    assert re.match(r"datasets\[0\]\.path='.*c\.jsonl': the file is empty \(0 bytes\)", err), err
    with pytest.raises(UserError) as e:
        prepare(axolotl_cfg(model, [entry], tmp_path), model, builder=True, progress=False)
    assert str(e.value) == err


def _enospc(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


FULL = {  # where the disk fills up: (module, name, its stand-in), message
    "converting the rows": (
        "datasets", "load_dataset", lambda *a, cache_dir, **k: _fill(Path(cache_dir) / "part.arrow", "generating"),
        r"\(64\.0 KiB were written when it filled, .* were free when it started\)"),
    "writing the samples": (
        "adapter.data.sft.prepare", "write_split", lambda d, *a: _fill(d / "ids.npy", "raw"),
        r"\(64\.0 KiB were written when it filled, .* were free when it started\)"),
    "too little room for the samples": (
        "adapter.osutil", "free_bytes", lambda d: 1000, r"\(it needs \d+\.\d KiB, 1000 bytes are free\)"),
}


def _fill(path: Path, how: str):
    """Write 64 KiB, then fail as a full disk does: raw, or wrapped as datasets wraps its writer's errors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 65536)
    if how == "raw":
        _enospc()
    import datasets

    try:
        _enospc()
    except OSError as e:
        raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset") from e


@pytest.mark.parametrize("case", sorted(FULL))
def test_full_disk_is_one_line_and_the_partial_cache_is_removed(model, tmp_path, capsys, monkeypatch, case):
    module, name, stand_in, match = FULL[case]
    monkeypatch.setattr(importlib.import_module(module), name, stand_in)
    err = _preprocess(model, tmp_path, capsys, ALPACA)
    assert re.match(rf"dataset_prepared_path='{re.escape(str(tmp_path / 'prepared'))}': no space left on the disk "
                    rf"\(or quota\) while writing the prepared data {match}; the partial output was removed\. Fix: "
                    r"free space there, or point dataset_prepared_path at a disk with room for it$", err), err
    assert not [p for p in (tmp_path / "prepared").iterdir() if p.name.startswith(".")]  # no temporary directory


def test_unknown_roles_are_rendered_as_written_and_trained_only_when_listed(model, tmp_path):
    """Axolotl maps a role through `roles` and passes one it does not name to the template unchanged
    (`roles.get(role, role)`); it trains it only when roles_to_train names it. The run's first lines list them."""
    rows = [{"messages": [{"role": "user", "content": "Who spoke?"}, {"role": "narrator", "content": "A voice."},
                          {"role": "assistant", "content": "Adam."}]}]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    entry = {"path": str(src), **CHAT_ENTRY}

    def trained_text(data):
        item = data.train[0]
        return data_tok.decode(item["labels"][item["loss_mask"] > 0].tolist()), data_tok.decode(item["tokens"].tolist())

    from transformers import AutoTokenizer

    data_tok = AutoTokenizer.from_pretrained(str(model))
    plain = prepare(axolotl_cfg(model, [entry], tmp_path / "a"), model, progress=False)
    trained, text = trained_text(plain)
    assert "<|im_start|>narrator\nA voice.<|im_end|>" in text and "voice" not in trained and "Adam." in trained
    assert plain.stats["datasets"][0]["other_roles"] == {"narrator": 1}
    assert ["datasets[0]: roles outside its role mapping: 'narrator' (1 turns); passed to the chat template as "
            "written and trained only if roles_to_train lists them or train_on_inputs is on (Axolotl's rule); map "
            "them with datasets[0].roles"] == [n for n in plain.notes if "narrator" in n]
    listed = prepare(axolotl_cfg(model, [{**entry, "roles_to_train": ["assistant", "narrator"]}], tmp_path / "b"),
                     model, progress=False)
    trained, _ = trained_text(listed)
    assert "A voice." in trained and "Adam." in trained
    assert "other_roles" not in listed.stats["datasets"][0] and not any("narrator" in n for n in listed.notes)


def test_preprocess_cli_prints_stats_and_debug_pairs(model, tmp_path, capsys):
    raw = {"base_model": str(model), "sequence_len": 256, "sample_packing": True, "val_set_size": 0.1,
           "learning_rate": 1e-5,
           "special_tokens": {"eos_token": "<|im_end|>"}, "datasets": [CHAT],
           "dataset_prepared_path": str(tmp_path / "prepared")}
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert cli.main(["preprocess", "--config", str(tmp_path / "run.yaml"), "--debug", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "(built)" in out and "val: 6 examples" in out and "packing efficiency" in out
    debug = [line for line in out.splitlines() if line.startswith("sample 0 example 0")]
    assert debug and "('<|im_start|>', -100)" in debug[0] and "('<|im_end|>', " in debug[0]
    trained = [int(x) for x in re.findall(r", (\d+)\)", debug[0])]
    assert trained and 2 not in trained  # <|im_start|> (id 2) is never a trained label
    assert cli.main(["preprocess", "--config", str(tmp_path / "run.yaml")]) == 0
    assert "(reused)" in capsys.readouterr().out


def test_relative_dataset_paths_are_read_from_the_config_directory(model, tmp_path, monkeypatch, capsys):
    import shutil

    (tmp_path / "cfg").mkdir()
    shutil.copy(ALPACA_DATA, tmp_path / "cfg" / "rows.jsonl")
    (tmp_path / "cfg" / "run.yaml").write_text(json.dumps({
        "base_model": str(model), "sequence_len": 256, "datasets": [{"path": "rows.jsonl", "type": "alpaca"}],
        "learning_rate": 1e-5,
        "dataset_prepared_path": str(tmp_path / "prepared")}))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["preprocess", "--config", "cfg/run.yaml", "--set", "data.val_set_size=2"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "cfg" / "rows.jsonl") in out and "val: 2 examples" in out


def test_pretokenised_labels_note_only_when_the_column_is_missing(model, tmp_path):
    """Rows with a labels column keep their masks; only rows without one train every token, and only those are
    named in the note (it was once said of both)."""
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    with_labels = write_jsonl(tmp_path / "l.jsonl", [{"input_ids": i, "labels": [-100] + i[1:]} for i in ids])
    bare = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": i} for i in ids])
    data = prepare(axolotl_cfg(model, [{"path": str(with_labels)}], tmp_path / "one"), model, progress=False)
    assert not any("labels column" in n for n in data.notes), data.notes
    both = prepare(axolotl_cfg(model, [{"path": str(with_labels)}, {"path": str(bare)}], tmp_path / "two"), model,
                   progress=False)
    assert [n for n in both.notes if "labels column" in n] == [
        "pre-tokenised rows without a labels column train every token (datasets[1])"]
    assert not any("train_on_inputs" in n for n in data.notes + both.notes)  # their labels are as given: no prompts


def test_min_sample_len_names_itself_when_it_drops_everything(model, tmp_path):
    cfg = axolotl_cfg(model, [ALPACA], tmp_path, min_sample_len=4000, sequence_len=4096)
    with pytest.raises(UserError, match=r"12 shorter than min_sample_len=4000 dropped.*Fix: lower min_sample_len"):
        prepare(cfg, model, progress=False)
