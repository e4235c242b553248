"""`rl: dpo` as Axolotl configures it: an Axolotl DPO example YAML maps onto objective: dpo with TRL's beta (trl.beta,
else rl_beta, else the deprecated dpo_beta, else 0.1); a preference row renders as Axolotl's own chat_template.default
transform renders it (its code run here from tests/fixtures/axolotl/dpo_chat_template.py.txt, Axolotl 067b021) and
is tokenised as TRL 1.8.0 tokenises those strings; rl: ipo and rl: simpo map as Axolotl hands them to TRL's DPO and
CPO trainers; rl: kto (Axolotl's qlora-1b-kto.yaml) maps onto objective kto with TRL's beta and Axolotl's weights,
its llama3 / chatml rows render as Axolotl's KTO strategies; every rl value, loss option and layout not built is
refused in one line naming the key and the fix (exit 2 from the CLI)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from adapter import config
from adapter.errors import UserError
from tests.helpers.cli import run_cli
from tests.helpers.sft_data import tiny_model, write_jsonl

FIXTURES = Path(__file__).parents[1] / "fixtures" / "axolotl"


def _example(**over) -> dict:
    raw = yaml.safe_load((FIXTURES / "instruct-dpo-lora-8b.yml").read_text())
    raw.update({"load_in_8bit": False, **over})  # the 8-bit base: see below
    return raw


def test_axolotl_dpo_example_maps():
    cfg = config.build(_example(), env={}, world_size=1)
    assert cfg.objective == "dpo" and cfg.dpo.beta == 0.1  # TRL's default: Axolotl passes no beta
    e = cfg.data.datasets[0]
    assert (e.type, e.field_messages, e.field_chosen, e.field_rejected) == (
        "chat_template.default", "conversation", "chosen", "rejected")
    assert cfg.lora is not None and cfg.lora.r == 32 and cfg.data.chat_template == "llama3"
    assert any(n.startswith("rl: dpo -> objective: dpo") for n in cfg.notes)
    assert cfg.data.val_set_size == 0.05  # the DPO eval (adapter/train/dpo.py)
    full = config.build(_example(adapter=None, lora_r=None, lora_alpha=None, lora_dropout=None,
                                 lora_target_linear=None), env={}, world_size=1)
    assert full.lora is None and any("reference = the starting weights' log-probabilities" in n for n in full.notes)
    for keys, beta in (({"rl_beta": 0.3}, 0.3), ({"dpo_beta": 0.4}, 0.4), ({"rl_beta": 0.3, "trl": {"beta": 0.2}}, 0.2),
                       ({"rl_beta": 0.3, "dpo_beta": 0.4}, 0.3)):
        assert config.build(_example(**keys), env={}, world_size=1).dpo.beta == beta, keys


@pytest.mark.parametrize("over, needle", [
    ({"rl": "grpo"}, "rl='grpo': GRPO is an online method: it generates completions"),
    ({"rl": "cpo"}, "rl='cpo': only rl: dpo, ipo, orpo, simpo, kto are built"),
    ({"dpo_label_smoothing": 0.1}, "dpo_label_smoothing=0.1: TRL 1.8.0"),
    ({"dpo_loss_type": ["hinge"]}, "dpo_loss_type=['hinge']: only TRL's sigmoid and ipo losses are built"),
    ({"dpo_loss_type": ["sigmoid", "ipo"]}, "dpo_loss_type=['sigmoid', 'ipo']: only TRL's sigmoid and ipo"),
    ({"dpo_loss_type": ["ipo"], "dpo_loss_weights": [0.5]}, "dpo_loss_weights=[0.5]: weighted mixtures"),
    ({"rl": "ipo", "dpo_use_weighting": True}, "dpo_use_weighting=True: WPO weighting is not built"),
    ({"simpo_gamma": 0.5}, "simpo_gamma=0.5: SimPO's margin: Axolotl passes it to rl: simpo only"),
    ({"rl": "simpo"}, "simpo_gamma=None: Axolotl passes an unset simpo_gamma to TRL's CPOConfig as None"),
    ({"rl": "simpo", "simpo_gamma": 0.5, "warmup_ratio": 0.1}, "warmup_ratio=0.1: Axolotl refuses warmup_ratio"),
    ({"rl": "simpo", "simpo_gamma": 0.5, "cpo_alpha": -1}, "cpo_alpha=-1: must be a number ≥ 0"),
    ({"rl": "simpo", "simpo_gamma": 0.5, "orpo_alpha": 0.2}, "orpo_alpha=0.2: ORPO's weight"),
    ({"rpo_alpha": 0.5}, "rpo_alpha=0.5: RPO"),
    ({"orpo_alpha": 0.5}, "orpo_alpha=0.5: ORPO's weight: Axolotl would hand it to this trainer as beta"),
    ({"rl_beta": 0}, "rl_beta=0: beta must be a number above 0"),
    ({"sample_packing": True}, "sample_packing=True: preference pairs are not packed yet"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template"}]}, "rl: dpo trains on preference pairs"),
])
def test_unbuilt_dpo_refused_in_one_line(over, needle):
    _refused_in_one_line(_example(**over), needle)


def _refused_in_one_line(raw: dict, needle: str) -> None:
    """`raw` refused by the config or by the data choices' check, in one line holding `needle`."""
    from adapter.data.sft.prepare import check_choices

    with pytest.raises(UserError) as e:
        check_choices(config.build(raw, env={}, world_size=1))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_preference_type_under_sft_and_native_engine_refused(tmp_path):
    from adapter.data.sft.prepare import check_choices
    from adapter.models.arch import NotNative
    from adapter.models.lora import check_native

    raw = _example()
    del raw["rl"]
    with pytest.raises(UserError, match=r"chat_template.default is a preference type \(for rl: dpo, ipo or simpo\)"):
        check_choices(config.build(raw, env={}, world_size=1))
    dense, moe = SimpleNamespace(moe=False), SimpleNamespace(moe=True)
    check_native(config.build(_example(), env={}, world_size=1), dense)  # DPO runs on the native engine
    for raw, arch, says in ((_example(), moe, "a preference objective on a mixture of experts"),
                            ({**_example(), "lora_modules_to_save": ["lm_head"]}, dense,
                             "a DPO reference beside LoRA's modules_to_save")):
        with pytest.raises(NotNative, match=f"{says} is built on the transformers engine only"):
            check_native(config.build(raw, env={}, world_size=1), arch)
    path = tmp_path / "grpo.yml"
    path.write_text(yaml.safe_dump(_example(rl="grpo")))
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    assert code == 2 and "rl='grpo'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _axolotl_default():
    """Axolotl's chat_template.default (its source, unchanged, with its three helper imports given here)."""
    src = (FIXTURES / "dpo_chat_template.py.txt").read_text()
    src = "\n".join(ln for ln in src.splitlines() if not ln.startswith("from axolotl."))
    ns = {"extract_chat_template_args": lambda cfg, ds_cfg: (None, cfg["chat_template_jinja"]),
          "get_chat_template": lambda user_choice, jinja_template, tokenizer: jinja_template,
          "handle_legacy_message_fields_logic": lambda ds_cfg: ds_cfg}
    exec(compile(src, "axolotl/prompt_strategies/dpo/chat_template.py", "exec"), ns)
    return ns["default"]


def test_pair_renders_and_tokenises_as_axolotl_and_trl(tmp_path):
    from transformers import AutoTokenizer

    from adapter.data.sft import preference, templates
    from adapter.models import source

    tok_dir = tiny_model(tmp_path)
    rows = [{"conv": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a colour."}],
             "good": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": " Red.  "}],
             "bad": {"from": "gpt", "value": "I cannot."}},
            {"conv": "Say hi", "good": "Hi!", "bad": "No."}]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    entry = {"path": str(data), "type": "chat_template.default", "field_messages": "conv", "field_chosen": "good",
             "field_rejected": "bad", "message_property_mappings": {"role": "from", "content": "value"},
             "roles": {"system": ["system"], "user": ["human", "user"], "assistant": ["gpt", "assistant"]}}
    cfg = config.build({"base_model": str(tok_dir), "rl": "dpo", "adapter": "lora", "learning_rate": 1e-4,
                        "sequence_len": 64, "chat_template": "chatml", "datasets": [entry],
                        "dataset_prepared_path": str(tmp_path / "prep")}, env={})
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    jinja = templates.resolve_template("chatml", None, tok, "")
    fn, _ = _axolotl_default()({"datasets": [entry], "chat_template_jinja": jinja})
    pairs = preference.prepare_pairs(cfg, tok_dir, source.vocab_rows(cfg))
    assert len(pairs.train) == 2
    for i, row in enumerate(rows):
        want = fn(row, tokenizer=tok)
        got = preference.render(row, cfg.data.datasets[0], tok, jinja)
        assert got == (want["prompt"], want["chosen"], want["rejected"])
        # TRL 1.8.0 (DPOTrainer.tokenize_fn, non-conversational): EOS appended, the answer = what follows the prompt
        p = tok(want["prompt"])["input_ids"]
        item = pairs.train[i]
        for j, side in enumerate(("chosen", "rejected")):
            ans = want[side] + tok.eos_token
            ids = tok(want["prompt"] + ans)["input_ids"]
            n = len(ids)
            assert item["tokens"][j, :n].tolist() == ids
            assert item["loss_mask"][j].nonzero()[0].tolist() == list(range(len(p) - 1, n - 1))  # predicts ids[len(p):]
            assert item["labels"][j, :n - 1].tolist() == ids[1:]
    for bad_rows, needle in (([{"conv": "x", "good": "y"}], r"datasets\[0\].type=.*has no column 'bad'"),
                             ([{"conv": "x", "good": "y", "bad": None}],
                              r"datasets\[0\].path=.*row 0 is not a preference pair")):
        write_jsonl(data, bad_rows)
        with pytest.raises(UserError, match=needle):  # a fresh cache key: the file changed
            preference.prepare_pairs(cfg, tok_dir, source.vocab_rows(cfg))


def test_held_out_pairs(tmp_path):
    """val_set_size holds out the tail of the seed's permutation of the prepared pairs (rounded up, as Axolotl's
    train_test_split); test_datasets are prepared as the training pairs are and held out whole."""
    from adapter.data.sft import preference
    from adapter.models import source

    tok_dir = tiny_model(tmp_path)
    rows = [{"conv": f"Say {i}", "good": f"{i}.", "bad": "No."} for i in range(7)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    test = write_jsonl(tmp_path / "test.jsonl", rows[:2])
    entry = {"type": "chat_template.default", "field_messages": "conv", "field_chosen": "good", "field_rejected": "bad"}
    base = {"base_model": str(tok_dir), "rl": "dpo", "adapter": "lora", "learning_rate": 1e-4, "sequence_len": 64,
            "chat_template": "chatml", "datasets": [{"path": str(data), **entry}],
            "dataset_prepared_path": str(tmp_path / "prep")}
    cfg = config.build({**base, "val_set_size": 0.3}, env={})
    pairs = preference.prepare_pairs(cfg, tok_dir, source.vocab_rows(cfg))
    train, held = preference.split(cfg, 7)
    assert len(held) == 3 and sorted([*train, *held]) == list(range(7))  # ceil(0.3 · 7)
    assert pairs.val is not None and pairs.val.rows.tolist() == held.tolist() and pairs.train.rows.tolist() == [
        *train]
    assert (pairs.val.tokens[0] == preference.prepare_pairs(config.build(base, env={}), tok_dir,
                                                            source.vocab_rows(cfg)).train.tokens[held[0]]).all()
    assert "held out (val_set_size): 3 pairs for the eval, 4 pairs to train on" in "\n".join(
        preference.stats_lines(pairs))
    cfg = config.build({**base, "test_datasets": [{"path": str(test), **entry}]}, env={})
    pairs = preference.prepare_pairs(cfg, tok_dir, source.vocab_rows(cfg))
    assert len(pairs.train) == 7 and pairs.val is not None and len(pairs.val) == 2
    assert (pairs.val.tokens == pairs.train.tokens[:2]).all()


def test_axolotl_orpo_example_maps_and_renders_as_axolotl(tmp_path):
    """Axolotl's mistral-qlora-orpo.yml maps onto objective: orpo with orpo_alpha as TRL's beta; an argilla row
    renders as Axolotl's own orpo `chat_template.argilla` transform renders it (its source, unchanged, from
    tests/fixtures/axolotl/orpo_chat_template.py.txt)."""
    from transformers import AutoTokenizer

    from adapter.data.sft import templates
    from adapter.data.sft.preference_orpo import render_argilla

    raw = yaml.safe_load((FIXTURES / "mistral-qlora-orpo.yml").read_text())
    raw.update({"load_in_4bit": False, "adapter": "lora", "model_type": None, "tokenizer_type": None})
    cfg = config.build(raw, env={}, world_size=1)
    assert cfg.objective == "orpo" and cfg.orpo.alpha == 0.1 and cfg.data.val_set_size == 0.1
    assert cfg.data.datasets[0].type == "chat_template.argilla"
    assert any(n.startswith("rl: orpo -> objective: orpo") for n in cfg.notes)
    assert config.build({**raw, "rl_beta": 0.3}, env={}, world_size=1).orpo.alpha == 0.3  # Axolotl's order
    src = (FIXTURES / "orpo_chat_template.py.txt").read_text()
    src = "\n".join(ln for ln in src.splitlines() if not ln.startswith("from axolotl."))
    ns = {"IGNORE_INDEX": -100, "PromptTokenizingStrategy": object, "Prompter": object,
          "get_chat_template_from_config": lambda cfg, ds_cfg=None, tokenizer=None: cfg["chat_template_jinja"]}
    exec(compile(src, "axolotl/prompt_strategies/orpo/chat_template.py", "exec"), ns)
    for model in ("Message", "MessageList"):  # pydantic resolves their annotations in the exec namespace
        ns[model].model_rebuild(_types_namespace=ns)
    tok = AutoTokenizer.from_pretrained(str(tiny_model(tmp_path)))
    jinja = templates.resolve_template("chatml", None, tok, "")
    fn = ns["argilla"]({"chat_template_jinja": jinja})
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    for row in ({"chosen": [*turn, {"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Red."}],
                 "rejected": [*turn, {"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "No."}],
                 "system": "Be brief."},
                {"chosen": turn, "rejected": [turn[0], {"role": "assistant", "content": "Go away"}], "prompt": "Yo"}):
        want = fn(row, tokenizer=tok)
        assert render_argilla(row, tok, jinja) == (want["prompt"], want["chosen"], want["rejected"])


@pytest.mark.parametrize("over, needle", [
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]},
     "rl: orpo trains on preference pairs of type chat_template.argilla"),
    ({"rl": "dpo", "orpo_alpha": None, "datasets": [{"path": "x.jsonl", "type": "chat_template.argilla"}]},
     "rl: dpo trains on preference pairs of type chat_template.default"),
    ({"orpo_alpha": -1}, "orpo_alpha=-1: beta must be a number above 0"),
])
def test_orpo_config_errors_in_one_line(over, needle):
    from adapter.data.sft.prepare import check_choices

    raw = yaml.safe_load((FIXTURES / "mistral-qlora-orpo.yml").read_text())
    raw.update({"load_in_4bit": False, "adapter": "lora", "model_type": None, "tokenizer_type": None, **over})
    with pytest.raises(UserError) as e:
        check_choices(config.build(raw, env={}, world_size=1))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_axolotl_ipo_and_simpo_map():
    """rl: ipo (or rl: dpo with dpo_loss_type [ipo]) onto objective ipo with DPO's beta; rl: simpo onto objective
    simpo with beta, simpo_gamma and cpo_alpha (TRL's 1.0 when unset) as Axolotl hands them to TRL's CPOConfig. No
    Axolotl example sets rl: ipo or simpo; its DPO example stands in."""
    for over in ({"rl": "ipo"}, {"dpo_loss_type": ["ipo"]}, {"dpo_loss_type": "ipo"}):
        cfg = config.build(_example(**over, rl_beta=0.3), env={}, world_size=1)
        assert cfg.objective == "ipo" and cfg.dpo.beta == 0.3, over
        assert any(n.startswith(("rl: ipo -> objective: ipo", "rl: dpo with dpo_loss_type ipo -> objective: ipo"))
                   for n in cfg.notes), cfg.notes
    cfg = config.build(_example(rl="ipo", dpo_label_smoothing=0.1, dpo_loss_weights=[2.0]), env={}, world_size=1)
    assert cfg.objective == "ipo" and any(n.startswith("dpo_label_smoothing, dpo_loss_weights: not read by IPO")
                                          for n in cfg.notes), cfg.notes
    cfg = config.build(_example(rl="simpo", simpo_gamma=0.6, rl_beta=2.0, warmup_ratio=None), env={}, world_size=1)
    assert cfg.objective == "simpo" and (cfg.simpo.beta, cfg.simpo.gamma, cfg.simpo.cpo_alpha) == (2.0, 0.6, 1.0)
    assert any(n.startswith("rl: simpo -> objective: simpo (TRL's CPOTrainer") and "TRL default" in n
               for n in cfg.notes), cfg.notes
    cfg = config.build(_example(rl="simpo", simpo_gamma=0.6, cpo_alpha=0, dpo_label_smoothing=0.1, warmup_ratio=None),
                       env={}, world_size=1)
    assert cfg.simpo.cpo_alpha == 0.0 and cfg.simpo.beta == 0.1
    assert any(n.startswith("dpo_label_smoothing: not read by SIMPO") for n in cfg.notes), cfg.notes


def test_simpo_pairs_tokenised_as_cpo(tmp_path):
    """rl: simpo renders the DPO rows as chat_template.default does and tokenises them as TRL's CPOTrainer (its
    tokenize_row, ORPO's: no special tokens, BOS first where the tokenizer has one, EOS last), in its own cache."""
    from transformers import AutoTokenizer

    from adapter.data.sft import preference, templates
    from adapter.data.sft.preference_orpo import tokenize_orpo
    from adapter.models import source

    tok_dir = tiny_model(tmp_path)
    rows = [{"conv": f"Say {i}", "good": f"{i}.", "bad": "No."} for i in range(3)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    base = {"base_model": str(tok_dir), "adapter": "lora", "learning_rate": 1e-4, "sequence_len": 64,
            "chat_template": "chatml", "dataset_prepared_path": str(tmp_path / "prep"),
            "datasets": [{"path": str(data), "type": "chat_template.default", "field_messages": "conv",
                          "field_chosen": "good", "field_rejected": "bad"}]}
    dpo = config.build({**base, "rl": "dpo"}, env={})
    simpo = config.build({**base, "rl": "simpo", "simpo_gamma": 0.5}, env={})
    a, b = (preference.prepare_pairs(c, tok_dir, source.vocab_rows(c)) for c in (dpo, simpo))
    assert a.path != b.path
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    jinja = templates.resolve_template("chatml", None, tok, "")
    for i, row in enumerate(rows):
        c_ids, c_p, r_ids, _ = tokenize_orpo(tok, *preference.render(row, simpo.data.datasets[0], tok, jinja), 64)
        item = b.train[i]
        assert item["tokens"][0, :len(c_ids)].tolist() == c_ids and item["tokens"][1, :len(r_ids)].tolist() == r_ids
        assert item["loss_mask"][0].nonzero()[0].tolist() == list(range(c_p - 1, len(c_ids) - 1))


def _kto(**over) -> dict:
    raw = yaml.safe_load((FIXTURES / "qlora-1b-kto.yaml").read_text())
    raw.update({"load_in_4bit": False, "adapter": "lora", **over})  # a LoRA base: no bitsandbytes needed here
    return raw


def test_axolotl_kto_example_plans(tmp_path):
    """Axolotl's examples/llama-3/qlora-1b-kto.yaml plans (exit 0) as objective kto: rl_beta 0.5, desirable weight
    0.2, the unset undesirable weight Axolotl's 1.0."""
    from tests.helpers.axolotl_home import with_local_model

    path = with_local_model(FIXTURES / "qlora-1b-kto.yaml", tmp_path, drop=())  # the base's shape, no weights
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    said = "objective kto: plan counts each row as sequences of the micro-batch and 3 forward-only passes"
    assert code == 0 and said in out + err, err
    cfg = config.build(_kto(), env={}, world_size=1)
    assert cfg.objective == "kto" and (cfg.kto.beta, cfg.kto.desirable_weight, cfg.kto.undesirable_weight) == (
        0.5, 0.2, 1.0)
    assert any(n.startswith("rl: kto -> objective: kto (TRL's KTOTrainer, loss_type kto, beta 0.5") for n in cfg.notes)
    for keys, want in (({"kto_undesirable_weight": 0.7, "trl": {"beta": 0.3}}, (0.3, 0.2, 0.7)),
                       ({"kto_desirable_weight": 0, "rl_beta": None}, (0.1, 1.0, 1.0)),  # Axolotl's `or 1.0`
                       ({"dpo_label_smoothing": 0.1, "simpo_gamma": 0.5}, (0.5, 0.2, 1.0))):  # not KTO's: noted
        c = config.build(_kto(**keys), env={}, world_size=1)
        assert (c.kto.beta, c.kto.desirable_weight, c.kto.undesirable_weight) == want, keys


@pytest.mark.parametrize("over, needle", [
    ({"micro_batch_size": 1}, "micro_batch_size=1: KTO's KL term pairs each row's prompt with another row's"),
    ({"kto_desirable_weight": -1}, "kto_desirable_weight=-1: must be a number ≥ 0"),
    ({"orpo_alpha": 0.5}, "orpo_alpha=0.5: ORPO's weight: Axolotl would hand it to this trainer as beta"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]}, "rl: kto trains on labelled rows"),
    ({"rl": "dpo"}, "datasets[0].type='llama3.ultra': unknown dataset type"),  # Axolotl's DPO llama3.ultra: unbuilt
])
def test_kto_config_errors_in_one_line(over, needle):
    _refused_in_one_line(_kto(**over), needle)


def test_kto_rows_render_as_axolotl_and_tokenise_as_trl(tmp_path):
    """llama3.ultra / chatml.argilla_chat rows: Axolotl's transform strings, TRL's tokenisation (special tokens,
    EOS appended), the label kept, a row over sequence_len dropped; the KL rows of a micro-batch pair row i's
    prompt with row i-1's completion (TRL's rotation)."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from adapter.data.sft import preference, preference_kto
    from adapter.data.sft.preference import tokenize
    from adapter.train import dpo

    tok_dir = tiny_model(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    row = {"prompt": "Hi", "completion": "Hello.", "label": True, "system": "Be kind."}
    p, c, lab = preference_kto.render(row, "llama3.ultra")
    assert p == ("<|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|><|start_header_id|>user"
                 "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert c == "Hello.<|eot_id|>" and lab is True
    chat = {"completion": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "label": False}
    assert preference_kto.render(chat, "chatml.argilla_chat") == (
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", "A<|im_end|>", False)
    rows = [{"prompt": f"Say {i}", "completion": f"{i} " * (1 + i), "label": i % 2 == 0} for i in range(4)]
    rows.append({"prompt": "long", "completion": "word " * 200, "label": True})
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    raw = {"base_model": str(tok_dir), "adapter": "lora", "learning_rate": 1e-4, "sequence_len": 64,
           "micro_batch_size": 2, "rl": "kto", "datasets": [{"path": str(data), "type": "chatml.prompt_pairs"}],
           "dataset_prepared_path": str(tmp_path / "prep")}
    cfg = config.build(raw, env={}, world_size=1)
    from adapter.data.sft.preference_kto import prepare_rows
    from adapter.models import source

    out = prepare_rows(cfg, tok_dir, source.vocab_rows(cfg))
    assert len(out.train) == 4 and out.stats["datasets"][0]["dropped_too_long"] == 1
    assert sorted(out.train.rows.tolist()) == [0, 1, 2, 3] and out.train.rows.tolist() != [0, 1, 2, 3]  # shuffled
    for i in range(4):  # once, with the seed (Axolotl's shuffle_merged_datasets), then trained in that order
        prompt, completion, label = preference_kto.render(rows[int(out.train.rows[i])], "chatml.prompt_pairs")
        ids, comp, _ = tokenize(tok, prompt, completion, completion)
        item = out.train[i]
        assert item["tokens"][0, :len(ids) + len(comp)].tolist() == ids + comp
        assert item["loss_mask"][0].nonzero()[0].tolist() == list(range(len(ids) - 1, len(ids) + len(comp) - 1))
        assert bool(item["kto_label"][0, 0]) == label
    items = [out.train[i] for i in range(3)]
    b = dpo.flat({k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]})
    assert b["tokens"].shape == (6, 64)
    for i in range(3):  # KL row i: row i's prompt, row i-1's completion
        j = (i - 1) % 3
        p_i, c_j = int(items[i]["kto_len"][0, 0]), int(items[j]["kto_len"][0, 1])
        want = items[i]["kto_prompt"][0, :p_i].tolist() + items[j]["kto_completion"][0, :c_j].tolist()
        assert b["tokens"][3 + i, :p_i + c_j].tolist() == want
        assert b["loss_mask"][3 + i].nonzero()[:, 0].tolist() == list(range(p_i - 1, p_i + c_j - 1))
    assert preference.stats_lines(out)[1].endswith("1 over sequence_len dropped, 4 rows kept")
    assert "desirable" in preference.stats_lines(out)[2]
    shown = preference_kto.any_debug_lines(out, tok, 2)
    assert len(shown) == 2 and shown[0].startswith("row 0 ") and ", -100)" in shown[0]
    held = prepare_rows(config.build({**raw, "val_set_size": 2}, env={}, world_size=1), tok_dir,
                        source.vocab_rows(cfg))  # Axolotl's split: the shuffled rows' tail, both sides in its order
    assert held.train.rows.tolist() + held.val.rows.tolist() == out.train.rows.tolist()
    assert len(held.val) == 2 and "held out (val_set_size): 2 rows for the eval, 2 rows to train on" in \
        "\n".join(preference.stats_lines(held))


def test_kto_types_render_as_axolotls_own_transforms():
    """Every KTO type nd-adapter reads renders each row as Axolotl's own transform does (its
    prompt_strategies.kto.llama3 and .chatml modules, unchanged, from tests/fixtures/axolotl/kto_*.py.txt, Axolotl
    067b021), with and without a system prompt."""
    from adapter.data.sft import formats, preference_kto

    for template in ("llama3", "chatml"):
        ns: dict = {}
        src = (FIXTURES / f"kto_{template}.py.txt").read_text()
        exec(compile(src, f"axolotl/prompt_strategies/kto/{template}.py", "exec"), ns)
        for kind in (k for k in formats.KTO_TYPES if k.startswith(template + ".")):
            strategy = kind.split(".")[1]
            for system in ("", "Be kind.", None):
                row = {"instruction": "Add 1+1.", "question": "Why?", "prompt": "Hi there", "completion": "Two.",
                       "label": system is None}
                if strategy == "argilla_chat":
                    row["completion"] = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
                if system is not None:
                    row["system"] = system
                want = ns[strategy]({})(dict(row))
                assert preference_kto.render(row, kind) == (want["prompt"], want["completion"], want["label"]), kind


def test_plan_counts_both_answers_and_the_reference_forward(tmp_path):
    """Axolotl's DPO example (LoRA) plans as the same file's SFT run with twice the micro-batch (the chosen and the
    rejected sequence of each pair train with gradients) plus one forward-only pass over them (the reference: the
    base with the adapters disabled); ORPO has no reference; it counted one sequence per pair before."""
    import json

    from tests.helpers.axolotl_home import with_local_model

    def plan(name, **keys):
        path = with_local_model(FIXTURES / "instruct-dpo-lora-8b.yml", tmp_path / name, drop=(), load_in_8bit=False,
                                bf16=True, **keys)
        code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1", "--gpu", "h200", "--format", "json",
                                 "--set", "model.engine=transformers",  # DPO's engine (auto takes it for DPO)
                                 "--set", "model.fused_linear_ce=false")  # the SFT run's loss as DPO's: whole logits
        assert code == 0, err
        return json.loads(out)

    dpo, orpo = plan("dpo"), plan("orpo", rl="orpo", datasets=[{"path": "x.jsonl", "type": "chat_template.argilla"}])
    mb = dpo["batch"]["micro_batch_size"]
    sft = plan("sft", rl=None, micro_batch_size=2 * mb,
               datasets=[{"path": "x.jsonl", "type": "chat_template", "field_messages": "conversation"}])
    assert dpo["memory"]["activations"] == sft["memory"]["activations"] == orpo["memory"]["activations"]
    assert dpo["batch"]["tokens_per_step"] == sft["batch"]["tokens_per_step"] == 2 * mb * dpo["seq_len"] * \
        dpo["batch"]["gradient_accumulation_steps"]
    s, d, o = (p["predicted"] for p in (sft, dpo, orpo))
    assert abs(o["step_time_s"] - s["step_time_s"]) < 1e-9  # no reference
    assert abs(d["step_time_s"] - s["step_time_s"] - 0.5 * s["breakdown"]["compute"]) < 1e-9  # LoRA: fwd = 1/2


def test_kto_full_fine_tune_takes_a_reference_table_and_keeps_the_policy_pass_over_its_kl_rows():
    """A full fine-tune's KTO reference is the starting weights' table (adapter/train/kto.reference_table); each
    step still runs the KL rows through the policy: one forward-only pass a row, not LoRA's three."""
    full = config.build(_kto(adapter=None, lora_r=None, lora_alpha=None, lora_dropout=None, lora_target_linear=None),
                        env={}, world_size=1)
    assert full.lora is None and full.fixed_reference() and full.preference_passes() == (1, 1)
    lora = config.build(_kto(), env={}, world_size=1)
    assert not lora.fixed_reference() and lora.preference_passes() == (1, 3)


def test_dpo_padding_free_maps_and_runs_the_rows_real_tokens_as_one_stream(monkeypatch):
    """Axolotl's dpo_padding_free (TRL's padding_free) -> dpo.padding_free for rl: dpo / ipo only (the trainers
    Axolotl hands it to); the loss path then runs the model once on a [1, T] stream of the rows' real tokens
    (T = Σ lengths, rounded as packed documents are) with positions restarting per row, and puts each token's loss
    back at its row and column (the distributed equality with padded runs: tests/distributed/test_dpo.py)."""
    import torch

    from adapter.train import batches, dpo

    cfg = config.build(_example(dpo_padding_free=True), env={}, world_size=1)
    assert cfg.dpo.padding_free and cfg.padding_free_pairs() and cfg.document_attention
    assert any(n.startswith("dpo_padding_free: true -> dpo.padding_free") for n in cfg.notes)
    orpo = config.build(_example(rl="orpo", dpo_padding_free=True), env={}, world_size=1)
    assert not orpo.padding_free_pairs() and any("dpo_padding_free: not read by ORPO" in n for n in orpo.notes)
    assert config.build(_example(dpo_padding_free="yes"), env={}, world_size=1).dpo.padding_free  # as Axolotl reads
    with pytest.raises(UserError, match="dpo_padding_free"):
        config.build(_example(dpo_padding_free="maybe"), env={}, world_size=1)
    lengths = torch.tensor([5, 3, 7, 2])  # chosen, chosen, rejected, rejected of two pairs
    s = 9
    pos = torch.arange(s).expand(4, s)
    rows = {"tokens": torch.randint(3, 50, (4, s)), "loss_mask": (pos >= 1).float() * (pos < lengths[:, None] - 1),
            "seq_mask": (pos < lengths[:, None] - 1).float()}
    rows["labels"] = torch.roll(rows["tokens"], -1, 1)
    run = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(cp=1, tp=1), shares_prompt=False)
    b = batches.place(run, 0, "cpu", rows)
    calls = []

    def model(tokens, position_ids, mask, *, labels, loss_mask, packed_seq_params):  # loss = the token id
        calls.append((tokens.shape, position_ids[0].tolist()))
        return tokens.float()

    monkeypatch.setattr(dpo.parallel_state, "get_context_parallel_group", lambda: None)
    monkeypatch.setattr(dpo.dist, "get_world_size", lambda group=None: 1)
    out = dpo._token_losses(model, b)
    assert calls[0][0] == (1, int(lengths.sum())) and calls[0][1][:6] == [0, 1, 2, 3, 4, 0], calls
    real = pos < lengths[:, None]
    assert torch.equal(out, torch.where(real, rows["tokens"].float(), 0.0))


def test_a_shared_prompt_runs_once_and_every_token_sees_what_its_row_shows_it(monkeypatch):
    """dpo.share_prompt: each pair's common untrained prefix runs once; the stream's attention (the varlen kernels,
    the rejected part's keys gathered) equals each row's own causal attention token for token, and each token's
    loss lands at its row and column. `auto` takes it on the native engine at cp 1 and says why not elsewhere;
    `true` where it is not built is one line."""
    import torch

    from adapter.data.sft.preference import row_lengths, shared_prefix
    from adapter.kernels.varlen import packed_attention
    from adapter.models.checks import prompt_sharing
    from adapter.train import batches, dpo

    s, lengths, prompt = 12, [9, 7, 10, 5], [5, 3]  # chosen, chosen, rejected, rejected of two pairs
    g = torch.Generator().manual_seed(0)
    rows = {k: torch.zeros(4, s, dtype=torch.long) for k in ("tokens", "labels")}
    rows |= {k: torch.zeros(4, s) for k in ("loss_mask", "seq_mask")}
    for i, n in enumerate(lengths):
        rows["tokens"][i, :n] = torch.randint(1, 50, (n,), generator=g)
    for i, p in enumerate(prompt):
        rows["tokens"][2 + i, :p] = rows["tokens"][i, :p]
    for i, n in enumerate(lengths):
        rows["labels"][i, :n - 1] = rows["tokens"][i, 1:n]
        rows["loss_mask"][i, prompt[i % 2] - 1:n - 1] = 1
        rows["seq_mask"][i, :n - 1] = 1
    assert shared_prefix(rows).tolist() == [4, 2]  # the prompt less its last token, which predicts the answer
    cfg = config.build(_example(), env={}, world_size=1)
    run = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(cp=1, tp=1), shares_prompt=True)
    b = batches.place(run, 0, "cpu", rows)
    assert dpo.computed(run, rows) == sum(lengths) - 6 == int(b["pf_real"].sum())
    stream, params = b["pf_tokens"][0], b["pf_packed_seq_params"]
    h, d = 2, 4
    w, at = torch.randn(50, 3, h, d, generator=g), torch.randn(s, 3, h, d, generator=g)

    def qkv(tokens, pos):  # a token's q, k, v depend on its id and position only, as in a layer's first attention
        x = w[tokens] + at[pos]
        return x[:, 0], x[:, 1], x[:, 2]

    out = packed_attention(*qkv(stream, b["pf_position_ids"][0]), params, scale=0.5)
    for j in b["pf_real"][0].nonzero().flatten().tolist():
        row, col = divmod(int(b["pf_row_index"][0, j]), s)
        q, k, v = qkv(rows["tokens"][row, :col + 1], torch.arange(col + 1))
        want = torch.einsum("hk,khd->hd", torch.softmax(torch.einsum("hd,khd->hk", q[-1], k) * 0.5, -1), v)
        assert torch.allclose(out[j], want, atol=1e-5), (j, row, col)

    monkeypatch.setattr(dpo.parallel_state, "get_context_parallel_group", lambda: None)
    monkeypatch.setattr(dpo.dist, "get_world_size", lambda group=None: 1)
    got = dpo._token_losses(lambda tokens, *a, **kw: tokens.float(), b)  # loss = the token id
    pos = torch.arange(s).expand(4, s)
    real = pos < row_lengths(rows)[:, None]
    real[2, :4], real[3, :2] = False, False  # a rejected row's shared prefix ran once, for its chosen row
    assert torch.equal(got, torch.where(real, rows["tokens"].float(), 0.0))

    arch = SimpleNamespace(native=True, attn_softcap=None, moe=False, architecture="LlamaForCausalLM",
                           layer_kinds=(), attention_features=())
    assert prompt_sharing(cfg, arch, 1) is None
    hf = {**vars(arch), "native": False}  # the transformers engine: its attention function, where the model allows
    assert prompt_sharing(cfg, SimpleNamespace(**hf), 1) is None
    assert "attention sinks" in prompt_sharing(cfg, SimpleNamespace(**{**hf, "attention_features": ("sinks",)}), 1)
    assert "linear_attention layers carry a state" in prompt_sharing(
        cfg, SimpleNamespace(**{**hf, "layer_kinds": ("full_attention", "linear_attention")}), 1)
    assert "context parallelism" in prompt_sharing(cfg, arch, 2)
    assert cfg.dpo.share_prompt == "auto"  # Axolotl's keys: auto
    native = cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"share_prompt": True})})
    with pytest.raises(UserError, match=r"dpo.share_prompt=True.*context parallelism.*auto"):
        prompt_sharing(native, arch, 2)


def test_precompute_ref_log_probs_makes_fresh_lora_s_reference_a_table():
    """Axolotl's precompute_ref_log_probs (TRL's, rl: dpo / ipo) -> dpo.precompute_ref: the reference (the base, for
    fresh adapters) is a table computed once, so plan counts no reference forward; other rl values say it is not
    read; a value that is not a boolean is one line."""
    cfg = config.build(_example(precompute_ref_log_probs=True), env={}, world_size=1)
    assert cfg.dpo.precompute_ref and cfg.fixed_reference() and cfg.preference_passes() == (2, 0)
    assert any(n.startswith("precompute_ref_log_probs: true -> dpo.precompute_ref") for n in cfg.notes)
    plain = config.build(_example(), env={}, world_size=1)
    assert not plain.fixed_reference() and plain.preference_passes() == (2, 1)
    orpo = config.build(_example(rl="orpo", precompute_ref_log_probs=True), env={}, world_size=1)
    assert not orpo.dpo.precompute_ref and any("precompute_ref_log_probs: not read by ORPO" in n for n in orpo.notes)
    with pytest.raises(UserError, match="precompute_ref_log_probs"):
        config.build(_example(precompute_ref_log_probs="maybe"), env={}, world_size=1)
