"""Mixture-of-experts records, torch-free: what the configs say, what is refused in one line, `plan`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter.errors import UserError
from adapter.models.arch import arch_from_hf_dict, load_arch
from tests.helpers.cli import run_cli
from tests.helpers.runs import planned

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs/models"


def test_routing_facts_of_the_flagships():
    q, m, o = (load_arch(MODELS / n) for n in ("qwen3-30b-a3b", "mixtral-8x7b-v0.1", "olmoe-1b-7b-0924"))
    assert (q.num_experts, q.experts_per_token, q.expert_ffn_hidden_size, q.norm_topk_prob) == (128, 8, 768, True)
    assert (m.num_experts, m.experts_per_token, m.expert_ffn_hidden_size, m.norm_topk_prob) == (8, 2, 14336, True)
    assert (o.num_experts, o.norm_topk_prob, o.qk_norm_whole, o.norm_eps) == (64, False, True, 1e-5)  # class default
    assert (q.router_aux_loss_coef, q.output_router_logits) == (0.001, False)
    assert not load_arch(MODELS / "qwen3-8b").moe


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [0]}, r"^mlp_only_layers=\[0\]: a model mixing dense and mixture-of-experts layers"),
    ({"decoder_sparse_step": 2}, r"^decoder_sparse_step=2: a model mixing"),
    ({"num_experts_per_tok": 200}, r"^num_experts_per_tok=200: exceeds num_experts=128"),
    ({"router_aux_loss_coef": -1}, r"^router_aux_loss_coef=-1: must be a number >= 0"),
])
def test_bad_moe_configs_are_refused_in_one_line(change, match):
    cfg = json.loads((MODELS / "qwen3-30b-a3b/config.json").read_text())
    with pytest.raises(UserError, match=match):
        arch_from_hf_dict({**cfg, **change})
    mixtral = json.loads((MODELS / "mixtral-8x7b-v0.1/config.json").read_text())
    with pytest.raises(UserError, match=r"^router_jitter_noise=0.1: router jitter is not built"):
        arch_from_hf_dict({**mixtral, "router_jitter_noise": 0.1})


def _yaml(tmp_path, extra: str = "") -> str:
    p = tmp_path / "run.yaml"
    p.write_text(f"model:\n  path: {MODELS / 'qwen3-30b-a3b'}\ndata:\n  synthetic: true\nseq_len: 4096\n"
                 f"parallelism:\n  dp_shard_size: 8\n{extra}hardware:\n  gpus_per_node: 8\n")
    return str(p)


def test_plan_prints_the_experts_and_refuses_what_is_not_built(tmp_path):
    code, out, err = run_cli("plan", _yaml(tmp_path))
    assert code == 0, err
    assert "30.53B params" in out and "128 experts of ffn 768, top 8" in out
    assert "mixture of experts: the step time models the experts" in out + err
    code, _, err = run_cli("plan", _yaml(tmp_path, "sequence_parallel: false\nparallelism:\n  tp_size: 2\n")
                           .replace("parallelism:\n  dp_shard_size: 8\n", ""))
    assert code == 2 and "sequence_parallel=False: Megatron-Core's mixture-of-experts layer" in err
    # LoRA: the attention (the experts and the router are not linears in transformers, so not PEFT's targets)
    code, out, err = run_cli("plan", _yaml(tmp_path, "lora:\n  r: 8\n  target_linear: true\n"))
    assert code == 0, err
    assert "on q_proj, k_proj, v_proj, o_proj of all 48 layers" in out and "experts and the router are not" in out
    for extra, needle in (("lora:\n  r: 8\n  target_modules: [q_proj, gate_proj]\n",
                           "LoRA on the experts of a mixture of experts (gate_proj) is not built"),
                          ("lora:\n  r: 8\n  target_modules: [gate]\n",
                           "LoRA on the router of a mixture of experts (gate) is not built")):
        code, _, err = run_cli("plan", _yaml(tmp_path, extra))
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_qlora_on_a_mixture_of_experts_quantises_the_attention_alone(tmp_path):
    """As transformers + bitsandbytes load it (`load_in_4bit`): the attention's linears in NF4, the router and the
    experts (not nn.Linear modules there) in the compute dtype; plan's memory counts them so. Mixtral's table names
    its experts w1..w3: `target_linear` takes its attention too (was an internal error)."""
    from adapter import config
    from adapter.models import footprint
    from adapter.models.counts import linears
    from adapter.models.lora import nn_linears

    arch = load_arch(MODELS / "qwen3-30b-a3b")
    assert [lin.name for lin in nn_linears(arch)] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    dense = load_arch(MODELS / "llama-3.1-8b")
    assert nn_linears(dense) == linears(dense)  # a dense model: every decoder linear, as before
    cfg = config.build({"model": {"path": str(MODELS / "qwen3-30b-a3b")}, "data": {"synthetic": True},
                        "lora": {"r": 8, "target_linear": True, "quantize_base": "nf4"}}, env={}, world_size=1)
    held, bytes_each, largest = footprint.quantized_base(planned(cfg, arch), 1)
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    assert held == arch.num_layers * (h * (q + 2 * kv) + q * h) and largest == h * q and bytes_each == 0.5625
    code, out, err = run_cli("plan", _yaml(tmp_path, "lora:\n  r: 8\n  target_linear: true\n  quantize_base: nf4\n"))
    assert code == 0 and "NF4" in out, err
    p = tmp_path / "mixtral.yaml"
    p.write_text(f"base_model: {MODELS / 'mixtral-8x7b-v0.1'}\nadapter: qlora\nload_in_4bit: true\nlora_r: 8\n"
                 "lora_alpha: 16\nlora_target_linear: true\nsequence_len: 2048\nmax_steps: 1\n"
                 "learning_rate: 1e-4\n")
    code, out, err = run_cli("plan", str(p), "--gpus-per-node", "8")
    assert code == 0 and "on q_proj, k_proj, v_proj, o_proj of all 32 layers" in out, err


def test_axolotl_model_config_switches_the_load_balancing_loss(tmp_path):
    """Every Axolotl Mixtral example sets `model_config: {output_router_logits: true}` (Axolotl sets it on the HF
    config before loading): it maps to model.output_router_logits, which the architecture the run trains takes over
    config.json's; any other model_config key, and the key on a dense model, is refused in one line."""
    from adapter import config
    from adapter.models import source

    base = {"base_model": str(MODELS / "mixtral-8x7b-v0.1"), "sequence_len": 2048, "max_steps": 1,
            "learning_rate": 1e-5}
    cfg = config.build({**base, "model_config": {"output_router_logits": True}}, env={}, world_size=8)
    assert cfg.model.output_router_logits is True
    assert not any("ignored Axolotl keys" in n and "model_config" in n for n in cfg.notes), cfg.notes
    assert not load_arch(MODELS / "mixtral-8x7b-v0.1").output_router_logits
    assert source.arch_for(cfg).output_router_logits
    with pytest.raises(UserError, match=r"^model_config.rope_theta=1: overriding this config.json key changes"):
        config.build({**base, "model_config": {"output_router_logits": True, "rope_theta": 1}}, env={}, world_size=8)
    dense = config.build({**base, "base_model": str(MODELS / "qwen3-8b"), "model_config": {"output_router_logits":
                                                                                          True}}, env={}, world_size=8)
    with pytest.raises(UserError, match=r"^model_config.output_router_logits=True: Qwen3ForCausalLM is not a mixture"):
        source.arch_for(dense)
    yml = tmp_path / "dense.yml"
    yml.write_text(f"base_model: {MODELS / 'qwen3-8b'}\nsequence_len: 2048\nmax_steps: 1\nmodel_config:\n"
                   "  output_router_logits: true\nlearning_rate: 1e-5\n")
    code, _, err = run_cli("plan", str(yml))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a mixture of experts" in err


# ---- expert parallelism: layout, plan, search, and what is refused in one line ----------------------------------

def test_expert_groups_are_megatrons_over_dp_and_cp():
    """ep is the innermost factor of the flattened dp × cp index (Megatron's expert order "tp-ep-dp-pp" with expert
    tp = tp; tests/distributed/test_groups.py checks Megatron's own groups for every rank)."""
    from adapter.parallel.layout import Layout

    lay = Layout(1, 4, 1, 2, ep=2)   # ranks ((s)·1 + c)·2 + t
    assert lay.groups("ep") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert lay.groups("expt_dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    cp = Layout(1, 2, 2, 1, ep=2)    # cp innermost of dp × cp: the experts split over the CP pair
    assert cp.groups("ep") == cp.groups("cp") and cp.size("expt_dp") == 2
    hsdp = Layout(2, 2, 1, 1, ep=2)  # exact HSDP partitions experts inside a replica: m // 2 is the replica
    assert hsdp.groups("expt_dp") == ((0, 2), (1, 3)) and hsdp.groups("expt_dp_shard") == ((0,), (1,), (2,), (3,))
    assert Layout(2, 4, 1, 1, ep=2).groups("expt_dp_shard") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert lay.groups("expt_dp_shard") == lay.groups("expt_dp")  # one replica: the same ranks
    with pytest.raises(UserError, match=r"^ep_size=4: does not divide dp_shard × cp = 2"):
        Layout(2, 2, 1, 1, ep=4)     # within one replica only: every replica holds every expert


def _ep_plan(tmp_path, world: int, ep: int, model: str = "qwen3-30b-a3b", extra: str = ""):
    import json as _json

    p = tmp_path / f"ep{world}-{ep}.yaml"
    p.write_text(f"model:\n  path: {MODELS / model}\ndata:\n  synthetic: true\nseq_len: 4096\nprecision: bf16\n"
                 f"parallelism:\n  dp_shard_size: {world}\n  ep_size: {ep}\n{extra}hardware:\n  gpus_per_node: 8\n"
                 f"  gpu: h200\n  nodes: {world // 8}\n")
    code, out, err = run_cli("plan", str(p), "--format", "json")
    assert code == 0, err
    return _json.loads(out)


def test_plan_with_expert_parallelism_on_8_16_and_64_gpus(tmp_path):
    """Qwen3-30B-A3B on 8 and 16 GPUs, Qwen3-235B-A22B on 64: the expert groups, the token all-to-all (by hand),
    memory and a step time; ep shrinks what ZeRO-2 keeps whole (the experts) and what ZeRO-3 gathers per layer."""
    from adapter.models.arch import load_arch as _load

    q = _load(MODELS / "qwen3-30b-a3b")
    one, eight = _ep_plan(tmp_path, 8, 1), _ep_plan(tmp_path, 8, 8)
    groups = {g["name"]: g for g in eight["groups"]}
    assert groups["ep"]["size"] == 8 and groups["expt_dp"]["size"] == 1 and "ep" not in {g["name"] for g in
                                                                                         one["groups"]}
    a2a = next(r for r in eight["traffic"] if r["group"] == "ep")
    # 48 layers × 4 passes (dispatch, combine; fwd, bwd) × 4096 tokens × top 8 × 2048 × bf16 × 7/8
    assert a2a["bytes_per_step"] == int(4 * 48 * 4096 * 8 * 2048 * 2 * 7 / 8)
    assert eight["predicted"]["breakdown"]["ep_comm"] > 0 and eight["memory"]["fits"]
    # ZeRO-3 gathers one layer with 16 of its 128 experts instead of all of them
    assert eight["memory"]["gathered_params"] < one["memory"]["gathered_params"] / 2
    z2 = [_ep_plan(tmp_path, 16, ep, extra="deepspeed:\n  zero_stage: 2\n") for ep in (1, 16)]
    experts = 48 * 3 * 128 * 768 * 2048  # every expert's three matrices
    assert z2[0]["memory"]["weights"] - z2[1]["memory"]["weights"] == 2 * experts * 15 // 16
    big = _ep_plan(tmp_path, 64, 8, "qwen3-235b-a22b")
    assert big["predicted"]["step_time_s"] > 0 and {"ep", "expt_dp"} <= {g["name"] for g in big["groups"]}
    assert any("does not fit" in w or "exceeds the GPU" in w for w in
               _ep_plan(tmp_path, 8, 8, "qwen3-235b-a22b")["warnings"])  # 235 B on 8 GPUs: said not to fit
    assert q.num_experts == 128


def test_plan_experts_inside_exact_hsdp_replicas():
    """dp_replicate=2 × dp_shard=4, ep=2: each replica's experts partitioned over its 2 ranks holding them
    (expt_dp_shard), and the replicas' all-reduce carries those partitions beside the dense ones (by hand)."""
    from adapter import config
    from adapter.models.arch import load_arch as _load
    from adapter.models.counts import expert_params, local_params
    from adapter.parallel.layout import Layout
    from adapter.plan import traffic

    cfg = config.build({"model": {"path": str(MODELS / "qwen3-30b-a3b")}, "data": {"synthetic": True},
                        "precision": "bf16", "parallelism": {"dp_replicate_size": 2, "dp_shard_size": 4,
                                                             "ep_size": 2}}, env={}, world_size=8)
    arch = _load(MODELS / "qwen3-30b-a3b")
    rows = {r.group: r for r in traffic.estimate(planned(cfg, arch, Layout.from_config(cfg.parallelism)))}
    experts = expert_params(arch, 1)
    assert experts == 48 * 3 * 128 * 768 * 2048 and "expt_dp" not in rows
    dense = local_params(arch, 1).total(48) - experts  # the padded vocabulary's rows included
    assert rows["expt_dp_shard"].size == 2
    assert rows["dp_replicate"].bytes_per_step == int(2 * 2 * (dense / 4 + experts / 2 / 2) * 0.5)


def test_search_tries_expert_parallel_sizes(tmp_path):
    p = _yaml(tmp_path, "precision: bf16\n")
    code, out, err = run_cli("plan", p, "--search", "--format", "json", "--set", "recompute=full", "--set",
                             "model.compile=false", "--set", "parallelism.tp_size=1", "--set", "parallelism.cp_size=1")
    assert code == 0, err
    import json as _json

    rows = _json.loads(out)["rows"]
    assert {r["ep"] for r in rows} == {1, 2, 4, 8} and all("parallelism.ep_size=" in " ".join(r["sets"])
                                                              for r in rows if r["ep"] > 1)


@pytest.mark.parametrize("extra, needle", [
    ("  ep_size: 3\n  dp_shard_size: 8\n", "ep_size=3: does not divide num_experts=128"),
    ("  ep_size: 16\n  dp_shard_size: 8\n", "ep_size=16: does not divide dp_shard × cp = 8"),
    ("  ep_size: 16\n  dp_shard_size: 16\n", None),  # 128 experts over 16 of 2 nodes' GPUs
])
def test_expert_parallel_refusals(tmp_path, extra, needle):
    p, nodes = tmp_path / "r.yaml", 2 if "dp_shard_size: 16" in extra else 1
    p.write_text(f"model:\n  path: {MODELS / 'qwen3-30b-a3b'}\ndata:\n  synthetic: true\nseq_len: 4096\n"
                 f"parallelism:\n{extra}hardware:\n  gpus_per_node: 8\n  nodes: {nodes}\n")
    code, _, err = run_cli("plan", str(p))
    assert (code == 0) if needle is None else (code == 2 and needle in err and len(err.strip().splitlines()) == 1)


def test_expert_parallelism_on_a_dense_model_or_uneven_experts_or_beside_hpz_refused(tmp_path):
    from adapter import config
    from adapter.models import checks
    from adapter.models.arch import load_arch as _load

    def cfg(model, ep, world=8):
        return config.build({"model": {"path": str(MODELS / model)}, "data": {"synthetic": True},
                             "parallelism": {"dp_shard_size": world, "ep_size": ep}}, env={}, world_size=world)

    with pytest.raises(UserError, match=r"^parallelism.ep_size=2: Qwen3ForCausalLM is not a mixture of experts"):
        checks.check(cfg("qwen3-8b", 2), _load(MODELS / "qwen3-8b"))
    mixtral = _load(MODELS / "mixtral-8x7b-v0.1")
    with pytest.raises(UserError, match=r"^parallelism.ep_size=16: does not divide num_experts=8"):
        checks.check(cfg("mixtral-8x7b-v0.1", 16, 16), mixtral)
    from adapter.parallel import deepspeed_config
    from adapter.parallel.layout import Layout

    hpz = config.build({"model": {"path": str(MODELS / "mixtral-8x7b-v0.1")}, "data": {"synthetic": True},
                        "parallelism": {"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2},
                        "deepspeed": {"replicate_mode": "hpz"}}, env={}, world_size=4)
    with pytest.raises(UserError, match=r"^parallelism.ep_size=2: expert parallelism beside hpZ's secondary"):
        deepspeed_config.zero_stage(hpz, Layout.from_config(hpz.parallelism))


def test_axolotl_expert_parallel_size(tmp_path):
    """Axolotl's ep axis sits beside dp_shard (ep × dp_shard = world); here it lies within the data-parallel ranks:
    dp_shard × ep of them. Its token cap is refused where it could drop routed tokens, accepted where it cannot."""
    from adapter import config

    base = {"base_model": str(MODELS / "qwen3-30b-a3b"), "sequence_len": 2048, "max_steps": 1, "learning_rate": 1e-5,
            "plugins": ["axolotl.integrations.expert_parallel.ExpertParallelPlugin"]}
    cfg = config.build({**base, "expert_parallel_size": 2, "dp_shard_size": 2}, env={}, world_size=4)
    assert (cfg.parallelism.ep_size, cfg.parallelism.dp_shard_size) == (2, 4)
    assert any(n.startswith("expert_parallel_size: 2 -> parallelism.ep_size: 2") for n in cfg.notes)
    with pytest.raises(UserError, match=r"^expert_parallel_token_capacity=1024: a per-expert token cap below a "
                       r"micro-batch's 2,048 tokens may drop"):
        config.build({**base, "expert_parallel_size": 2, "expert_parallel_token_capacity": 1024}, env={},
                     world_size=4)
    # a cap no expert can reach (a token takes an expert once): nothing dropped, accepted and said (GLM-5.2's example)
    cfg = config.build({**base, "expert_parallel_size": 2, "expert_parallel_token_capacity": 1_000_000}, env={},
                       world_size=4)
    assert any(n.startswith("expert_parallel_token_capacity: 1,000,000: no expert can receive more") for n in cfg.notes)


def test_expert_weights_are_read_in_place_where_they_share_a_buffer():
    """GroupedExperts' weights live in one buffer per linear (and ZeRO-1/2's flat buffer interleaves fc1 and fc2 at
    a fixed step): the grouped GEMM reads them as a strided view, no copy; scattered weights are stacked."""
    import torch

    from adapter.modeling.moe import as_batch

    flat = torch.randn(4 * (6 * 8 + 8 * 6))  # e0.fc1, e0.fc2, e1.fc1, ... as a flat optimizer buffer lays them out
    fc1 = [flat[i * 96:i * 96 + 48].view(6, 8) for i in range(4)]
    batch = as_batch(fc1)
    assert batch.data_ptr() == fc1[0].data_ptr() and torch.equal(batch, torch.stack(fc1))
    scattered = [torch.randn(6, 8) for _ in range(4)]
    assert torch.equal(as_batch(scattered), torch.stack(scattered))
    x, offs = torch.randn(10, 8), torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    got = torch._grouped_mm(x, as_batch(fc1).transpose(1, 2), offs=offs)
    assert torch.allclose(got[3:7], x[3:7] @ fc1[2].t()) and torch.allclose(got[7:], x[7:] @ fc1[3].t())


def test_grouped_linear_deposits_the_gradients_autograd_would_accumulate():
    """`_GroupedLinear` under `deposit` (the flat AdamW's runs) writes each expert's weight gradient into its `.grad`
    itself: over two micro-batches (the second adds into rows of the first's tensor) and after `zero_grad`, the
    gradients equal autograd's per-parameter ones, and so do the inputs' gradients; frozen weights get none."""
    import torch

    from adapter.modeling.moe import _GroupedLinear, as_batch

    def experts():
        buf = torch.randn(4, 8, 12, generator=torch.Generator().manual_seed(0))
        ws = [torch.nn.Parameter(torch.empty(0)) for _ in range(4)]
        for w, row in zip(ws, buf):
            w.data = row
        return ws

    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    xs = [torch.randn(10, 12) for _ in range(3)]
    grads = {}
    for deposit in (False, True):
        ws = experts()
        seen = []
        for step in ((0, 1), (2,)):  # two micro-batches, then zero_grad and one more
            for w in ws:
                w.grad = None
            for i in step:
                x = xs[i].detach().requires_grad_()
                batch = as_batch([w.detach() for w in ws])
                args = (ws,) if deposit else (None, *ws)
                y = _GroupedLinear.apply(x, offs, batch, *args)
                (y * torch.arange(8.0)).sum().backward()
                seen.append(x.grad)
            seen += [w.grad.clone() for w in ws]
        grads[deposit] = seen
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])) and len(grads[True]) == 11
    frozen = experts()
    for w in frozen:
        w.requires_grad_(False)
    x = xs[0].detach().requires_grad_()
    _GroupedLinear.apply(x, offs, as_batch(frozen), None).sum().backward()
    assert x.grad is not None and all(w.grad is None for w in frozen)
    # GroupedExperts under deposit with one expert frozen (e.g. by unfrozen_parameters): autograd's way instead,
    # so the trained experts get their gradients and the frozen one none
    from types import SimpleNamespace

    from adapter.modeling.moe import GroupedExperts

    part = experts()
    part[1].requires_grad_(False)
    owner = SimpleNamespace(deposit=True, _weights=lambda name: (part, as_batch([w.detach() for w in part])))
    GroupedExperts._linear(owner, xs[0], offs, "linear_fc1").sum().backward()
    ref = experts()
    _GroupedLinear.apply(xs[0], offs, as_batch([w.detach() for w in ref]), None, *ref).sum().backward()
    assert part[1].grad is None and all(torch.equal(part[i].grad, ref[i].grad) for i in (0, 2, 3))


def test_local_permutation_gradients():
    """LocalTokenDispatcher's permutation and its inverse (gathers both ways, no scatter-add): values against
    index_select / scatter_add and gradients by gradcheck, with every token picking k = 3 of 5 experts."""
    import torch

    from adapter.modeling.moe import _Permute, _Unpermute

    g = torch.Generator().manual_seed(0)
    tokens, experts, k = 7, 5, 3
    pick = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, pick, True)
    order = torch.argsort(routing.T.reshape(-1).logical_not().to(torch.uint8), stable=True)[:tokens * k]
    rows = order % tokens
    inv = torch.argsort(rows, stable=True).view(tokens, k)
    x = torch.randn(tokens, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * k, 4, dtype=torch.float64, requires_grad=True)
    assert torch.equal(_Permute.apply(x, rows, inv), x.index_select(0, rows))
    want = torch.zeros(tokens, 4, dtype=torch.float64).scatter_add(0, rows[:, None].expand(-1, 4), y)
    assert torch.allclose(_Unpermute.apply(y, rows, inv), want, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: _Permute.apply(t, rows, inv), (x,))
    assert torch.autograd.gradcheck(lambda t: _Unpermute.apply(t, rows, inv), (y,))


def test_routing_index_equals_stable_sorts():
    """The prefix-sum permutation (`_routing_index`) is exactly the one the two stable argsorts gave: expert-major
    rows with tokens ascending, each token's rows in expert order, the rows per expert."""
    import torch

    from adapter.modeling.moe import _routing_index

    g = torch.Generator().manual_seed(0)
    for tokens, experts, k in ((7, 5, 3), (64, 16, 4), (33, 128, 8), (5, 4, 4)):
        pick = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices
        routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, pick, True)
        want = torch.argsort(routing.T.reshape(-1).logical_not().to(torch.uint8), stable=True)[:tokens * k]
        order, rows, inv, counts = _routing_index(routing, k)
        assert torch.equal(order, want) and torch.equal(rows, want % tokens)
        assert torch.equal(inv, torch.argsort(want % tokens, stable=True).view(tokens, k))
        assert torch.equal(counts, routing.sum(0))


def test_mixtral_names_its_experts_as_its_table_does():
    """Mixtral's expert linears are w1, w3, w2 in its checkpoint and so in `counts.linears`: naming them in
    target_modules is refused as LoRA on the experts, not as a name the model lacks."""
    from adapter.models import counts, lora

    arch = load_arch(MODELS / "mixtral-8x7b-v0.1")
    assert [lin.name for lin in counts.linears(arch)] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate", "w1", "w3",
                                                          "w2"]
    with pytest.raises(UserError, match=r"LoRA on the experts of a mixture of experts \(w1\) is not built"):
        lora.resolve(arch, r=8, alpha=16, target_modules=["q_proj", "w1"])
    with pytest.raises(UserError, match=r"LoRA on the router of a mixture of experts \(gate\) is not built"):
        lora.resolve(arch, r=8, alpha=16, target_modules=["gate"])


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b-v0.1", "llama-3.1-8b"])
def test_lora_flops_count_the_weights_a_token_passes_through(name):
    """MFU of a LoRA run: 4 FLOPs per frozen weight a token passes through (a mixture of experts: its router and
    top-k experts, as full training's N), 6 per adapter weight, attention as in full training."""
    from adapter.models import counts, lora

    arch = load_arch(MODELS / name)
    spec = lora.resolve(arch, r=8, alpha=16, target_linear=True)
    adapters = spec.r * sum(t.linear.inp + t.linear.out for t in spec.targets)
    attention = 12 * arch.num_layers * arch.num_heads * arch.head_dim * 4096
    assert lora.flops_per_token(spec, arch, 4096) == 4 * counts.matmul_params(arch) + 6 * adapters + attention


def test_axolotl_quantize_moe_experts_on_the_transformers_engine_and_its_refusals(tmp_path):
    """Axolotl's `quantize_moe_experts` (its Qwen3.5 / GLM / Nemotron QLoRA examples): the native family moves to the
    transformers engine, plan counts the experts' 3-D weights as 4-bit, adapted too where lora_target_parameters
    names them (the loss equality is tests/distributed/test_transformers_engine.py); what Axolotl's schema refuses
    beside it, and what is not built, one line each."""
    from adapter import config
    from adapter.models import footprint
    from adapter.models.resolved import resolve_run

    head = (f"base_model: {MODELS / 'qwen3-30b-a3b'}\nsequence_len: 2048\nmax_steps: 1\nlearning_rate: 1e-4\n"
            "lora_r: 8\nlora_alpha: 16\n")
    qlora = "adapter: qlora\nload_in_4bit: true\nquantize_moe_experts: true\n"
    attention = "lora_target_modules: [q_proj, k_proj, v_proj, o_proj]\n"
    p = tmp_path / "ok.yaml"
    p.write_text(head + qlora + attention)
    code, out, err = run_cli("plan", str(p), "--gpus-per-node", "2")
    flat = " ".join(out.split())
    assert code == 0 and "transformers' own Qwen3MoeForCausalLM" in flat and "quantised too" in flat, err + out
    cfg = config.load(p, world_size=2)
    run = resolve_run(cfg)
    arch = load_arch(MODELS / "qwen3-30b-a3b")
    experts = arch.num_layers * 3 * arch.num_experts * arch.hidden_size * arch.expert_ffn_hidden_size
    held, _, largest = footprint.quantized_base(run, 1)
    assert run.peft.experts and sum(run.peft.experts) == experts and held > experts
    assert largest == 2 * arch.num_experts * arch.hidden_size * arch.expert_ffn_hidden_size  # gate_up_proj, whole
    p.write_text(head + qlora + attention + "fsdp_version: 2\nfsdp_config:\n  reshard_after_forward: true\n")
    code, out, err = run_cli("plan", str(p), "--gpus-per-node", "2")  # ZeRO-3 partitions the experts' codes too
    assert code == 0 and "NF4 base's codes (the experts' too)" in " ".join(out.split()), err + out
    p.write_text(head + qlora + attention + "lora_target_parameters: [experts.gate_up_proj, experts.down_proj]\n")
    code, out, err = run_cli("plan", str(p), "--gpus-per-node", "2")  # the quantised experts adapted too (Gemma 4's)
    flat = " ".join(out.split())
    assert code == 0 and "experts.down_proj, experts.gate_up_proj" in flat and "quantised too" in flat, err + out
    p.write_text(head + "adapter: lora\nload_in_8bit: true\nquantize_moe_experts: true\n" + attention)
    code, out, err = run_cli("plan", str(p), "--gpus-per-node", "2")  # GLM-4.7-Flash's examples: an 8-bit base
    assert code == 0 and "in int8 by Axolotl's parametrisation" in " ".join(out.split()), err + out
    for extra, needle in (("adapter: lora\nquantize_moe_experts: true\n" + attention, "the base is 16-bit"),
                          (qlora + "lora_target_linear: true\n", "Axolotl refuses lora_target_linear beside it"),
                          (qlora + attention + "expert_parallel_size: 2\n", "expert-parallel ranks")):
        p.write_text(head + extra)
        code, _, err = run_cli("plan", str(p), "--gpus-per-node", "2")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (extra, err)
