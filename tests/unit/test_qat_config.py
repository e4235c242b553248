"""`qat:` as Axolotl configures it: its examples llama-3/3b-qat-fsdp2.yaml (int4 weights, int8 activations) and
3b-qat-mxfp4.yaml plan unchanged on the transformers engine (the model's shape, no weights); what is not built (NVFP4,
combinations torchao's QAT refuses, QAT beside LoRA, tp) is refused in one line naming the key and the fix. The
training itself against transformers + torchao as Axolotl prepares it: tests/distributed/test_sft_train.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from adapter import config
from adapter.errors import UserError
from tests.helpers.cli import run_cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "axolotl"


def _example(name: str = "3b-qat-fsdp2.yaml", **over) -> dict:
    raw = yaml.safe_load((FIXTURES / name).read_text())
    raw.update(over)
    return raw


@pytest.mark.parametrize("name, want", [("3b-qat-fsdp2.yaml", ("int4", "int8", 32)),
                                        ("3b-qat-mxfp4.yaml", ("mxfp4", "mxfp4", 32))])
def test_axolotl_qat_examples_map_and_plan(tmp_path, name, want):
    from tests.helpers.axolotl_home import with_local_model

    cfg = config.build(_example(name), env={}, world_size=1)
    assert (cfg.qat.weight_dtype, cfg.qat.activation_dtype, cfg.qat.group_size) == want
    assert any(n.startswith("qat: torchao's fake-quantised linears as Axolotl prepares them") for n in cfg.notes)
    path = with_local_model(FIXTURES / name, tmp_path, drop=())  # the base's shape, no weights
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    said = " ".join(out.split())
    assert code == 0 and "engine: transformers' own LlamaForCausalLM" in said and "quantisation-aware training" in \
        said, (out[-3000:], err)
    assert config.build(_example(qat={"weight_dtype": "fp8"}), env={}, world_size=1).qat.weight_dtype == \
        "float8_e4m3fn"  # Axolotl's aliases
    compiled = config.build(_example(name, torch_compile=True), env={}, world_size=1)  # torch_compile: if possible
    assert compiled.model.compile is False and any("QAT's fake-quantised linears beside compiled layers are not "
                                                   "checked" in n for n in compiled.notes), compiled.notes
    with pytest.raises(UserError, match="model.compile=True: compiled layers beside QAT's fake quantisation"):
        config.build({"model": {"path": "m", "compile": True}, "qat": {"weight_dtype": "int4"}}, env={},
                     world_size=1)


@pytest.mark.parametrize("over, needle", [
    ({"qat": {"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 16}},
     "qat.weight_dtype='nvfp4': NVFP4 QAT is not built"),
    ({"qat": {"weight_dtype": "int8", "activation_dtype": "int8"}},
     "qat.weight_dtype='int8': with activation_dtype int8: not a combination torchao's QAT builds"),
    ({"qat": {"weight_dtype": "mxfp4", "activation_dtype": "mxfp4", "group_size": 16}},
     "qat.group_size=16: MXFP4 scales blocks of 32"),
    ({"qat": {"weight_dtype": "mxfp4", "activation_dtype": "mxfp4", "quantize_embedding": True}},
     "qat.quantize_embedding=True: Axolotl's MXFP4 config fake-quantises activations too"),
    ({"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
     "adapter='lora': QAT beside LoRA is not built"),
    ({"tensor_parallel_size": 2}, "parallelism.tp_size=2: QAT's fake-quantised linears are built beside data"),
    ({"qat": {"weight_dtype": "int4", "activation_dtype": "bf16"}}, "qat.activation_dtype"),
])
def test_unbuilt_qat_settings_refused_in_one_line(over, needle):
    world = 2 if "tensor_parallel_size" in over else 1
    with pytest.raises(UserError) as e:
        config.build({**_example(), **over}, env={}, world_size=world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_native_engine_refuses_qat():
    from adapter.models.arch import NotNative
    from adapter.models.lora import check_native

    with pytest.raises(NotNative, match="quantisation-aware training .* is built on the transformers engine only"):
        check_native(config.build(_example(), env={}, world_size=1), SimpleNamespace(moe=False))
