"""Which tokens SFT trains: hand-written (text, trained?) runs per dataset type and option, and the chat-template
spans (found without `{% generation %}` markers) against transformers' own assistant mask on a marked template."""
from __future__ import annotations

import contextlib
import json

import pytest

from adapter.config.schema_data import DatasetEntry
from adapter.data.sft import formats, templates
from adapter.data.sft.prepare import load_tokenizer
from adapter.demo.build import CHAT_DATA
from adapter.errors import UserError
from tests.helpers.sft_data import VOCAB, axolotl_cfg, runs, tiny_model

BOS, EOS, IMS, IME = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("sft-masks"))


def tokenizer(model, tmp_path, **top):
    cfg = axolotl_cfg(model, [{"path": "x", "type": "alpaca"}], tmp_path, **top)
    return load_tokenizer(cfg, model, VOCAB)


def chat(model, tmp_path, rows, *, train_on_inputs=False, top=None, **entry):
    tok = tokenizer(model, tmp_path, **(top or {}))
    e = DatasetEntry(path="x", type="chat_template", **{"chat_template": "chatml", **entry})
    formats.kind_of(e, "datasets[0]")
    template = templates.resolve_template(e.chat_template, e.chat_template_jinja, tok, "datasets[0].")
    f = templates.ChatFormatter(e, tok, template, train_on_inputs=train_on_inputs, where="datasets[0]")
    out = [f(r, i) for i, r in enumerate(rows)]
    return [runs(ids, labels, tok) for ids, labels, _ in out], [m for *_, m in out], tok


CONV = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who was first?"},
                     {"role": "assistant", "content": "Adam."}, {"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": "Eve."}]}
HEAD = f"{IMS}system\nBe brief.{IME}\n{IMS}user\nWho was first?{IME}\n{IMS}assistant\n"
MID = f"{IME}\n{IMS}user\nAnd then?{IME}\n{IMS}assistant\n"


# --- alpaca, input_output, completion, pre-tokenised ---------------------------------------------------------------

def alpaca_rows(model, tmp_path, rows, train_on_inputs=False, seq_len=256, type="alpaca"):
    tok = tokenizer(model, tmp_path)
    fn = formats.make_formatter("alpaca", DatasetEntry(path="x", type=type), tok, seq_len=seq_len,
                                train_on_inputs=train_on_inputs, where="datasets[0]")
    cols = {k: [r.get(k) for r in rows] for k in ("instruction", "input", "output")}
    out = fn(cols, list(range(len(rows))))
    return [runs(i, la, tok) for i, la in zip(out["input_ids"], out["labels"])]


def test_alpaca_prompt_masked_output_and_eos_trained(model, tmp_path):
    got = alpaca_rows(model, tmp_path, [
        {"instruction": "Name the three sons of Noah.", "input": "", "output": "Shem, Ham and Japheth."},
        {"instruction": "Name the wife of the person given.", "input": "Isaac", "output": "Rebekah."}])
    assert got[0] == [
        (BOS + "Below is an instruction that describes a task. Write a response that appropriately completes the "
         "request.\n\n### Instruction:\nName the three sons of Noah.\n\n### Response:\n", False),
        ("Shem, Ham and Japheth." + EOS, True)]
    assert got[1] == [
        (BOS + "Below is an instruction that describes a task, paired with an input that provides further context. "
         "Write a response that appropriately completes the request.\n\n### Instruction:\nName the wife of the "
         "person given.\n\n### Input:\nIsaac\n\n### Response:\n", False), ("Rebekah." + EOS, True)]
    everything = alpaca_rows(model, tmp_path, [{"instruction": "Say hi.", "output": "Hi."}], train_on_inputs=True)
    assert len(everything[0]) == 1 and everything[0][0][1] and everything[0][0][0].endswith("Hi." + EOS)
    # prompt and output are each cut to seq_len (Axolotl); the combined length is excess_length_strategy's matter
    (prompt, masked), out = alpaca_rows(model, tmp_path, [{"instruction": "Say hi.", "output": "Hi."}], seq_len=8)[0]
    tok = tokenizer(model, tmp_path)
    assert not masked and out == ("Hi." + EOS, True) and len(tok(prompt, add_special_tokens=False)["input_ids"]) == 8
    assert (BOS + formats.ALPACA_NO_INPUT).startswith(prompt)
    # an empty output gets no tokens and no EOS (Axolotl): nothing trained, so the example is skipped later
    assert alpaca_rows(model, tmp_path, [{"instruction": "Say nothing.", "output": ""}])[0][-1][1] is False


def test_alpaca_prompt_styles_as_axolotls_prompter(model, tmp_path):
    """`alpaca:phi` (Axolotl's examples/phi/phi3-ft.yml) and the other AlpacaPrompter styles, written out here as
    axolotl/prompters.py at 067b021 renders them; an unknown style is one line."""
    rows = [{"instruction": "Name the three sons of Noah.", "output": "Shem."},
            {"instruction": "Name the wife.", "input": "Isaac", "output": "Rebekah."}]
    got = alpaca_rows(model, tmp_path, rows, type="alpaca:phi")
    assert got[0] == [(BOS + "<|system|>\nBelow is an instruction that describes a task. Write a response that "
                       "appropriately completes the request.<|end|>\n<|user|>\nName the three sons of Noah.<|end|>\n"
                       "<|assistant|>\n", False), ("Shem." + EOS, True)]
    assert got[1][0] == (BOS + "<|system|>\nBelow is an instruction that describes a task, paired with an input that "
                         "provides further context. Write a response that appropriately completes the request.<|end|>"
                         "\n<|user|>\nName the wife.<|end|>Isaac<|assistant|>", False)
    chat = alpaca_rows(model, tmp_path, rows[1:], type="alpaca:chat")[0][0][0]
    assert chat.endswith("request.\nUSER: Name the wife.\nIsaac\nASSISTANT:") and chat.startswith(BOS + "SYSTEM: ")
    chatml = alpaca_rows(model, tmp_path, rows[:1], type="alpaca:chatml")[0][0][0]
    assert chatml.endswith("<|im_end|>\n<|im_start|>user\nName the three sons of Noah.<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert alpaca_rows(model, tmp_path, rows, type="alpaca:instruct") == alpaca_rows(model, tmp_path, rows)
    with pytest.raises(UserError, match=r"^datasets\[0\]\.type='alpaca:vicuna': not one of Axolotl's alpaca"):
        formats.kind_of(DatasetEntry(path="x", type="alpaca:vicuna"), "datasets[0]")


def test_input_output_segments(model, tmp_path):
    tok = tokenizer(model, tmp_path)
    rows = {"segments": [[{"label": False, "text": "Q: who? "}, {"label": True, "text": "A: Noah."},
                          {"label": False, "text": " (end)"}]]}
    for toi, want in ((False, [("Q: who? ", False), ("A: Noah.", True), (" (end)", False)]),
                      (True, [("Q: who? A: Noah. (end)", True)])):
        out = formats.make_formatter("input_output", DatasetEntry(path="x", type="input_output"), tok, seq_len=64,
                                     train_on_inputs=toi, where="d")(rows, [0])
        assert runs(out["input_ids"][0], out["labels"][0], tok) == want


def test_completion_chunks_and_pretokenised(model, tmp_path):
    tok = tokenizer(model, tmp_path)
    text = "In the beginning God created the heaven and the earth. " * 4
    out = formats.make_formatter("completion", DatasetEntry(path="x", type="completion", field="body"), tok,
                                 seq_len=16, train_on_inputs=False, where="d")({"body": [text, ""]}, [0, 1])
    full = tok(text)["input_ids"] + [tok.eos_token_id]
    assert [i for chunk in out["input_ids"] for i in chunk] == full  # BOS ... EOS, cut into 16s; "" gives none
    assert [len(c) for c in out["input_ids"]][:-1] == [16] * (len(out["input_ids"]) - 1)
    assert out["labels"] == out["input_ids"]
    pre = formats.make_formatter("pretokenised", DatasetEntry(path="x"), tok, seq_len=16, train_on_inputs=False,
                                 where="d")({"input_ids": [[5, 6, 7, 8]], "labels": [[-100, -100, 7, 8]],
                                             "attention_mask": [[1, 1, 1, 0]]}, [0])
    assert pre["input_ids"] == [[5, 6, 7]] and pre["labels"] == [[-100, -100, 7]]  # padding position dropped


# --- chat templates ---------------------------------------------------------------------------------------------------

def test_chatml_trains_assistant_content_only_by_default(model, tmp_path):
    (got,), (missing,), _ = chat(model, tmp_path, [CONV])
    assert got == [(HEAD, False), ("Adam.", True), (MID, False), ("Eve.", True), (f"{IME}\n", False)]
    assert missing  # the template's turns end with <|im_end|>, not the EOS <|end_of_text|>: reported


@pytest.mark.parametrize("option, want", [
    ("turn", [(HEAD, False), ("Adam." + IME, True), (MID[len(IME):], False), ("Eve." + IME, True), ("\n", False)]),
    ("none", [(HEAD, False), ("Adam.", True), (MID, False), ("Eve.", True), (f"{IME}\n", False)]),
    ("last", [(HEAD, False), ("Adam.", True), (MID, False), ("Eve." + IME, True), ("\n", False)]),
    ("all", [(f"{IMS}system\nBe brief.", False), (IME, True), (f"\n{IMS}user\nWho was first?", False), (IME, True),
             (f"\n{IMS}assistant\n", False), ("Adam." + IME, True), (f"\n{IMS}user\nAnd then?", False), (IME, True),
             (f"\n{IMS}assistant\n", False), ("Eve." + IME, True), ("\n", False)]),
])
def test_train_on_eos(model, tmp_path, option, want):
    (got,), (missing,), _ = chat(model, tmp_path, [CONV], top={"special_tokens": {"eos_token": IME}},
                                 train_on_eos=option)
    assert got == want and not missing


def test_train_on_inputs_and_roles_to_train(model, tmp_path):
    top = {"special_tokens": {"eos_token": IME}}
    (got,), *_ = chat(model, tmp_path, [CONV], train_on_inputs=True, top=top)
    assert got == [(f"{IMS}system\n", False), ("Be brief." + IME, True), (f"\n{IMS}user\n", False),
                   ("Who was first?" + IME, True), (f"\n{IMS}assistant\n", False), ("Adam." + IME, True),
                   (f"\n{IMS}user\n", False), ("And then?" + IME, True), (f"\n{IMS}assistant\n", False),
                   ("Eve." + IME, True), ("\n", False)]  # headers stay masked, as in Axolotl
    (got,), *_ = chat(model, tmp_path, [CONV], top=top, roles_to_train=["user"])
    assert [t for t, trained in got if trained] == ["Who was first?" + IME, "And then?" + IME]


def test_sharegpt_rows_roles_and_system_column(model, tmp_path):
    share = {"conversations": [{"from": "human", "value": "Who was first?"}, {"from": "gpt", "value": "Adam."},
                               {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Eve."}],
             "system": "Be brief."}
    (got,), *_ = chat(model, tmp_path, [share], field_messages="conversations",
                      message_property_mappings={"role": "from", "content": "value"})
    assert got == [(HEAD, False), ("Adam.", True), (MID, False), ("Eve.", True), (f"{IME}\n", False)]
    custom = {"messages": [{"role": "person", "content": "Hi?"}, {"role": "bot", "content": "Hello."}]}
    (got,), *_ = chat(model, tmp_path, [custom], roles={"user": ["person"], "assistant": ["bot"]})
    assert got == [(f"{IMS}user\nHi?{IME}\n{IMS}assistant\n", False), ("Hello.", True), (f"{IME}\n", False)]
    (got,), *_ = chat(model, tmp_path, [CONV], drop_system_message=True)
    assert got[0] == (f"{IMS}user\nWho was first?{IME}\n{IMS}assistant\n", False)


# the same conversation format with and without transformers' {% generation %} markers; the second has a BOS, a
# space before the content (so the first content token carries the template's space) and content | trim
MARKED = [
    ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
     "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}"
     "{% endif %}{{ '\\n' }}{% endfor %}", "turn"),
    ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Answer: {% generation %}"
     "{{ m['content'] | trim }}{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}{% endif %}"
     "{{ eos_token }}{% endfor %}", "none"),
]


@pytest.mark.parametrize("marked, option", MARKED)
def test_spans_match_transformers_assistant_mask(model, tmp_path, marked, option):
    rows = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()]
    rows.append({"messages": [{"role": "user", "content": "Pad?"}, {"role": "assistant", "content": "  Yes.  "}]})
    plain = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok = tokenizer(model, tmp_path, special_tokens={"eos_token": IME})
    e = DatasetEntry(path="x", type="chat_template", chat_template_jinja=plain, train_on_eos=option)
    f = templates.ChatFormatter(e, tok, plain, train_on_inputs=False, where="d")
    trained = 0
    for i, row in enumerate(rows):
        ids, labels, _ = f(row, i)
        trained += sum(la != -100 for la in labels)
        ref = tok.apply_chat_template(row["messages"], chat_template=marked, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"]), i
        assert [int(la != -100) for la in labels] == list(ref["assistant_masks"]), (i, runs(ids, labels, tok))
    assert trained > 50 * len(rows) // 10  # the comparison is not vacuous


def test_template_choices_and_refusals(model, tmp_path):
    tok = tokenizer(model, tmp_path)
    assert templates.resolve_template("tokenizer_default_fallback_chatml", None, tok, "") == templates.CHATML
    with pytest.raises(Exception, match=r"^chat_template='tokenizer_default': the tokenizer has no chat template"):
        templates.resolve_template(None, None, tok, "")
    with pytest.raises(Exception, match=r"^data\.chat_template='mistral_v9': not a chat template Axolotl or nd-adap"):
        templates.resolve_template("mistral_v9", None, tok, "data.")
    assert templates.resolve_template("mistral_v7_tekken", None, tok, "data.") == templates.BUILTIN["mistral_v7_tekken"]
    with pytest.raises(Exception, match=r"^data\.chat_template='llama3': the template writes <\|end_header_id\|>"):
        templates.resolve_template("llama3", None, tok, "data.")  # shipped, but this vocabulary lacks its tokens
    with pytest.raises(Exception, match=r"writes <\|eot_id\|>, which is not one token"):
        templates.resolve_template(None, "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}", tok, "")


@pytest.mark.parametrize("name, head, mid, end", [
    ("llama3", "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nWho was first?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd then?<|eot_id|><|start_header_id|>assistant"
     "<|end_header_id|>\n\n", "<|eot_id|>"),
    ("gemma", "<start_of_turn>user\nWho was first?<end_of_turn>\n<start_of_turn>model\n",
     "<end_of_turn>\n<start_of_turn>user\nAnd then?<end_of_turn>\n<start_of_turn>model\n", "<end_of_turn>\n"),
    # Gemma 3: the system message opens the first user turn
    ("gemma3", "<start_of_turn>user\nBe brief.\n\nWho was first?<end_of_turn>\n<start_of_turn>model\n",
     "<end_of_turn>\n<start_of_turn>user\nAnd then?<end_of_turn>\n<start_of_turn>model\n", "<end_of_turn>\n"),
    # Phi-3: the user turn opens the assistant's
    ("phi_3", "<|system|>\nBe brief.<|end|>\n<|user|>\nWho was first?<|end|>\n<|assistant|>\n",
     "<|end|>\n<|user|>\nAnd then?<|end|>\n<|assistant|>\n", "<|end|>\n"),
])
def test_shipped_llama3_and_gemma_templates(model, tmp_path, name, head, mid, end):
    """Axolotl's `chat_template: llama3` / `gemma` on a tokenizer that has their markers (rendered text checked
    once against Axolotl's own templates: identical on these conversations, with and without a generation
    prompt); only the assistant contents are trained, and with the end-of-turn marker as EOS it is trained too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": [IMS, IME, "<|start_header_id|>", "<|end_header_id|>",
                                                          "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
                                                          "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    template = templates.resolve_template(name, None, tok, "")
    conv = CONV if name != "gemma" else {"messages": CONV["messages"][1:]}  # Gemma has no system role
    for eos, option, want in ((None, "turn", [(BOS + head, False), ("Adam.", True), (mid, False), ("Eve.", True),
                                              (end, False)]),
                              (end.strip(), "turn", [(BOS + head, False), ("Adam." + end.strip(), True),
                                                     (mid[len(end.strip()):], False), ("Eve." + end.strip(), True)]
                               + ([("\n", False)] if end.endswith("\n") else []))):
        if eos:
            tok.eos_token = eos
        e = DatasetEntry(path="x", type="chat_template", chat_template=name, train_on_eos=option)
        ids, labels, _ = templates.ChatFormatter(e, tok, template, train_on_inputs=False, where="d")(conv, 0)
        assert runs(ids, labels, tok) == want, (eos, runs(ids, labels, tok))
    if name != "llama3":  # Axolotl's eot_tokens (its Gemma examples name <end_of_turn>): the marker, not the EOS,
        tok.eos_token = "<s>"  # ends each turn and is trained per train_on_eot (default: train_on_eos)
        for option, trained in (("turn", True), ("none", False)):
            e = DatasetEntry(path="x", type="chat_template", chat_template=name, train_on_eot=option)
            ids, labels, _ = templates.ChatFormatter(e, tok, template, train_on_inputs=False, where="d",
                                                     eot_tokens=[end.strip(), "<unused>"])(conv, 0)
            marker = end.strip() if trained else ""
            assert runs(ids, labels, tok) == [(BOS + head, False), ("Adam." + marker, True),
                                              (mid[len(marker):], False), ("Eve." + marker, True),
                                              (end[len(marker):], False)], (option, runs(ids, labels, tok))
        with pytest.raises(Exception, match=r"^d\.train_on_eot='none': the end-of-turn token is the EOS"):
            tok.eos_token = end.strip()  # one token, two rules: refused as Axolotl does
            templates.ChatFormatter(e, tok, template, train_on_inputs=False, where="d", eot_tokens=[end.strip()])
    with pytest.raises(Exception, match="System role not supported") if name == "gemma" else contextlib.nullcontext():
        templates.ChatFormatter(DatasetEntry(path="x", type="chat_template"), tok, template, train_on_inputs=False,
                                where="d")(CONV, 0)


def test_resize_token_embeddings_to_32x_is_a_no_op_where_the_rows_exist(model, tmp_path):
    """Axolotl grows the embedding to the tokenizer rounded up to 32 rows only when it has fewer (Phi-3's 32,064
    already has them): then the key changes nothing and the run goes on (where rows are added: tests/unit/
    test_tokens.py); data prepared for fewer rows than the tokenizer needs is refused."""
    from adapter.errors import UserError
    from adapter.models.resolved import resolve_run

    cfg = axolotl_cfg(model, [{"path": "x", "type": "alpaca"}], tmp_path, resize_token_embeddings_to_32x=True)
    assert cfg.data.resize_vocab_to_32x and not any("resize" in n for n in cfg.notes)
    assert not resolve_run(cfg).vocab.resized
    tok = load_tokenizer(cfg, model, VOCAB)  # VOCAB rows hold the tokenizer rounded up to 32
    rows = -(-len(tok) // 32) * 32
    with pytest.raises(UserError, match=rf"^resize_token_embeddings_to_32x=True: the tokenizer transformers loads "
                       rf"has {len(tok)} tokens "
                       rf"\({rows} rows\), more than the {rows - 1} embedding rows"):
        load_tokenizer(cfg, model, rows - 1)


def test_reasoning_trains_with_its_turn_and_field_thinking_names_it(model, tmp_path):
    """Axolotl's field_thinking maps a message field onto reasoning_content, which Qwen3's template writes inside
    <think>; its find_turn diffs against a dummy turn of role and content alone, so the reasoning trains with the
    answer (as a turn's tool calls do)."""
    from adapter import config

    raw = {"base_model": "x", "learning_rate": 1e-5, "sequence_len": 256, "micro_batch_size": 1, "num_epochs": 1,
           "datasets": [{"path": "x", "type": "chat_template", "field_thinking": "thinking"}]}
    mapping = config.build(raw, env={}).data.datasets[0].message_property_mappings
    assert mapping == {"reasoning_content": "thinking"}
    row = {"messages": [{"role": "user", "content": "Who was first?"},
                        {"role": "assistant", "content": "Adam.", "thinking": "The first man."}]}
    (got,), _, _ = chat(model, tmp_path, [row], chat_template="qwen3", message_property_mappings=mapping)
    trained = "".join(text for text, on in got if on)
    assert "The first man." in trained and trained.rstrip().endswith("Adam.") and "Who was first?" not in trained, got
