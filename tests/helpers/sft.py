"""Masked training data with PackedDataset's item API, and the plain-transformers reference the training path is
checked against: Σ per-token loss / Σ trained tokens of each optimizer step, torch AdamW, fp32 on CPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np


class MaskedData:
    """One document per sample; sample i trains on `trained[i]` label positions (a contiguous "answer" span whose
    place also varies), so micro-batches' trained-token counts differ a lot."""

    def __init__(self, trained: list[int], seq_len: int, vocab: int, seed: int = 0):
        self.trained, self.seq_len, self.vocab, self.seed = list(trained), seq_len, vocab, seed

    def __len__(self) -> int:
        return len(self.trained)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, i])
        window = rng.integers(0, self.vocab, self.seq_len + 1)
        k = self.trained[i]
        start = int(rng.integers(0, self.seq_len - k + 1))
        mask = np.zeros(self.seq_len, np.float32)
        mask[start:start + k] = 1.0
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": mask,
                "position_ids": np.arange(self.seq_len), "segment_ids": np.zeros(self.seq_len, np.int64)}


def batch_of(data, indices) -> dict:
    import torch

    items = [data[i] for i in indices]
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}


def hf_loss(model, batch, eaft: tuple[int, float] | None = None):
    """Σ per-token cross-entropy over trained tokens / their number (at least 1): the step's loss. `eaft` (k, alpha):
    each trained token's loss weighted as Axolotl's EAFT loss weighs it (monkeypatch/loss/eaft.py: the entropy of
    the softmax over the token's k largest logits, to the power alpha, without gradient; the sum over the trained
    tokens divided by their number, HF's num_items_in_batch)."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    flat = logits.flatten(0, 1)
    ce = F.cross_entropy(flat, batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    if eaft is not None:
        k, alpha = eaft
        with torch.no_grad():
            p = F.softmax(torch.topk(flat, k=min(k, flat.size(-1)), dim=-1).values, dim=-1)
            weights = (-(p * torch.log(p + 1e-10)).sum(dim=-1)) ** alpha
        ce = ce * weights
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def packed_examples(model, samples, i: int, device=None, **forward):
    """The examples packed into sample `i` of `samples` (prepared SFT data: `examples(i)` bounds them), each through
    the HF `model` on its own (attention stays inside an example either way). Yields, per example, the Σ of its
    trained tokens' cross-entropy, how many they are, and the model's output; `forward`: the model's other keywords."""
    import torch
    import torch.nn.functional as F

    s, bounds = samples[i], samples.examples(i)
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = model(input_ids=torch.as_tensor(s["tokens"][a:b], device=device)[None], **forward)
        ce = F.cross_entropy(out.logits[0].float(), torch.as_tensor(s["labels"][a:b], device=device), reduction="none")
        mask = torch.as_tensor(s["loss_mask"][a:b], device=device)
        yield (ce * mask).sum(), float(mask.sum()), out


def axolotl_freeze(model, patterns: list[str]) -> None:
    """Axolotl's `unfrozen_parameters` on an HF model, as its utils/freeze.py does it: `re.match` on each parameter
    name with literal dots, the rest frozen; a trailing [start:end] zeroes the other rows' gradient."""
    import re

    import torch

    for name, p in model.named_parameters():
        p.requires_grad_(False)
        for pattern in patterns:
            m = re.match(r"^(.+)\[([0-9]*):([0-9]*)\]$", pattern)
            base, rows = (m.group(1), (int(m.group(2) or 0), int(m.group(3)) if m.group(3) else None)) if m \
                else (pattern, None)
            if re.match(re.sub(r"\.(?!\+)", "\\.", base), name):
                p.requires_grad_(True)
                if rows is not None:
                    keep = torch.zeros(p.shape[0], 1)
                    keep[rows[0]:rows[1]] = 1.0
                    p.register_hook(lambda g, keep=keep: g * keep)


def hf_reference(hf_dir: str | Path, data, steps: list[list[int]], *, lr: float, betas=(0.9, 0.95), eps=1e-8,
                 val=None, unfrozen: list[str] | None = None, prepare=None, before_step=None,
                 eaft: tuple[int, float] | None = None) -> dict:
    """Train the HF model itself on `steps` (each the sample indices of one optimizer step): losses, grad norms,
    and (with `val`) the held-out loss after the last step, over all of `val` at once. `unfrozen`: Axolotl's
    unfrozen_parameters (`axolotl_freeze`); `prepare(model)` before the optimizer is built, `before_step(model,
    done)` before each step (`done`: the steps before it; a trainer callback's on_step_begin); `eaft`: Axolotl's EAFT
    loss (`hf_loss`), in training and in the held-out loss, as HF's Trainer uses a compute_loss_func in both."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if unfrozen is not None:
        axolotl_freeze(model, unfrozen)
    if prepare is not None:
        prepare(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, eps=eps,
                            weight_decay=0.0)
    losses, norms = [], []
    for done, idx in enumerate(steps):
        if before_step is not None:
            before_step(model, done)
        loss = hf_loss(model, batch_of(data, idx), eaft)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e12)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "grad_norms": norms}
    if val is not None:
        with torch.no_grad():
            out["eval_loss"] = float(hf_loss(model, batch_of(val, range(len(val))), eaft))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def make_model(out: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               seed: int = 0, tie: bool = False) -> Path:
    """A tiny Llama whose weights are spread wide enough (unlike HF's 0.02 init) that per-token losses differ a lot:
    then weighting micro-batches wrongly changes the loss and the test can see it."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.demo.build import make_tiny_llama

    make_tiny_llama(out, tokenizer_dir=tokenizer_dir, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    ffn=2 * hidden, max_positions=128, seed=seed, tie=tie)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    # no pad token in the config (as Llama-3's): HF's embedding would otherwise never train the pad row
    # (nn.Embedding padding_idx), which Megatron's embedding does, and the gradients would differ by that row
    model.config.pad_token_id = None
    model.model.embed_tokens.padding_idx = None
    _spread(model, seed)
    model.save_pretrained(out)
    return out


def _spread(model, seed: int) -> None:
    """make_model's weights: spread wide (norms around 1: Gemma's stored weights around 0, as it scales by 1 + w),
    so per-token losses differ a lot and a missing weight shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    centre = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(centre + 0.1 * noise if "norm" in name else 0.15 * noise)


def _save_with_tokenizer(cfg, out: Path, tokenizer_dir: Path, seed: int, auto=None) -> Path:
    """A random model of `cfg` (spread weights, fp32; built by `auto`, default AutoModelForCausalLM) and the
    tokenizer's files beside it (only those: the directory may hold a model too)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = (auto or AutoModelForCausalLM).from_config(cfg).to(torch.float32)
    _spread(model, seed)
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens")):
            shutil.copyfile(f, out / f.name)
    return out


def make_phi3(out: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              seed: int = 0, partial_rotary: float = 0.75) -> Path:
    """A tiny Phi-3 (q, k, v and gate, up packed in one HF tensor each) whose pad token is its EOS, as Phi-3/4's
    are (transformers never trains that embedding row from lookups: nn.Embedding padding_idx), with RoPE on 3/4 of
    each head and LongRoPE (short factors, scaled cos/sin) as Phi-4-mini's."""
    from transformers import AutoTokenizer, Phi3Config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    half = int(hidden // heads * partial_rotary) // 2
    longrope = {"type": "longrope", "short_factor": [1.0 + 0.5 * i for i in range(half)],
                "long_factor": [4.0 + i for i in range(half)]}
    cfg = Phi3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                     original_max_position_embeddings=128, rope_scaling=longrope, sliding_window=None,
                     tie_word_embeddings=False, partial_rotary_factor=partial_rotary,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return _save_with_tokenizer(cfg, out, tokenizer_dir, seed)


def make_glm4(out: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              seed: int = 0) -> Path:
    """A tiny GLM-4 (q/k/v biases, gate/up packed, post-norms on both sub-layers, interleaved RoPE on half of each
    head)."""
    from transformers import AutoTokenizer, Glm4Config

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = Glm4Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                     max_position_embeddings=128, attention_bias=True, partial_rotary_factor=0.5,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=None)
    return _save_with_tokenizer(cfg, out, tokenizer_dir, seed)


def make_gemma(out: Path, tokenizer_dir: Path, version: int = 3, *, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, seed: int = 0, window: int = 16) -> Path:
    """A tiny Gemma 3 (q/k norms; a local layer with its own RoPE base and a global one with linear RoPE scaling;
    tied) or Gemma 2 (soft-capped scores and logits, small caps so they bite; untied), with a sliding window shorter
    than the chat examples. No pad token: transformers would hold Gemma's pad row (id 0, a real token of the test
    tokenizer) out of the lookups' gradient, which nd-adapter does for untied models only."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  max_position_embeddings=256, sliding_window=window, pad_token_id=None,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  query_pre_attn_scalar=hidden // heads + 8)
    if version == 3:
        cfg = Gemma3TextConfig(**common, tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                   "rope_theta": 1000000.0}})
    else:
        cfg = Gemma2Config(**common, tie_word_embeddings=False, attn_logit_softcapping=4.0,
                           final_logit_softcapping=6.0)
    return _save_with_tokenizer(cfg, out, tokenizer_dir, seed)


def make_moe(out: Path, tokenizer_dir: Path, family: str = "qwen3_moe", *, hidden: int = 64, layers: int = 2,
             heads: int = 4, kv_heads: int = 2, experts: int = 4, top_k: int = 2, coef: float = 0.5,
             seed: int = 0, router_loss: bool = True) -> Path:
    """A tiny mixture of experts (Qwen3-MoE: q/k norms, renormalised top-k; OLMoE: whole-projection q/k norms,
    no renormalisation) with the load-balancing loss on and a large coefficient, so its gradient shows in a few
    steps (`router_loss` false: off, as the transformers engine runs it)."""
    from transformers import AutoTokenizer, OlmoeConfig, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=256, num_experts=experts,
                  num_experts_per_tok=top_k, output_router_logits=router_loss, router_aux_loss_coef=coef,
                  tie_word_embeddings=False, pad_token_id=None, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=hidden // heads, intermediate_size=2 * hidden,
                             moe_intermediate_size=hidden // 2, norm_topk_prob=True, use_sliding_window=False)
    else:
        cfg = OlmoeConfig(**{**common, "num_key_value_heads": heads}, intermediate_size=hidden // 2)
    return _save_with_tokenizer(cfg, out, tokenizer_dir, seed)


def peft_adapter(model_dir: str, kw: dict, out: Path) -> Path:
    """A PEFT adapter whose B is not zero (PEFT's init_lora_weights=False), so the adapters act from step 1."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **kw)).save_pretrained(out)
    return out


def hf_best(evals: dict[int, float], saves: set[int], patience: int | None = None) -> tuple[int | None, int | None]:
    """(best checkpoint step, early-stop step) as transformers' own code decides them: `EarlyStoppingCallback`
    sees each evaluation first (inside `evaluate`), then `Trainer._determine_best_metric`, then a save at that step
    names the best checkpoint when `checkpoint-{best_global_step}` exists. `evals`: step -> eval loss after steps
    >= 1; `saves`: the steps HF saves."""
    from types import SimpleNamespace

    from transformers import EarlyStoppingCallback, Trainer, TrainerControl, TrainerState
    from transformers.trainer_utils import SaveStrategy

    args = SimpleNamespace(metric_for_best_model="eval_loss", greater_is_better=False,
                           save_strategy=SaveStrategy.STEPS, load_best_model_at_end=True)
    state, control = TrainerState(), TrainerControl()
    trainer = SimpleNamespace(args=args, state=state)
    stopper = EarlyStoppingCallback(patience) if patience else None
    best, saved = None, set()
    for step in sorted(set(evals) | saves):
        state.global_step = step
        if step in evals:
            metrics = {"eval_loss": evals[step]}
            if stopper is not None:
                stopper.on_evaluate(args, state, control, metrics)
            Trainer._determine_best_metric(trainer, metrics, None)
        if step in saves:
            saved.add(step)
            if state.best_global_step and state.best_global_step in saved:
                best = state.best_global_step
        if control.should_training_stop:
            return best, step
    return best, None
