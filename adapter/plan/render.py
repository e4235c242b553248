"""Terminal rendering of a `Plan` with rich tables (the JSON view is `Plan.model_dump_json`)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adapter.plan.build import Plan
from adapter.plan.memory import GIB

if TYPE_CHECKING:
    from adapter.plan.search import Search, SearchRow

MAX_RANK_ROWS = 64
MAX_GROUPS_SHOWN = 8
MAX_MEMBERS_SHOWN = 16  # ranks of one group (a data-parallel group of a large world holds thousands)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _members(group: list[int]) -> str:
    if len(group) <= MAX_MEMBERS_SHOWN:
        return str(group)
    return f"[{', '.join(map(str, group[:4]))}, …, {group[-1]}: {len(group)} ranks]"


def render(plan: Plan, console: Console | None = None) -> None:
    c = console or Console(width=140)
    m = plan.mesh
    a = plan.model
    c.print(f"[bold]Model[/] {a['architecture']} ({a['family']}): {plan.num_params / 1e9:.2f}B params, "
            f"hidden {a['hidden_size']}, layers {a['num_layers']}, heads {a['num_heads']}/{a['num_kv_heads']} kv, "
            + (f"{a['num_experts']} experts of ffn {a['expert_ffn_hidden_size']}, top {a['experts_per_token']}, "
               if a.get("num_experts") else f"ffn {a['ffn_hidden_size']}, ")
            + f"vocab {a['vocab_size']}, tied={a['tie_embeddings']}")
    for note in plan.notes:
        c.print(note, style="cyan", markup=False, highlight=False)
    c.print("[bold]Weights[/] " + escape(plan.weights.description.removeprefix("weights: ")), highlight=False)
    c.print(f"[bold]Mesh[/] dp_replicate={m.dp_replicate} × dp_shard={m.dp_shard} × cp={m.cp} × tp={m.tp} "
            f"= {m.world} GPUs on {m.nodes} node(s) × {m.gpus_per_node}; order {' > '.join(m.order)} (tp fastest)")
    b = plan.batch
    c.print(f"[bold]Batch[/] micro {b.micro_batch_size} × grad-accum {b.gradient_accumulation_steps} × dp "
            f"{b.data_parallel_size} = global {b.global_batch_size} sequences × seq {plan.seq_len} = "
            f"{b.tokens_per_step:,} tokens/step; {plan.precision}, sequence parallel {plan.sequence_parallel}, "
            f"attention {plan.attention}" + (", compiled layers (torch.compile)" if plan.compiled_layers else ""))
    ac = plan.attention_cost
    c.print(f"[bold]Attention[/] {ac.kernel}; {ac.flops_per_gpu_step / 1e12:.2f} TFLOP per GPU per step (fwd + bwd) "
            f"at {ac.doc_len:,} tokens per document ({ac.doc_len_source})"
            + ("; no s×s mask" if ac.packed_documents else ""), markup=True)

    t = Table(title="Ranks", show_lines=False)
    for col in ("rank", "node", "local_rank", "dp_replicate", "dp_shard", "cp", "tp"):
        t.add_column(col, justify="right")
    for r in plan.ranks[:MAX_RANK_ROWS]:
        cols = ("rank", "node", "local_rank", "dp_replicate", "dp_shard", "cp", "tp")
        t.add_row(*(str(getattr(r, col)) for col in cols))
    if len(plan.ranks) > MAX_RANK_ROWS:
        t.caption = f"first {MAX_RANK_ROWS} of {len(plan.ranks)} ranks (--format json has all)"
    c.print(t)

    g = Table(title="Process groups")
    for col in ("group", "axes", "size", "count", "crosses nodes", "members"):
        g.add_column(col)
    for info in plan.groups:
        shown = " ".join(_members(x) for x in info.groups[:MAX_GROUPS_SHOWN])
        if info.count > MAX_GROUPS_SHOWN:
            shown += f" … (+{info.count - MAX_GROUPS_SHOWN})"
        g.add_row(info.name, "×".join(info.axes), str(info.size), str(info.count),
                  "[red]yes[/]" if info.crosses_nodes else "no", shown)
    c.print(g)

    c.print("[bold]Megatron-Core[/]")
    c.print(plan.megatron.call, soft_wrap=True, markup=False)
    d = plan.deepspeed
    stage = d.config["zero_optimization"]["stage"]
    c.print(f"[bold]DeepSpeed[/] ZeRO-{stage} partition group {d.partition_group} (size {d.partition_size}); "
            f"replicate mode: {d.replicate_mode}. {d.explanation}")
    c.print(json.dumps(d.config, indent=2), soft_wrap=True, markup=False)

    mem = plan.memory
    mt = Table(title=f"Memory per GPU ({mem.gpu}, recompute={mem.recompute})")
    mt.add_column("item")
    mt.add_column("size", justify="right")
    for key in ("weights", "gradients", "optimizer", "gathered_params", "comm_buffers", "activations",
                "activations_no_recompute", "activations_full_recompute", "logits"):
        mt.add_row(key.replace("_", " "), _gib(getattr(mem, key)))
    mt.add_row("[bold]predicted peak[/]", f"[bold]{_gib(mem.peak)}[/] ({mem.peak_phase.replace('_', ' ')})")
    mt.add_row("runtime reserve", _gib(mem.runtime_reserve) + " (CUDA context, NCCL, cuBLAS)")
    mt.add_row("capacity", _gib(mem.capacity))
    mt.add_row("fits", "[green]yes[/]" if mem.fits else "[red]NO[/]")
    c.print(mt)

    tt = Table(title="Communication per GPU per optimizer step")
    for col in ("group", "size", "volume", "link", "what"):
        tt.add_column(col)
    for row in plan.traffic:
        tt.add_row(row.group, str(row.size), _bytes(row.bytes_per_step), "inter-node" if row.crosses_nodes else
                   "intra-node", row.what)
    tot = plan.traffic_totals
    tt.caption = f"intra-node {_bytes(tot['intra_node'])}, inter-node {_bytes(tot['inter_node'])}"
    c.print(tt)

    pr = plan.predicted
    if pr is not None:
        c.print(f"[bold]Predicted[/] {pr.step_time_s * 1e3:.1f} ms/step, {pr.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                f"MFU {100 * pr.mfu:.1f}% (profile {pr.profile}): {_split(pr.breakdown, pr.step_time_s)}. "
                f"Bottleneck: {pr.bottleneck}", markup=True)

    if len(plan.replicate_modes) > 1:
        rt = Table(title="dp_replicate on DeepSpeed: the two mappings")
        for col in ("mode", "peak memory", "model states", "intra-node/step", "inter-node/step"):
            rt.add_column(col)
        for mode, mc in plan.replicate_modes.items():
            mark = " (chosen)" if mode == d.replicate_mode else ""
            rt.add_row(mode + mark, _gib(mc.peak_memory), _gib(mc.model_states), _bytes(mc.intra_node_bytes),
                       _bytes(mc.inter_node_bytes))
        c.print(rt)

    c.print("[bold]Launch[/]")
    c.print(plan.launch.deepspeed, soft_wrap=True, markup=False)
    c.print(plan.launch.torchrun, soft_wrap=True, markup=False)
    for w in plan.warnings:
        c.print(f"[cyan]{w}[/]" if w.startswith("hint:") else f"[yellow]warning:[/] {w}", markup=True)


def _split(breakdown: dict[str, float], step: float) -> str:
    return ", ".join(f"{k.replace('_comm', '')} {1e3 * v:.1f} ms ({100 * v / step:.0f}%)"
                     for k, v in breakdown.items() if v > 0.0005 * step)


PARTS = ("compute", "tp_comm", "dp_comm", "cp_comm", "ep_comm", "optimizer", "host")


def render_search(found: Search, top: int = 10, console: Console | None = None) -> None:
    """The top rows that fit, then the fastest that do not (so a faster layout that needs more memory is seen)."""
    c = console or Console(width=200)
    c.print(f"[bold]Layout search[/] {found.model} on {found.world} GPUs ({found.nodes} node(s) × "
            f"{found.gpus_per_node}, {found.gpu}, profile {found.profile}): global batch {found.global_batch_size} × "
            f"seq {found.seq_len} = {found.tokens_per_step:,} tokens/step. {found.ranked} valid layouts of "
            f"{found.candidates} ({found.fitting} fit in memory)"
            + (f"; pinned {', '.join(f'{k}={v}' for k, v in found.pinned.items())}" if found.pinned else ""))
    fit: list[SearchRow] = []
    seen: set[tuple[object, ...]] = set()
    for r in found.rows:   # a row that differs from a shown one only in compiled layers, at the same speed: once
        key = (r.dp_replicate, r.dp_shard, r.cp, r.tp, r.zero_stage, r.replicate_mode, r.recompute,
               r.micro_batch_size, r.sequence_parallel, round(r.tokens_per_s_per_gpu))
        if r.fits and key not in seen and len(fit) < top:
            fit.append(r)
            seen.add(key)
    best = fit[0].tokens_per_s_per_gpu if fit else 0.0
    over = [r for r in found.rows if not r.fits and r.tokens_per_s_per_gpu > best][:3]
    t = Table(title="Ranked by predicted tokens/s/GPU")
    for col in ("#", "dp_rep×dp_shard×cp×tp", "ZeRO", "recompute", "micro×accum", "SP", "compiled", "tokens/s/GPU",
                "step", "compute / tp / dp / cp / ep / optim / host", "peak", "fits", "bottleneck"):
        t.add_column(col, overflow="fold")
    for r in fit + over:
        b = r.breakdown
        zero = f"{r.zero_stage}" + (f" {r.replicate_mode}" if r.replicate_mode else "")
        mesh = f"{r.dp_replicate}×{r.dp_shard}×{r.cp}×{r.tp}" + (f" ep{r.ep}" if r.ep > 1 else "")
        t.add_row(str(r.rank), mesh, zero, r.recompute,
                  f"{r.micro_batch_size}×{r.gradient_accumulation_steps}", "yes" if r.sequence_parallel else "no",
                  "yes" if r.compiled_layers else "no", f"{r.tokens_per_s_per_gpu:,.0f}",
                  f"{1e3 * r.step_time_s:.0f} ms", " / ".join(f"{100 * b[k] / r.step_time_s:.0f}" for k in PARTS) + "%",
                  _gib(r.peak_memory), "[green]yes[/]" if r.fits else "[red]NO[/]", r.bottleneck)
    if over:
        t.caption = f"last {len(over)} rows: faster, but do not fit in {_gib(found.capacity)}"
    c.print(t)
    if found.config_rank is not None:
        own = found.rows[found.config_rank - 1]
        c.print(f"The config's own layout ranks {own.rank}: {own.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                f"{_gib(own.peak_memory)}{'' if own.fits else ' (does not fit)'}; {own.bottleneck}")
    if fit:
        sets = " ".join(f"--set {x}" for x in fit[0].sets)
        c.print(f"Best: nd-adapter plan {found.config_path or 'CONFIG'} {sets}", soft_wrap=True,
                markup=False)
    else:
        c.print("[red]no valid layout fits in memory[/]: see the rows above, or add GPUs")
    if found.skipped:
        c.print("[bold]Not ranked[/] (combinations the project's checks refuse; --format json lists all):")
        for reason, n in list(found.skipped.items())[:6]:
            c.print(f"  {n} × {reason}", markup=False)
    for w in found.warnings:
        c.print(f"[yellow]note:[/] {w}")
