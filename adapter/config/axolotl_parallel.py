"""Axolotl's parallelism and kernel keys: context parallelism (the flat `context_parallel_size` keys and the
ring-master plugin's `context_parallel:` block), expert parallelism, FSDP (onto its DeepSpeed ZeRO equivalent), a
`deepspeed:` JSON, and the keys that name a peer's kernels."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adapter.config import axolotl_scope, axolotl_values
from adapter.config.schema import set_dotted
from adapter.config.values import check_path, check_tree
from adapter.errors import bad

# Keys that choose a peer's kernels: nd-adapter always runs its own (adapter/kernels: SDPA attention, fused RoPE,
# SwiGLU and its fused linear cross-entropy), so they get one line saying so.
KERNEL_KEYS = {"attn_implementation", "flash_attention", "sdp_attention", "xformers_attention", "flex_attention",
               "sage_attention", "eager_attention", "flash_attn_cross_entropy", "flash_attn_fuse_mlp",
               "flash_attn_rms_norm", "flash_optimum", "cut_cross_entropy", "liger_rope", "liger_rms_norm",
               "liger_rms_norm_gated", "liger_layer_norm", "liger_swiglu", "liger_glu_activation",
               "liger_cross_entropy", "liger_fused_linear_cross_entropy", "lora_mlp_kernel", "lora_qkv_kernel",
               "lora_o_kernel", "lora_embedding_kernel"}
# ring-flash-attn's implementations (Axolotl's ring_attn_func) -> cp_comm_type. Any of them computes exact
# attention; what differs is how K/V travel: all-gathered (Llama 3's "varlen_llama3") or passed around a ring.
RING_ATTN = {"varlen_llama3": "all_gather", "batch_ring": "p2p", "batch_zigzag": "p2p", "varlen_ring": "p2p",
             "varlen_zigzag": "p2p"}
ROTATE = {"allgather": "all_gather", "alltoall": "p2p"}  # the ring-master block's rotate_method (torch's names)
FSDP_STAGE = {"full_shard": 3, "hybrid_shard": 3, "shard_grad_op": 2, "_hybrid_shard_zero2": 2, "hybrid_shard_zero2": 2}
FSDP_USED = {"reshard_after_forward", "offload_params", "activation_checkpointing", "state_dict_type",
             "final_state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "version"}


def _comm(out: dict[str, Any], comm: str, why: str, notes: list[str]) -> None:
    set_dotted(out, "parallelism.cp_comm_type", comm)
    notes.append(f"context parallel: {why} -> parallelism.cp_comm_type {comm} "
                 f"({'K/V all-gathered' if comm == 'all_gather' else 'K/V passed around a ring'})")


def map_context_parallel(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Both spellings: flat `context_parallel_size` (+ `ring_attn_func`, `heads_k_stride`) and the block."""
    func = raw.get("ring_attn_func")
    if func is not None:
        if not isinstance(func, str) or func not in RING_ATTN:
            raise bad("ring_attn_func", func, "no nd-adapter counterpart (its stripe layout is not implemented)",
                      f"use one of {', '.join(RING_ATTN)}, or remove it")
        _comm(out, RING_ATTN[func], f"ring_attn_func {func}", notes)
    if raw.get("heads_k_stride") is not None:
        notes.append(f"heads_k_stride {raw['heads_k_stride']} has no effect: nd-adapter moves all K/V heads at once")
    block = raw.get("context_parallel")
    if block is None:
        return
    if not isinstance(block, dict):
        raise bad("context_parallel", block, "must be a mapping (size, backend, rotate_method, load_balance, ...)",
                  "write `context_parallel:` with `size: N` indented below it")
    known = {"size", "backend", "ulysses_size", "ring_size", "rotate_method", "load_balance", "ring_impl"}
    for k in block:
        if not isinstance(k, str) or k not in known:
            raise bad(f"context_parallel.{k}", block[k], "unknown key", f"use {', '.join(sorted(known))}")
    for k in ("size", "ulysses_size", "ring_size"):
        if block.get(k) is not None and (isinstance(block[k], bool) or not isinstance(block[k], int) or block[k] < 1):
            raise bad(f"context_parallel.{k}", block[k], "must be a positive integer", "give e.g. 8")
    size = block["size"] if block.get("size") is not None else 1  # null: unset
    flat = raw.get("context_parallel_size") or raw.get("sequence_parallel_degree")
    if flat is not None and flat != size:
        raise bad("context_parallel.size", size, f"conflicts with context_parallel_size={flat}", "give the size once")
    backend = block.get("backend", "auto")
    balance = block.get("load_balance", "head_tail")
    rotate = block.get("rotate_method", "allgather")
    for k, v in (("backend", backend), ("load_balance", balance), ("rotate_method", rotate)):
        if not isinstance(v, str):
            raise bad(f"context_parallel.{k}", v, "must be a name", "see Axolotl's context_parallel block")
    if backend in ("ulysses", "usp") or (block.get("ulysses_size") or 1) > 1:
        key, value = (("context_parallel.backend", backend) if backend in ("ulysses", "usp") else
                      ("context_parallel.ulysses_size", block["ulysses_size"]))
        raise bad(key, value, "Ulysses (all-to-all over attention heads) has no nd-adapter counterpart; its "
                  "context parallelism splits the sequence and moves K/V",
                  "use backend: ring (or auto), without ulysses_size")
    if backend not in ("auto", "ring"):
        raise bad("context_parallel.backend", backend, "unknown backend", "use auto or ring")
    if block.get("ring_size") not in (None, size):
        raise bad("context_parallel.ring_size", block["ring_size"], f"must equal size={size} (a pure ring)",
                  "remove ring_size")
    if balance not in ("head_tail", "auto"):
        raise bad("context_parallel.load_balance", balance, "nd-adapter always splits each sequence into 2·cp "
                  "chunks and gives rank r chunks r and 2·cp−1−r (head_tail)", "use load_balance: head_tail")
    if rotate not in ROTATE:
        raise bad("context_parallel.rotate_method", rotate, "unknown", "use allgather or alltoall")
    set_dotted(out, "parallelism.cp_size", size)
    if size > 1:
        _comm(out, ROTATE[rotate], f"size {size}, backend {backend}, rotate_method {rotate}", notes)


def map_expert_parallel(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl's expert_parallel_size (its expert_parallel plugin) -> parallelism.ep_size. Axolotl's ep is a mesh
    axis beside dp_shard (ep × dp_shard = world): the dense weights are sharded over dp_shard and replicated over ep,
    and every rank reads its own data. Megatron lays ep over the data-parallel ranks instead, so the data-parallel
    size here is dp_shard × ep: the same arithmetic, the dense weights sharded over all of them."""
    cap = raw.get("expert_parallel_token_capacity")
    if cap is not None:  # Axolotl's cap: the most (token, expert) slots one expert takes in a rank's forward
        tokens = int(raw.get("micro_batch_size") or 1) * int(raw.get("sequence_len") or 2048)
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < tokens:
            raise bad("expert_parallel_token_capacity", cap, f"a per-expert token cap below a micro-batch's {tokens:,} "
                      "tokens may drop routed tokens; nd-adapter's experts are dropless, as transformers'",
                      f"remove it (a cap of {tokens:,} or more drops nothing and is accepted)")
        notes.append(f"expert_parallel_token_capacity: {cap:,}: no expert can receive more than a micro-batch's "
                     f"{tokens:,} tokens, so nothing is dropped: the dropless experts compute the same")
    ep = raw.get("expert_parallel_size")
    if ep is None or ep == 1:
        return
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise bad("expert_parallel_size", ep, "must be a positive integer", "give e.g. 2 (1 disables it)")
    set_dotted(out, "parallelism.ep_size", ep)
    shard = raw.get("dp_shard_size")
    if isinstance(shard, int) and not isinstance(shard, bool):
        set_dotted(out, "parallelism.dp_shard_size", shard * ep)
    notes.append(f"expert_parallel_size: {ep} -> parallelism.ep_size: {ep}, laid over the data-parallel ranks as in "
                 "Megatron-Core" + (f" (dp_shard_size {shard} × ep {ep} = {shard * ep} data-parallel ranks: Axolotl's "
                                    "ep axis reads its own data too)" if isinstance(shard, int) else ""))


def _fsdp_block(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """fsdp_config's keys without Axolotl's optional `fsdp_` prefix, and how the file spells each."""
    block = raw.get("fsdp_config") or {}
    if not isinstance(block, dict):
        raise bad("fsdp_config", block, "must be a mapping", "write `fsdp_config:` with its keys indented below it")
    names = {str(k).removeprefix("fsdp_"): f"fsdp_config.{k}" for k in block}
    return {str(k).removeprefix("fsdp_"): v for k, v in block.items()}, names


def map_fsdp(raw: dict[str, Any], out: dict[str, Any], notes: list[str], ignored: list[str]) -> None:
    """FSDP's sharding onto DeepSpeed ZeRO: reshard_after_forward true (FULL_SHARD) = ZeRO-3, false = ZeRO-2."""
    block, names = _fsdp_block(raw)
    legacy = raw.get("fsdp")
    if not block and not legacy:
        return
    shard = raw.get("dp_shard_size")
    if shard == 1 and not isinstance(shard, bool) and (raw.get("expert_parallel_size") or 1) == 1:
        # Axolotl (utils/distributed._get_parallel_config_kwargs) gives FSDP the GPUs the other sizes leave when
        # dp_shard_size is 1: here an unset dp_shard_size does the same
        (out.get("parallelism") or {}).pop("dp_shard_size", None)
        notes.append("dp_shard_size: 1 beside FSDP: the GPUs the other sizes leave are sharded over, as Axolotl "
                     "does (an unset dp_shard_size)")
    stage, why = 3, "FSDP's default (reshard after forward)"
    if legacy:
        if not isinstance(legacy, (str, list)):
            raise bad("fsdp", legacy, "must be a list of FSDP options", "write e.g. fsdp: [full_shard, auto_wrap]")
        opts = legacy.split() if isinstance(legacy, str) else [str(o) for o in legacy]
        for o in opts:
            if o in FSDP_STAGE:
                stage, why = FSDP_STAGE[o], f"fsdp: {o}"
            elif o not in ("auto_wrap", "offload"):
                raise bad("fsdp", legacy, f"{o!r} has no DeepSpeed counterpart here", "use full_shard or shard_grad_op")
    offload = block.get("offload_params") or (legacy and "offload" in str(legacy))
    if offload and raw.get("adapter"):  # what FSDP would move: adapters and a frozen (often 4-bit) base
        notes.append(f"{names.get('offload_params', 'fsdp: offload')}: not used: an adapter run keeps its frozen "
                     "base and its adapters on the GPU (`plan` says whether they fit)")
    elif offload:  # as an Axolotl DeepSpeed JSON's offload_param (map_deepspeed): where weights live, not the math
        notes.append(f"{names.get('offload_params', 'fsdp: offload')}: not used (memory placement only: the ZeRO "
                     "shards stay on the GPUs; `nd-adapter plan` says whether they fit, and `--search` what does)")
    if block.get("reshard_after_forward") is not None:
        stage = 3 if block["reshard_after_forward"] else 2
        why = f"{names['reshard_after_forward']}: {str(block['reshard_after_forward']).lower()}"
    if block.get("activation_checkpointing"):
        out["recompute"] = "full"
    set_dotted(out, "deepspeed.zero_stage", stage)
    what = ("ZeRO-3: weights, gradients and optimizer states sharded, each transformer layer gathered for its "
            "forward and backward (FSDP FULL_SHARD)" if stage == 3 else
            "ZeRO-2: whole 16-bit weights on every GPU, gradients and optimizer states sharded (FSDP SHARD_GRAD_OP)")
    notes.append(f"FSDP -> DeepSpeed: {why} -> deepspeed.zero_stage {stage} ({what}); checkpoints are DeepSpeed's, "
                 "the final model a full HF export")
    ignored += [names[k] for k in block if k not in FSDP_USED]


def kernel_note(raw: dict[str, Any], ignored: list[str]) -> str | None:
    """One line for every key that picks a peer's kernels; plugins that are neither kernels nor context parallelism
    join the ignored keys."""
    named = [f"{k}: {str(raw[k]).lower() if isinstance(raw[k], bool) else raw[k]}" for k in sorted(KERNEL_KEYS)
             if k in raw and raw[k] not in (None, False)]
    plugins = raw.get("plugins") or []
    for p in plugins if isinstance(plugins, list) else [plugins]:
        kind = axolotl_scope.plugin_kind(p)
        if kind == "kernel":
            named.append(f"plugin {str(p).rsplit('.', 1)[-1]}")
        elif kind == "harmless":
            ignored.append(f"plugins[{p}]")
    if not named:
        return None
    liger = any(k.startswith("liger_") for k in named)
    return ("kernels: nd-adapter's own are used (SDPA attention, fused RoPE, SwiGLU and a fused linear cross-entropy)"
            f", not the ones named by {', '.join(named)}"
            + ("; on the transformers engine Liger's named kernels are applied (model.liger)" if liger else ""))

def _ds_json(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    value = raw["deepspeed"]
    if isinstance(value, dict):
        return value, "the deepspeed block"
    if not isinstance(value, str) or not value:
        raise bad("deepspeed", value, "must be the path of a DeepSpeed JSON (or a mapping)",
                  "give e.g. deepspeed_configs/zero3_bf16.json, or remove the key")
    check_path("deepspeed", value)
    path = Path(value)
    if not path.is_file():
        raise bad("deepspeed", value, "no such file (read relative to the working directory, then the config file's)",
                  "give the path of the DeepSpeed JSON (Axolotl's deepspeed_configs/zero*.json), or remove the key")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad("deepspeed", value, "not valid JSON", "fix the file, or remove the key")
    except OSError as e:
        raise bad("deepspeed", value, f"cannot be read ({e.strerror})", "fix its permissions, or remove the key")
    if not isinstance(doc, dict):
        raise bad("deepspeed", value, "not a JSON object", "give a DeepSpeed config file")
    check_tree(doc, f"deepspeed ({path.name})")  # JSON allows NaN and Infinity
    return doc, path.name


def map_deepspeed(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """Axolotl's `deepspeed:` JSON: its ZeRO stage and precision are honoured; offload (memory placement, same math)
    is not used and said; batch and clipping numbers must agree with the YAML's; the rest is nd-adapter's own."""
    if raw.get("deepspeed") is None:
        return
    if raw.get("fsdp_config") or raw.get("fsdp"):
        raise bad("deepspeed", raw["deepspeed"], "conflicts with the FSDP keys (fsdp / fsdp_config)",
                  "give one of deepspeed or fsdp_config")
    doc, name = _ds_json(raw)
    zero = doc.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise bad("deepspeed", name, "zero_optimization must be a mapping", "fix the DeepSpeed JSON")
    stage = axolotl_values.read(f"deepspeed ({name}) zero_optimization.stage", zero.get("stage", 0),
                                axolotl_values.INT)  # "3" is 3 to DeepSpeed's pydantic config too
    if stage not in (0, 1, 2, 3):
        raise bad("deepspeed", name, f"zero_optimization.stage={stage!r} is not 0-3", "fix the DeepSpeed JSON")
    mapped = 3 if stage == 3 else 2
    set_dotted(out, "deepspeed.zero_stage", mapped)
    set_dotted(out, "deepspeed.stage_from", raw["deepspeed"] if isinstance(raw["deepspeed"], str) else "deepspeed:")
    said = f"deepspeed {name}: zero_optimization.stage {stage} -> deepspeed.zero_stage {mapped}"
    if stage < 2:
        said += " (the same maths; stage 2 also shards the gradients)"
    offload = [k for k in ("offload_optimizer", "offload_param")
               if isinstance(zero.get(k), dict) and zero[k].get("device") not in (None, "none")]
    if offload:
        said += f"; {' and '.join(offload)} not used (memory placement only: `nd-adapter plan` says whether it fits)"
    for section, prec in (("bf16", "bf16"), ("fp16", "fp16")):
        block = doc.get(section)
        if isinstance(block, dict) and axolotl_values.flag(f"deepspeed ({name}) {section}.enabled",
                                                           block.get("enabled")) is True:
            if out.get("precision") not in (prec, None) and (raw.get("bf16") is not None or raw.get("fp16")):
                raise bad("deepspeed", name, f"{section}.enabled true conflicts with the YAML's precision "
                          f"({out['precision']})", f"make them agree (e.g. {section}: true in the YAML)")
            out["precision"] = prec
            said += f"; {section}.enabled -> precision {prec}"
            notes[:] = [f"precision: {prec} ({name}: {section}.enabled true)" if n.startswith("precision:") else n
                        for n in notes]
    said += _master_and_states(doc, name, out)
    for key, yaml_key, default in (("train_micro_batch_size_per_gpu", "micro_batch_size", 1),
                                   ("gradient_accumulation_steps", "gradient_accumulation_steps", 1),
                                   ("gradient_clipping", "max_grad_norm", None)):
        v = doc.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            mine = raw.get(yaml_key, default)
            if mine is not None and v != mine:
                raise bad("deepspeed", name, f"{key}={v} disagrees with {yaml_key}={mine}",
                          f'set "{key}": "auto" in the JSON, or make them agree')
    notes.append(said + "; its other settings are nd-adapter's own (`nd-adapter plan --format json` shows the JSON)")


def _master_and_states(doc: dict[str, Any], name: str, out: dict[str, Any]) -> str:
    """DeepSpeed's bf16.bf16_master_weights_and_grads + bf16_optimizer_states (no fp32 master, bf16 moments) change
    what is trained: both -> optimizer.state_dtype bf16; one alone, or fp16 masters, is refused."""
    bf16, fp16 = doc.get("bf16") or {}, doc.get("fp16") or {}
    def on(section: dict[str, Any], key: str) -> bool:
        return axolotl_values.flag(f"deepspeed ({name}) {key}", section.get(key)) is True

    if isinstance(fp16, dict) and on(fp16, "fp16_master_weights_and_grads"):
        raise bad("deepspeed", name, "fp16.fp16_master_weights_and_grads (fp16 master weights) is not built",
                  "remove it (fp32 master weights), or train in bf16 with bf16 master weights and states")
    if not isinstance(bf16, dict):
        return ""
    master, states = (on(bf16, k) for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"))
    if master and states:
        set_dotted(out, "optimizer.state_dtype", "bf16")
        return "; bf16.bf16_master_weights_and_grads + bf16_optimizer_states -> optimizer.state_dtype bf16"
    if master:
        raise bad("deepspeed", name, "bf16.bf16_master_weights_and_grads without bf16_optimizer_states (bf16 masters "
                  "with fp32 moments) is not built", "set bf16_optimizer_states: true too (optimizer.state_dtype: "
                  "bf16), or remove it")
    if states:
        raise bad("deepspeed", name, "bf16.bf16_optimizer_states needs bf16_master_weights_and_grads (DeepSpeed "
                  "refuses it alone too)", "set both (optimizer.state_dtype: bf16), or neither")
    return ""

