"""Mixture-of-experts pieces Megatron-Core's MoE layer needs to compute what transformers computes.

Routing: transformers takes a softmax over every expert in fp32, picks the top k and (with `norm_topk_prob`)
renormalises them; Megatron's TopKRouter does the same with `moe_router_pre_softmax` off (softmax over the top-k
logits is that renormalisation) and, on, without renormalising (OLMoE). Its router's `gating` moves a CPU weight to
a GPU and its aux losses are per layer, so `HFRouter` keeps its routing and replaces those two.

The load-balancing loss is transformers' `load_balancing_loss_func`: ONE statistic over every layer of a forward,

    aux = E · Σ_e (C_e / R) · (P_e / R),   C_e = Σ_layers (top-k picks of e),  P_e = Σ_layers Σ_rows softmax_e,

R the routed rows of all layers. Its gradient reaches layer l's router only through P (C is a count), as
coef · E · C_e / R² per row and expert: known when the last layer has routed, which is before any backward. So each
router records its C and P (`AuxLoss`), and an identity on its output (`_InjectAuxGrad`) adds that gradient in
backward, reading the totals then; a recomputed layer (activation recompute) records the same numbers again under its
layer number, so recompute changes nothing.

Counts and sums are over the tokens of one micro-batch: when sequence parallelism or context parallelism split them,
they are all-reduced over those ranks (`reduce_groups`), so every rank computes the whole micro-batch's statistic.

The experts: Megatron's SequentialMLP runs two small GEMMs per expert in a Python loop (128 experts: ~256 launches
a layer), and its grouped alternatives need TransformerEngine or the grouped_gemm package. `GroupedExperts` keeps
SequentialMLP's parameters (so its checkpoints, conversion tables and resharding are unchanged) and runs each of the
two linears as ONE `torch._grouped_mm` over every local expert, forward and backward, without a host sync.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

try:  # Triton comes with torch's CUDA wheels, not its CPU ones; without it the torch code below runs
    from adapter.kernels import moe_triton
except ImportError:
    moe_triton = None


class AuxLoss:
    """One forward's routing statistics (per layer) and what backward needs from them."""

    def __init__(self, num_experts: int, top_k: int, coef: float):
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.groups: list = []       # process groups that split one micro-batch's tokens (SP's TP, CP)
        self.scale = 1.0             # what the training loss multiplies coef · aux by (set by the caller)
        self.enabled = coef > 0
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def reset(self) -> None:
        self.layers.clear()

    def record(self, layer: int, counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> None:
        self.layers[layer] = (counts, probs, rows)

    def totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C, P, R) summed over the layers recorded (already reduced over the token-splitting groups)."""
        c, p, r = zip(*self.layers.values())
        return torch.stack(c).sum(0), torch.stack(p).sum(0), torch.stack(r).sum()

    def value(self) -> torch.Tensor:
        """transformers' load-balancing loss of the last forward (no coefficient), detached."""
        c, p, r = self.totals()
        return self.num_experts * (c * p).sum() / (r * r)

    def attached(self) -> float:
        """What the loop adds to the micro-batch's loss: nothing, the routers inject this loss's gradient in backward
        (`_InjectAuxGrad`; the transformers engine's adds its term: adapter/modeling/hf_build.LoadBalancing)."""
        return 0.0

    def row_grad(self) -> torch.Tensor:
        """d(scale · coef · aux) / d(softmax_e of one row), one value per expert."""
        c, _, r = self.totals()
        return self.scale * self.coef * self.num_experts * c / (r * r)


def _sum(t: torch.Tensor, groups) -> torch.Tensor:
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(t, group=g)
    return t


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on the router's output probs; backward also sends the load-balancing gradient to the softmax."""

    @staticmethod
    def forward(ctx, probs, scores, aux):
        ctx.aux = aux
        ctx.shape = scores.shape
        return probs.view_as(probs)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.aux.row_grad().to(grad.device, torch.float32)
        return grad, g.expand(ctx.shape), None


class HFRouter(TopKRouter):
    """Megatron's top-k router with transformers' gating (the hidden states' dtype, on whatever device) and its
    load-balancing loss (module docstring) in place of Megatron's per-layer ones (configured off)."""

    aux: AuxLoss | None = None  # set by build_gpt_model, shared by every layer's router

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight.to(input.dtype))

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().routing(logits, padding_mask)
        aux = self.aux
        if aux is None or not aux.enabled:
            return probs, routing_map
        flat = logits.reshape(-1, self.config.num_moe_experts)
        scores = torch.softmax(flat, dim=-1, dtype=torch.float32) if flat.dtype != torch.float32 else \
            torch.softmax(flat, dim=-1)
        # transformers' statistic picks the top k of its own softmax (the same set as the routing's)
        # padding rows (padding_mask False) count nowhere, as transformers' attention-masked statistic
        keep = (torch.ones_like(scores[:, :1]) if padding_mask is None
                else padding_mask.reshape(-1, 1).to(scores.dtype))
        with torch.no_grad():
            picks = torch.zeros_like(scores).scatter_(1, scores.topk(aux.top_k, dim=-1).indices, 1.0)
            stats = _sum(torch.cat([(picks * keep).sum(0), (scores * keep).sum(0), keep.sum().reshape(1)]),
                         aux.groups)
        e = self.config.num_moe_experts
        aux.record(self.layer_number, stats[:e], stats[e:2 * e], stats[2 * e])
        if torch.is_grad_enabled() and self.training:
            probs = _InjectAuxGrad.apply(probs, scores * keep, aux)
        return probs, routing_map


class WholeRMSNorm(torch.nn.Module):
    """RMSNorm over a whole q or k projection (every head at once), as OLMoE's q_norm / k_norm; Megatron's q/k norm
    is per head. Under tensor parallelism a rank holds its heads' slice of the weight, and the mean square is summed
    over the TP ranks (autograd-aware both ways)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, heads: int = 1, **_):
        from megatron.core import parallel_state

        super().__init__()
        tp = config.tensor_model_parallel_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.width = hidden_size * heads  # the whole projection's width (hidden_size: one head's, as Megatron passes)
        self.weight = torch.nn.Parameter(torch.ones(self.width // tp, device=device, dtype=config.params_dtype))
        # a slice per TP rank, like a linear's: the gradient norm (DeepSpeed's, for clipping) counts every rank's
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(self.weight, is_parallel=tp > 1, dim=0, stride=1)
        self.eps, self.tp = eps, tp
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The weight split over TP like the heads it scales (a rank's slice is its own: no TP gradient sum)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, heads_local, d]
        shape = x.shape
        h = x.reshape(*shape[:-2], -1).float()
        ss = h.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            import torch.distributed.nn.functional as dnn

            ss = dnn.all_reduce(ss, group=self.tp_group)
        y = h * torch.rsqrt(ss / self.width + self.eps)
        return (self.weight * y.to(x.dtype)).reshape(shape)


def as_batch(weights) -> torch.Tensor:
    """The experts' weights as one [experts, out, in] tensor: a strided view when they lie equally spaced in one
    storage (GroupedExperts allocates them so; ZeRO-1/2's flat buffer interleaves fc1 and fc2 at a fixed step, which
    qualifies too), else a stacked copy."""
    w0 = weights[0]
    if len(weights) > 1 and all(w.is_contiguous() and w.shape == w0.shape and w.dtype == w0.dtype for w in weights):
        size, ptr = w0.element_size(), w0.untyped_storage().data_ptr()
        step = weights[1].data_ptr() - w0.data_ptr()
        if step > 0 and step % 16 == 0 and all(w.untyped_storage().data_ptr() == ptr and
                                               w.data_ptr() - w0.data_ptr() == i * step for i, w in enumerate(weights)):
            return w0.as_strided((len(weights), *w0.shape), (step // size, *w0.stride()))
    return torch.stack(weights)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] · W_e^T for every local expert in one grouped GEMM (`offs`: the cumulative
    row counts, on the device). `w` is the experts' weights as one [experts, out, in] batch (`as_batch`: a view where
    they share a buffer). Each expert's weight gradient goes either to autograd (`weights`: the experts' parameters,
    so per-parameter hooks such as ZeRO's see them) or, under `deposit` (the parameters, `weights` empty), straight
    into their `.grad` as rows of one tensor: 128 experts make 128 autograd edges, saved tensors and gradient
    accumulations per linear, which on one H200 cost more host time than the GEMMs take on the GPU."""

    @staticmethod
    def forward(ctx, x, offs, w, deposit, *weights):
        ctx.deposit = deposit
        ctx.save_for_backward(x, offs, w, *weights)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, offs, w, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, w, offs=offs) if ctx.needs_input_grad[0] else None
        if not (any(ctx.needs_input_grad[4:]) or ctx.deposit):  # frozen experts (a LoRA run): no weight gradients
            return (dx, None, None, None, *(None for _ in weights))
        dw = torch._grouped_mm(dy.t(), x, offs=offs)  # [experts, out, in]: the rows of each expert summed
        if ctx.deposit:
            _accumulate(ctx.deposit, dw)
            return dx, None, None, None
        return (dx, None, None, None, *dw.unbind(0))


def _accumulate(params: list, dw: torch.Tensor) -> None:
    """params[e].grad += dw[e], as autograd would; the first time after `zero_grad` each becomes a row of `dw`, so
    later micro-batches add into all of them at once."""
    grads = [p.grad for p in params]
    base = getattr(grads[0], "_base", None)
    if all(g is None for g in grads):
        for p, g in zip(params, dw.unbind(0)):
            p.grad = g
    elif base is not None and base.shape == dw.shape and all(g is not None and g._base is base for g in grads):
        base.add_(dw)
    else:
        for p, g in zip(params, dw.unbind(0)):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts and checkpoint layout, each linear run as one grouped GEMM (module docstring). Where
    the grouped GEMM does not apply (a single local expert, biases, fp8, ZeRO-3's partitioned weights, a GPU before
    Hopper or another dtype than bf16 there), Megatron's loop runs: the same arithmetic, expert by expert."""

    grouped = True  # model.moe_grouped_gemm
    deposit = False  # weight gradients straight into `.grad` (`_GroupedLinear`): set where nothing hooks them

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache: dict = {}
        self._one_buffer()

    def _weights(self, name: str) -> tuple[list, torch.Tensor]:
        """One linear's expert weights and their [experts, out, in] batch. A batch that is a view of their buffer is
        kept until a weight moves (checking every expert's address is cheap; `as_batch`'s checks and 128 module
        lookups per call were not)."""
        hit = self._cache.get(name)
        if hit is not None:
            ws, ptrs, batch = hit
            if ws[0] is getattr(self.local_experts[0], name).weight and [w.data_ptr() for w in ws] == ptrs:
                return ws, batch
        ws = [getattr(e, name).weight for e in self.local_experts]
        batch = as_batch([w.detach() for w in ws])
        if batch.data_ptr() == ws[0].data_ptr():  # a view: it follows the weights' updates (a stacked copy would not)
            self._cache[name] = (ws, [w.data_ptr() for w in ws], batch)
        return ws, batch

    def _one_buffer(self) -> None:
        """Each linear's experts in one buffer, so the grouped GEMM reads them in place (`as_batch`). Left alone
        where they already are (or lie in ZeRO-1/2's flat buffer at a fixed step) and under ZeRO-3's partitions."""
        with torch.no_grad():
            for name in ("linear_fc1", "linear_fc2"):
                ws = [getattr(e, name).weight for e in self.local_experts]
                if len(ws) < 2 or any(hasattr(w, "ds_id") for w in ws) or \
                        as_batch(ws).data_ptr() == ws[0].data_ptr():
                    continue
                buf = torch.stack([w.data for w in ws])
                for w, row in zip(ws, buf):
                    w.data = row

    def _apply(self, fn, recurse=True):
        """`.to(device)`, `.cuda()`, `.half()` give every weight a tensor of its own: one buffer again after them (the
        engine moves the model before any optimizer holds its weights)."""
        out = super()._apply(fn, recurse)
        self._one_buffer()
        return out

    def _can_group(self, x: torch.Tensor) -> bool:
        c, w = self.config, self.local_experts[0].linear_fc1.weight
        fused_ok = not c.bias_activation_fusion or (c.activation_func is F.silu and c.gated_linear_unit)
        device_ok = not x.is_cuda or (x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)
                                      >= (9, 0))
        return (self.grouped and self.num_local_experts > 1 and hasattr(torch, "_grouped_mm") and device_ok
                and fused_ok and not c.add_bias_linear and not (c.fp8 or c.fp4) and not c.moe_apply_probs_on_input
                and not c.use_te_activation_func and c.activation_func_clamp_value is None
                and not hasattr(w, "ds_id"))  # ZeRO-3 gathers a module's weights when that module runs

    def _activate(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP.forward's activation with its per-token scale (the routing weight), the same code path."""
        c, scale = self.config, probs.unsqueeze(-1)
        if c.bias_activation_fusion and h.is_cuda and moe_triton is not None and not \
                c.activation_func_fp8_input_store:  # the same arithmetic in one pass a row (adapter/kernels)
            return moe_triton.weighted_swiglu(h, scale)
        if c.bias_activation_fusion:
            return weighted_bias_swiglu_impl(h, None, scale, c.activation_func_fp8_input_store)
        if c.gated_linear_unit:
            gate, lin = torch.chunk(h, 2, dim=-1)
            out = c.activation_func(gate) * (lin + c.glu_linear_offset)
        else:
            out = c.activation_func(h)
        return (out * scale).to(out.dtype)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if not self._can_group(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        offs = tokens_per_expert.to(device=x.device, dtype=torch.int32, non_blocking=True).cumsum(0, dtype=torch.int32)
        h = self._linear(x, offs, "linear_fc1")
        h = self._activate(h, permuted_probs)
        return self._linear(h, offs, "linear_fc2"), None

    def _linear(self, x: torch.Tensor, offs: torch.Tensor, name: str) -> torch.Tensor:
        ws, batch = self._weights(name)
        trained = [w.requires_grad for w in ws]
        if not any(trained) or not torch.is_grad_enabled():
            return _GroupedLinear.apply(x, offs, batch, None)
        if self.deposit and all(trained):
            return _GroupedLinear.apply(x, offs, batch, ws)
        return _GroupedLinear.apply(x, offs, batch, None, *ws)  # some experts frozen: autograd sorts them out


class LocalTokenDispatcher(MoETokenDispatcher):
    """The token dispatcher where every expert is local (ep x expert-tp = 1): only a permutation, static in shape.

    Megatron's dispatchers serve this case too, but size their permutation from the data: `masked_select` on the
    routing map (a host sync each), the per-expert counts copied to the host (another), a split + cat to sort
    chunks that are already in order. Each sync empties the GPU's queue; on one H200 the Qwen3-30B-A3B layer's
    step was host-bound (docs/BENCHMARKS.md). Dropless top-k routing picks exactly k experts per token, so the
    permuted rows number tokens x k whatever the data: prefix sums over the routing map lay the picks out in
    Megatron's order (expert-major, tokens ascending; `_routing_index`), and the counts stay on the device for the
    grouped GEMM's offsets (`GroupedExperts`). Tokens come back to their rows by gathers and sums, forward and
    backward, where Megatron scatter-adds with atomics."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.ep_size * self.tp_size != 1 or config.moe_expert_capacity_factor is not None or \
                config.moe_router_padding_for_quantization or config.moe_shared_expert_intermediate_size:
            raise ValueError("LocalTokenDispatcher: dropless routing with every expert on this rank only")
        self.num_local_experts, self.local_expert_indices = num_local_experts, local_expert_indices
        self.top_k = config.moe_router_topk

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        fn = _routing_index_compiled if routing_map.is_cuda else _routing_index
        order, rows, inv, self.tokens_per_expert = fn(routing_map, self.top_k)
        self.index = (rows, inv)
        x = hidden_states.view(-1, self.hidden_shape[-1])
        return _Permute.apply(x, *self.index), probs.T.reshape(-1).index_select(0, order)

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        out = _Unpermute.apply(hidden_states, *self.index)
        self.index = self.tokens_per_expert = None
        return out.view(self.hidden_shape)


def _routing_index(routing_map: torch.Tensor, top_k: int):
    """The permutation of a dropless top-k routing (exactly k picks per token), in Megatron's order (expert-major,
    tokens ascending): for each permuted row its [experts x tokens] index (`order`) and its token (`rows`); for
    each token its k rows in expert order (`inv`, the inverse the gathers use); the rows per expert.

    From prefix sums, not sorts: pick (t, e) goes to row start[e] + (picks of e by tokens before t) and is pick
    number (picks of t among experts before e) of its token. Two stable argsorts did the same in ~20 kernels a
    layer (radix passes); compiled on CUDA this is a few (docs/BENCHMARKS.md, 2026-12-03 21:40)."""
    tokens, experts = routing_map.shape
    n = tokens * top_k
    rm = routing_map.to(torch.int32)
    counts = rm.sum(0)
    row = (counts.cumsum(0) - counts) + (rm.cumsum(0) - rm)  # [tokens, experts]: the permuted row of each pick
    rank = rm.cumsum(1) - rm                                   # its place among its token's picks
    t = torch.arange(tokens, device=rm.device).unsqueeze(1)
    e = torch.arange(experts, device=rm.device).unsqueeze(0)
    # scatters with one extra slot at the end, where every (t, e) that is not a pick lands and is dropped
    inv = torch.zeros(n + 1, dtype=torch.int64, device=rm.device).scatter_(
        0, torch.where(routing_map, t * top_k + rank, n).reshape(-1), row.reshape(-1))[:n].view(tokens, top_k)
    order = torch.zeros(n + 1, dtype=torch.int64, device=rm.device).scatter_(
        0, torch.where(routing_map, row, n).reshape(-1), (e * tokens + t).reshape(-1))[:n]
    return order, order % tokens, inv, counts


_routing_index_compiled = torch.compile(_routing_index)  # shapes follow the micro-batch: dynamic after one change


def _gather_sum(y: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j y[inv[t, j]]: each token's k rows, summed (no atomics, unlike a scatter-add into the tokens);
    on CUDA one Triton kernel (adapter/kernels/moe_triton.py: no gathered copy of the rows)."""
    if y.is_cuda and moe_triton is not None:
        return moe_triton.gather_sum(y, inv)
    tokens, k = inv.shape
    return y.index_select(0, inv.reshape(-1)).view(tokens, k, -1).sum(1)


class _Permute(torch.autograd.Function):
    """x[rows]; its gradient gathers each token's k rows back and sums them (`_gather_sum`), where autograd's
    `index_select` backward would scatter-add with atomics (4.3 ms of a ~118 ms step on one H200)."""

    @staticmethod
    def forward(ctx, x, rows, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, dy):
        (inv,) = ctx.saved_tensors
        return _gather_sum(dy, inv), None, None


class _Unpermute(torch.autograd.Function):
    """The expert outputs summed back into their tokens (`_gather_sum`); its gradient is a gather by `rows`."""

    @staticmethod
    def forward(ctx, y, rows, inv):
        ctx.save_for_backward(rows)
        return _gather_sum(y, inv)

    @staticmethod
    def backward(ctx, dout):
        (rows,) = ctx.saved_tensors
        return dout.index_select(0, rows), None, None


def deposit_expert_grads(model: torch.nn.Module) -> int:
    """Grouped experts write their weight gradients straight into `.grad` (`_GroupedLinear`): for optimizers that
    read `.grad` after backward and hook nothing per parameter (nd-adapter's flat AdamW). Returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.deposit, n = True, n + 1
    return n


def use_local_dispatch(model: torch.nn.Module) -> int:
    """Every MoE layer whose experts are all on this rank dispatches with `LocalTokenDispatcher`. Returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    n = 0
    for m in model.modules():
        if isinstance(m, MoELayer) and m.token_dispatcher.ep_size * m.token_dispatcher.tp_size == 1:
            m.token_dispatcher = LocalTokenDispatcher(m.num_local_experts, m.local_expert_indices, m.config,
                                                      model.pg_collection)
            n += 1
    return n


__all__ = ["AuxLoss", "HFRouter", "WholeRMSNorm", "GroupedExperts", "LocalTokenDispatcher", "use_local_dispatch",
           "deposit_expert_grads", "as_batch"]
