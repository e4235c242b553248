"""1,000+ generated Axolotl configs, dataset and adapter sections included, through what `plan` runs (the
dialect mapping, validation, the model and layout checks, the plan itself): each is a plan or a one-line UserError,
never another exception. In-process, so a thousand cost seconds, not minutes."""
from __future__ import annotations

import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.errors import UserError
from adapter.models import source
from adapter.models.resolved import resolve_run
from adapter.plan.build import build_plan

ROOT = Path(__file__).resolve().parents[2]
MODELS = [str(ROOT / "configs/models" / m) for m in ("llama-3.2-1b", "qwen3-8b", "mistral-7b")]
junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 70_000), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(string.printable, max_size=8), st.lists(st.integers(0, 3), max_size=2))
small = st.one_of(st.integers(0, 16), junk)
TYPES = ["alpaca", "chat_template", "completion", "input_output", "sharegpt", "oasst", "alpaca:chat", 3, None]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens",
           "mlp", "wq"]


def sometimes(draw, good, bad=junk, one_in: int = 8):
    """Mostly a plausible value, one time in `one_in` a random one: deep paths get reached, and every key is hit."""
    return draw(bad) if draw(st.integers(0, one_in - 1)) == 0 else draw(good)


@st.composite
def datasets(draw):
    entry = {"path": sometimes(draw, st.just("d.jsonl"), st.sampled_from(["org/hub-set", "", None, 5])),
             "type": sometimes(draw, st.sampled_from(TYPES[:5]), st.sampled_from(TYPES[5:]))}
    for key in draw(st.sets(st.sampled_from(["field_messages", "roles_to_train", "train_on_eos", "split",
                                             "data_files", "message_property_mappings", "chat_template", "name",
                                             "bogus"]), max_size=2)):
        entry[key] = draw(st.one_of(junk, st.dictionaries(st.sampled_from(["role", "content"]), st.text(max_size=4),
                                                          max_size=2)))
    return sometimes(draw, st.lists(st.just(entry), min_size=1, max_size=3))


@st.composite
def axolotl_configs(draw):
    raw = {"base_model": sometimes(draw, st.sampled_from(MODELS), st.just("/nonexistent")),
           "learning_rate": sometimes(draw, st.sampled_from([2e-5, "2e-4", 0.0002])),
           "datasets": draw(datasets())}
    if draw(st.booleans()):  # an adapter section
        raw["adapter"] = sometimes(draw, st.sampled_from(["lora", "qlora"]), st.sampled_from(["ia3", None, True]))
        if raw["adapter"] == "qlora" and draw(st.integers(0, 7)):
            raw["load_in_4bit"] = True
        for key in draw(st.sets(st.sampled_from(["lora_r", "lora_alpha", "lora_dropout", "lora_target_linear",
                                                 "load_in_4bit", "load_in_8bit", "peft_use_rslora", "peft_use_dora",
                                                 "lora_model_dir", "lora_modules_to_save"]), max_size=3)):
            raw[key] = sometimes(draw, st.sampled_from({"lora_r": [8, 16, 64], "lora_alpha": [16, 32],
                                                        "lora_dropout": [0.0, 0.05], "lora_target_linear": [True],
                                                        "lora_modules_to_save": [["lm_head"], ["embed_tokens"]],
                                                        }.get(key, [False])), small)
        if draw(st.booleans()):
            raw["lora_target_modules"] = draw(st.one_of(st.lists(st.sampled_from(TARGETS), max_size=4),
                                                        st.sampled_from(["all-linear", ".*proj", "[", "q_proj"])))
    for key in draw(st.sets(st.sampled_from(
            ["sequence_len", "micro_batch_size", "gradient_accumulation_steps", "num_epochs", "max_steps",
             "tensor_parallel_size", "dp_shard_size", "context_parallel_size", "sample_packing", "val_set_size",
             "optimizer", "save_steps", "save_total_limit", "saves_per_epoch", "output_dir", "bf16",
             "gradient_checkpointing", "warmup_ratio", "evals_per_epoch", "unfrozen_parameters",
             "lr_scheduler", "chat_template", "train_on_inputs", "special_tokens"]), max_size=6)):
        plausible = {"sequence_len": [512, 2048, 4096], "micro_batch_size": [1, 2], "max_steps": [10, 100],
                     "gradient_accumulation_steps": [1, 4], "num_epochs": [1, 3], "tensor_parallel_size": [1, 2],
                     "dp_shard_size": [1, 2, 4], "context_parallel_size": [1, 2], "optimizer": ["adamw_8bit",
                     "adamw_torch_fused", "adamw_torch_4bit"], "save_steps": [10, 0.25], "save_total_limit": [1, 3],
                     "output_dir": ["./out"], "bf16": ["auto", True], "lr_scheduler": ["cosine", "linear"],
                     "chat_template": ["chatml", "llama3"], "val_set_size": [0.0, 0.05]}
        raw[key] = sometimes(draw, st.sampled_from(plausible.get(key, [True, False])), small, one_in=4)
    return raw


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(raw=axolotl_configs(), world=st.sampled_from([None, 1, 2, 8]))
def test_generated_configs_plan_or_refuse_in_one_line(tmp_path_factory, raw, world):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    try:
        cfg = source.load_config(path, world_size=world)
        build_plan(resolve_run(cfg), config_path=str(path))
    except UserError as e:
        assert "\n" not in str(e) and "Fix:" in str(e), str(e)
