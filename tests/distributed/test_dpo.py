"""`rl: dpo` against TRL's own DPOTrainer (1.8.0, Axolotl 067b021's pin): a tiny Llama with PEFT LoRA r 4 on the
transformers engine, 4 steps at dp_shard=2 under ZeRO-3 (one pair per micro-batch, two micro-batches a step: four
pairs a step), fp32 on CPU. TRL trains the same base with the same adapters (PEFT initialised from the same seed)
on the same Axolotl-rendered pairs, each of its steps one batch of the four pairs nd-adapter's step saw (its sampler
made sequential): the losses and every reward metric TRL logs agree, step by step, which also checks the
gradients (the adapters have moved by step 2). The same run at tp=2 (the model's own TP plan, ZeRO-2, four
micro-batches a step) gives the same numbers, and so do ORPO's and SimPO's runs at tp=2 and cp=2, and the LoRA and
full runs at cp=2 (each pair's sequences split over the CP ranks; the eval loss too). A full fine-tune (every
weight, ZeRO-3; nd-adapter's reference the starting weights' log-probabilities computed once before step 1, TRL's
a frozen copy of the model) matches TRL too. Pairs of different lengths, so a wrong mask or a per-micro-batch
mean would show.

The LoRA and full runs hold out 5 of the 21 pairs (val_set_size: 5) and evaluate before step 1 and every 2 steps;
TRL evaluates the same 5 pairs at the same steps in batches of 2 (per_device_eval_batch_size = dp × micro-batch,
one nd-adapter round), the last batch short: eval_loss (the mean over pairs) and every eval_rewards/* and
eval_logps/* metric (the mean of the batch means) agree.

`rl: orpo` (Axolotl's chat_template.argilla rows, LoRA, the same layout, steps and evals) against TRL's
ORPOTrainer in the same worker: losses, rewards/*, logps/*, nll_loss, log_odds_ratio, log_odds_chosen, and the
evals, agree. So do `rl: ipo` (the DPO pairs, LoRA) against TRL's DPOTrainer with loss_type ["ipo"], and `rl: simpo`
(the DPO pairs, LoRA, γ and cpo_alpha not TRL's defaults) against TRL's CPOTrainer with loss_type "simpo".

`rl: kto` (test_kto_matches_trl, its own worker: TRL's KL term is gathered across processes, so TRL runs on the
same two processes, after nd-adapter, over the same gloo group) against TRL's KTOTrainer: losses, kl, rewards/* and
logps/* agree, and so do its evals of 8 held-out rows."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.sft_data import tiny_model, write_jsonl

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, BETA, WORLD, GA, EPS, VAL, EVERY, ALPHA = 96, 2e-2, 4, 0.2, 2, 2, 1e-8, 5, 2, 0.3
SIMPO = {"beta": 2.0, "gamma": 0.7, "cpo_alpha": 0.5}
LORA = {"r": 4, "alpha": 8, "target_linear": True}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def _rows() -> list[dict]:
    words = "red green blue small large quick slow bright dark warm cold soft".split()
    return [{"messages": [{"role": "user", "content": f"Describe the {words[i % 12]} thing number {i}."}],
             "chosen": {"role": "assistant", "content": " ".join(words[: 2 + i % 5]) + "."},
             "rejected": {"role": "assistant", "content": f"No {i}" + " idea" * (1 + i % 3)}} for i in range(16 + VAL)]


def _argilla() -> list[dict]:
    """ORPO's rows (Axolotl's chat_template.argilla): chosen and rejected conversations, some with a system prompt
    or two turns."""
    words = "red green blue small large quick slow bright dark warm cold soft".split()
    out = []
    for i in range(16 + VAL):
        turns = [{"role": "user", "content": f"Name thing {i}."}, {"role": "assistant", "content": words[i % 12]}] * (
            1 + i % 2)
        good = " ".join(words[: 2 + i % 5]) + "."
        row = {"chosen": [*turns[:-1], {"role": "assistant", "content": good}],
               "rejected": [*turns[:-1], {"role": "assistant", "content": f"No {i}" + " idea" * (1 + i % 3)}]}
        out.append({**row, "system": "Be brief."} if i % 3 == 0 else row)
    return out


def _cfg(model: Path, data: Path, root: Path, zero: int = 3, tp: int = 1, lora: bool = True, ev: bool = True,
         objective: str = "dpo", cp: int = 1, engine: str = "transformers", init_from: str | None = None,
         steps: int = STEPS, ckpt: str | None = None, quantize: bool = False, free: bool = False, mb: int = 1,
         share: str | bool = "auto", pre: bool = False, compile: bool = False):
    kind = "chat_template.argilla" if objective == "orpo" else "chat_template.default"
    raw = {"model": {"path": str(model), "cache_dir": f"{root}/cache", "engine": engine, "compile": compile},
           "objective": objective, "dpo": {"beta": BETA, "padding_free": free, "share_prompt": share,
                                                   "precompute_ref": pre},
           "orpo": {"alpha": ALPHA}, "simpo": SIMPO,
           "lora": {**LORA, "init_from": init_from, **({"quantize_base": "nf4"} if quantize else {})} if lora else None,
           "parallelism": {"dp_shard_size": WORLD // (tp * cp), "tp_size": tp, "cp_size": cp},
           "batch": {"micro_batch_size": mb, "gradient_accumulation_steps": GA * tp * cp // mb},  # four pairs a step
           "seq_len": SEQ, "precision": "fp32",
           "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12,
                         "betas": [0.9, 0.999], "eps": EPS, "weight_decay": 0.0},
           "deepspeed": {"zero_stage": zero}, "eval": {"every": EVERY} if ev else {"per_epoch": 0},
           "checkpoint": {"dir": ckpt},
           "data": {"datasets": [{"path": str(data), "type": kind}], "chat_template": "chatml",
                    "prepared_path": f"{root}/prep", "val_set_size": VAL}}
    return config.build(raw, env={}, world_size=WORLD)


def _worker(rank, world, model, data, root, orpo_data):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    lines: list[str] = []
    res = train(_cfg(Path(model), Path(data), Path(root)), log=lines.append)
    tp = train(_cfg(Path(model), Path(data), Path(root) / "tp", zero=2, tp=2, ev=False), log=lambda s: None)
    full = train(_cfg(Path(model), Path(data), Path(root) / "full", lora=False), log=lines.append)
    orpo = train(_cfg(Path(model), Path(orpo_data), Path(root) / "orpo", objective="orpo"), log=lines.append)
    more = [train(_cfg(Path(model), Path(data), Path(root) / k, objective=k), log=lines.append)
            for k in ("ipo", "simpo")]
    cp = [train(_cfg(Path(model), Path(data), Path(root) / f"cp-{lora}", lora=lora, cp=2), log=lambda s: None)
          for lora in (True, False)]  # ZeRO-3 over the CP ranks; a full fine-tune's reference table at cp=2 too
    # padding-free at cp=2: each sequence of the stream split into the CP ranks' chunks (transformers' attention
    # interface with nd-adapter's CP attention), the losses summed back into their rows
    cp.append(train(_cfg(Path(model), Path(data), Path(root) / "cp-free", cp=2, free=True), log=lambda s: None))
    tp_more = [train(_cfg(Path(model), Path(d), Path(root) / f"{k}-{par}", zero=2, ev=False, objective=k,
                          **{par: 2}), log=lambda s: None)
               for par in ("tp", "cp") for k, d in (("orpo", orpo_data), ("simpo", data))]
    return ([res.losses, res.rewards, res.eval_losses, res.eval_rewards], lines, tp.losses, tp.rewards,
            [full.losses, full.rewards, full.eval_losses, full.eval_rewards],
            [orpo.losses, orpo.rewards, orpo.eval_losses, orpo.eval_rewards],
            [[r.losses, r.rewards, r.eval_losses, r.eval_rewards] for r in more],
            [[r.losses, r.rewards] for r in tp_more],
            [[r.losses, r.rewards, r.eval_losses, r.eval_rewards] for r in cp])


def _step_pairs(cfg, n: int) -> list[list[int]]:
    """The pairs of each step, as nd-adapter's sampler hands them to the two ranks."""
    from adapter.data.sampler import DPSampler

    its = [iter(DPSampler(n, dp_rank=r, dp_size=WORLD, micro_batch=1, seed=cfg.data.seed)) for r in range(WORLD)]
    return [[int(i) for it in its for _ in range(GA) for i in next(it)] for _ in range(STEPS)]


def _trl(cfg, model_dir: Path, tok_dir: Path, pairs: list[dict], held: list[dict], out: Path, lora: bool = True,
         orpo: bool = False, loss: str = "sigmoid", simpo: bool = False, adapter: Path | None = None):
    """TRL's DPOTrainer on `pairs` in order (one step = 4 consecutive pairs), evaluating `held` before step 1 and
    every EVERY steps: (per step: loss and its metrics, per eval: (step, its logged eval metrics)). `adapter`: PEFT
    starts from that saved adapter."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    torch.manual_seed(cfg.seed)  # as adapter/modeling/hf_build.add_peft initialises the adapters
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    elif lora:  # else TRL copies the model as its frozen reference
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    seen: list[dict] = []
    evals: list[tuple[int, dict]] = []

    class Evals(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "eval_loss" in logs:
                evals.append((state.global_step, dict(logs)))

    if orpo or simpo:
        return _trl_orpo(model, tok_dir, pairs, held, out, seen, evals, Evals(), simpo)

    class Recorded(DPOTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def _compute_loss(self, model, inputs, return_outputs):
            loss = super()._compute_loss(model, inputs, return_outputs)
            m = self._metrics["train"]
            if self.model.training:
                seen.append({"loss": float(loss.detach()), **{k: m[k][-1] for k in METRICS}})
            return loss

    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=WORLD * GA, gradient_accumulation_steps=1,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                     beta=BETA, max_length=SEQ, loss_type=[loss], logging_steps=1, report_to=[], use_cpu=True,
                     save_strategy="no", seed=cfg.seed, bf16=False, dataloader_num_workers=0, optim="adamw_torch",
                     eval_strategy="steps", eval_steps=EVERY, eval_on_start=True, per_device_eval_batch_size=WORLD)
    trainer = Recorded(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                       eval_dataset=Dataset.from_list(held), callbacks=[Evals()],
                       processing_class=AutoTokenizer.from_pretrained(str(tok_dir)))
    trainer.train()
    return seen, evals


def _trl_orpo(model, tok_dir: Path, pairs, held, out: Path, seen: list, evals: list, callback, simpo: bool = False):
    """TRL's ORPOTrainer (trl.experimental.orpo, Axolotl's AxolotlORPOTrainer's base) as `_trl` runs DPO; `simpo`:
    its CPOTrainer (Axolotl's AxolotlCPOTrainer's base) with loss_type simpo, the same way."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    base, config = (CPOTrainer, CPOConfig) if simpo else (ORPOTrainer, ORPOConfig)
    kinds = ({"loss_type": "simpo", "beta": SIMPO["beta"], "simpo_gamma": SIMPO["gamma"],
              "cpo_alpha": SIMPO["cpo_alpha"]} if simpo else {"beta": ALPHA})

    class Recorded(base):  # type: ignore[misc,valid-type]
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            seen.append({"loss": float(loss.detach()), **{k: v[-1] for k, v in self._stored_metrics["train"].items()}})
            return loss

    args = config(output_dir=str(out), per_device_train_batch_size=WORLD * GA, gradient_accumulation_steps=1,
                  max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                  max_length=SEQ, **kinds, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                      seed=0, bf16=False, dataloader_num_workers=0, optim="adamw_torch", eval_strategy="steps",
                      eval_steps=EVERY, eval_on_start=True, per_device_eval_batch_size=WORLD)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.pad_token = tok.pad_token or tok.eos_token  # its collator needs one (padding is masked either way)
    trainer = Recorded(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                       eval_dataset=Dataset.from_list(held), callbacks=[callback], processing_class=tok)
    trainer.train()
    return seen, evals


def test_dpo_matches_trl(tmp_path):
    from transformers import AutoTokenizer

    from adapter.data.sft import preference, templates

    tiny_model(tmp_path, weights=True)
    model = tmp_path / "model"
    rows = _rows()
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = _cfg(model, data, tmp_path)
    argilla = _argilla()
    orpo_data = write_jsonl(tmp_path / "argilla.jsonl", argilla)
    out = run_workers(_worker, WORLD, str(model), str(data), str(tmp_path), str(orpo_data), timeout=400)
    lora_run, lines, tp_losses, tp_rewards, full_run, orpo_run, (ipo_run, simpo_run), tp_more, cp_runs = out[0]
    losses, rewards = lora_run[:2]
    assert any(" | rewards/chosen " in ln for ln in lines), lines
    # the transformers engine ran each prompt once (its attention function at cp 1): every cp=1 run here is checked
    # against TRL on that path; the cp=2 runs keep one sequence per answer
    assert sum(ln.startswith("pairs: each pair's prompt runs once") for ln in lines) == 5, lines
    assert any(ln.startswith("eval after step 2 | eval_loss ") and f"| {VAL} eval pairs | rewards/chosen " in ln
               for ln in lines), lines

    tok = AutoTokenizer.from_pretrained(str(model))
    entry = cfg.data.datasets[0]
    template = templates.resolve_template("chatml", None, tok, "")
    rendered = [dict(zip(("prompt", "chosen", "rejected"), preference.render(r, entry, tok, template))) for r in rows]
    train_rows, held_rows = preference.split(cfg, len(rows))  # every row fits: prepared pair i is row i
    order = [int(train_rows[i]) for step in _step_pairs(cfg, len(train_rows)) for i in step]
    held = [rendered[i] for i in held_rows]
    ref = _trl(cfg, model, model, [rendered[i] for i in order], held, tmp_path / "trl")
    full_ref = _trl(cfg, model, model, [rendered[i] for i in order], held, tmp_path / "trl-full", lora=False)
    assert any(ln.startswith(f"DPO reference: the starting weights' log-probabilities of the 16 pairs and of the "
                             f"{VAL} held-out pairs") for ln in lines), lines
    worst = 0.0
    for (got_losses, got_rewards, got_eval, got_eval_rewards), (want_steps, want_evals) in ((lora_run, ref),
                                                                                              (full_run, full_ref)):
        assert len(want_steps) == STEPS == len(got_losses)
        for step, (loss, got, want) in enumerate(zip(got_losses, got_rewards, want_steps), 1):
            worst = max(worst, abs(loss - want["loss"]), *(abs(got[k] - want[k]) / max(1.0, abs(want[k]))
                                                           for k in METRICS))
            assert abs(loss - want["loss"]) <= 1e-5, (step, loss, want)
            for k in METRICS:
                assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (step, k, got[k], want[k])
        assert [s for s, _ in want_evals] == [s for s, _ in got_eval] == [s for s, _ in got_eval_rewards] == [0, 2, 4]
        for (step, loss), (_, got), (_, want) in zip(got_eval, got_eval_rewards, want_evals):
            worst = max(worst, abs(loss - want["eval_loss"]),
                        *(abs(got[k] - want[f"eval_{k}"]) / max(1.0, abs(want[f"eval_{k}"])) for k in METRICS))
            assert abs(loss - want["eval_loss"]) <= 1e-5, (step, loss, want)
            for k in METRICS:
                w = want[f"eval_{k}"]
                assert abs(got[k] - w) <= 1e-5 * max(1.0, abs(w)), (step, k, got[k], want)
    print(f"DPO: max |nd-adapter - TRL| / max(1, |TRL|) over losses, metrics and evals: {worst:.2e}")
    from adapter.data.sft.preference_orpo import render_argilla

    ocfg = _cfg(model, orpo_data, tmp_path / "orpo", objective="orpo")
    o_rendered = [dict(zip(("prompt", "chosen", "rejected"), render_argilla(r, tok, template))) for r in argilla]
    o_train, o_held = preference.split(ocfg, len(argilla))
    o_order = [int(o_train[i]) for step in _step_pairs(ocfg, len(o_train)) for i in step]
    orpo_ref = _trl(ocfg, model, model, [o_rendered[i] for i in o_order], [o_rendered[i] for i in o_held],
                    tmp_path / "trl-orpo", orpo=True)
    names = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    o_worst = _compare(orpo_run, orpo_ref, names)
    print(f"ORPO: max |nd-adapter - TRL| / max(1, |TRL|) over losses, metrics and evals: {o_worst:.2e}")
    assert abs(orpo_ref[0][-1]["log_odds_chosen"] - orpo_ref[0][0]["log_odds_chosen"]) > 1e-3  # it trained
    steps, held_pairs = [rendered[i] for i in order], held
    ipo_ref = _trl(cfg, model, model, steps, held_pairs, tmp_path / "trl-ipo", loss="ipo")
    print(f"IPO: max |nd-adapter - TRL| / max(1, |TRL|) over losses, metrics and evals: "
          f"{_compare(ipo_run, ipo_ref, METRICS):.2e}")
    assert abs(ipo_ref[0][-1]["loss"] - ref[0][-1]["loss"]) > 1e-3  # another loss than DPO's
    simpo_ref = _trl(cfg, model, model, steps, held_pairs, tmp_path / "trl-simpo", simpo=True)
    print(f"SimPO: max |nd-adapter - TRL| / max(1, |TRL|) over losses, metrics and evals: "
          f"{_compare(simpo_run, simpo_ref, (*METRICS, 'nll_loss')):.2e}")
    assert abs(simpo_ref[0][-1]["rewards/margins"] - simpo_ref[0][0]["rewards/margins"]) > 1e-3  # it trained
    for a, b in zip([*losses, *(r[k] for r in rewards for k in METRICS)],  # tp=2: the same four pairs a step
                    [*tp_losses, *(r[k] for r in tp_rewards for k in METRICS)]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)
    for (a_losses, a_rewards), b_run in zip(tp_more, (orpo_run, simpo_run) * 2):  # ORPO and SimPO at tp=2, cp=2
        b_losses, b_rewards = b_run[:2]
        for a, b in zip([*a_losses, *(r[k] for r in a_rewards for k in r)],
                        [*b_losses, *(r[k] for r in b_rewards for k in r)]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)
    assert len(cp_runs) == 3
    for got, want in zip(cp_runs, (lora_run, full_run, lora_run)):  # cp=2: each pair's sequences split over CP
        # (the eval's metrics are means of per-round means, a round being dp × micro-batch pairs as TRL's batch on
        # dp processes: cp=2 has one DP rank, so only the eval loss, a mean over pairs, is the same)
        flat_got = [*got[0], *(r[k] for r in got[1] for k in METRICS), *(x for _, x in got[2])]
        flat_want = [*want[0], *(r[k] for r in want[1] for k in METRICS), *(x for _, x in want[2])]
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(flat_got, flat_want)) if abs(a - b) > 1e-5 * max(1.0, abs(b))]
        assert len(flat_got) == len(flat_want) and not bad, bad
    assert min(abs(ref[0][-1]["rewards/margins"]), abs(full_ref[0][-1]["rewards/margins"])) > 1e-3
    assert abs(full_run[0][-1] - losses[-1]) > 1e-3  # every weight trained: another curve than LoRA's
    assert abs(ref[1][-1][1]["eval_rewards/margins"]) > 1e-4  # the eval sees the trained adapters


def _native(rank, world, model, data, root, adapter, orpo_data):
    import functools

    import torch

    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    m, d, r = Path(model), Path(data), Path(root)
    lines: list[str] = []
    lora = train(_cfg(m, d, r / "lora", engine="megatron", init_from=adapter), log=lines.append)
    hf = train(_cfg(m, d, r / "hf", init_from=adapter), log=lines.append)  # the transformers engine, PEFT's
    fresh = train(_cfg(m, d, r / "fresh", engine="megatron", ev=False), log=lines.append)  # B = 0: adapters off
    # precompute_ref_log_probs: fresh LoRA's reference (the base) as a table before step 1, no reference forward
    pre = train(_cfg(m, d, r / "fresh-pre", engine="megatron", ev=False, pre=True), log=lines.append)
    resumed = []  # saved after 2 steps, resumed to 4: fresh LoRA, and the full run (its table before the load)
    for name, kw in (("fresh", {}), ("full", {"lora": False})):
        ck = str(r / f"ck-{name}")
        train(_cfg(m, d, r / f"cut-{name}", engine="megatron", ev=False, steps=2, ckpt=ck, **kw), log=lambda s: None)
        resumed.append(train(_cfg(m, d, r / f"cut-{name}", engine="megatron", ev=False, ckpt=ck, **kw), resume=True,
                             log=lambda s: None))
    full = train(_cfg(m, d, r / "full", lora=False, engine="megatron"), log=lines.append)
    tp = train(_cfg(m, d, r / "tp", zero=2, tp=2, ev=False, engine="megatron", init_from=adapter), log=lambda s: None)
    cp = train(_cfg(m, d, r / "cp", lora=False, cp=2, engine="megatron"), log=lambda s: None)
    no_ref = [train(_cfg(m, Path(orpo_data) if k == "orpo" else d, r / k, objective=k, engine="megatron",
                         init_from=adapter), log=lambda s: None) for k in ("orpo", "simpo")]
    # padding-free (TRL's padding_free): each micro-batch's sequences as one stream of their real tokens
    free = [train(_cfg(m, d, r / "pf-tp", zero=2, tp=2, engine="megatron", init_from=adapter, free=True,
                       share=False), log=lines.append),
            train(_cfg(m, d, r / "pf-cp", lora=False, cp=2, engine="megatron", free=True), log=lambda s: None),
            train(_cfg(m, d, r / "pf-hf", init_from=adapter, free=True, mb=2, share=False), log=lambda s: None),
            train(_cfg(m, d, r / "pf-simpo", objective="simpo", engine="megatron", init_from=adapter, free=True,
                       share=False), log=lambda s: None),
            train(_cfg(m, d, r / "shared-mb2", engine="megatron", init_from=adapter, mb=2), log=lambda s: None)]
    # compiled layers on the shared-prompt stream, whose length changes with every micro-batch (a symbol after its
    # second value): Dynamo and AOTAutograd here (aot_eager: no inductor C++ on CPU; inductor's code runs on the GPU
    # host, tests/gpu/test_dpo.py)
    plain = torch.compile
    torch.compile = functools.partial(plain, backend="aot_eager")
    try:
        free.append(train(_cfg(m, d, r / "shared-compiled", zero=2, engine="megatron", init_from=adapter,
                               compile=True), log=lines.append))
    finally:
        torch.compile = plain
    return ([[x.losses, x.rewards, x.eval_losses, x.eval_rewards] for x in (lora, full, hf, *no_ref, *free)],
            [[tp.losses, tp.rewards],
            [fresh.losses, fresh.rewards], [[x.start_step, x.losses, x.rewards] for x in resumed],
            [pre.losses, pre.rewards],
            [cp.losses, cp.rewards, cp.eval_losses]],
            [ln for ln in lines if ln.startswith(("engine:", "DPO ref", "pairs:"))])


def test_dpo_on_the_native_engine_matches_trl(tmp_path):
    """The same pairs on the Megatron-Core layers (the Llama family's native engine): LoRA started from a PEFT adapter
    whose B is not zero, and a full fine-tune, at dp_shard=2 under ZeRO-3, against TRL from the same adapter / the
    same weights: losses, reward metrics and evals. TRL's reference for a pretrained adapter is a frozen copy of it
    (not the base), so both engines' LoRA-from-adapter runs use the starting adapter's log-probabilities (the
    transformers engine's run too). ORPO and SimPO (no reference) from the same adapter against TRL's ORPOTrainer and
    CPOTrainer. LoRA at tp=2 and the full run at cp=2 give the same numbers, and fresh LoRA and the full run saved
    after 2 steps and resumed continue on the same curve."""
    from transformers import AutoTokenizer

    from adapter.data.sft import preference, templates
    from tests.helpers.sft import peft_adapter

    tiny_model(tmp_path, weights=True)
    model = tmp_path / "model"
    rows = _rows()
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    adapter = peft_adapter(str(model), {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}, tmp_path / "adapter")
    argilla = _argilla()
    orpo_data = write_jsonl(tmp_path / "argilla.jsonl", argilla)
    got = run_workers(_native, WORLD, str(model), str(data), str(tmp_path), str(adapter), str(orpo_data),
                      timeout=400)[0]
    (lora_run, full_run, hf_run, orpo_run, simpo_run, *free), (tp_run, fresh_run, resumed, pre_run, cp_run), said = got
    assert len([s for s in said if s.startswith("engine: Megatron-Core layers (llama family")]) == 6, said
    cfg = _cfg(model, data, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(model))
    template = templates.resolve_template("chatml", None, tok, "")
    rendered = [dict(zip(("prompt", "chosen", "rejected"), preference.render(r, cfg.data.datasets[0], tok, template)))
                for r in rows]
    train_rows, held_rows = preference.split(cfg, len(rows))
    steps = [rendered[int(train_rows[i])] for step in _step_pairs(cfg, len(train_rows)) for i in step]
    held = [rendered[i] for i in held_rows]
    from_adapter = _trl(cfg, model, model, steps, held, tmp_path / "trl", adapter=adapter)
    worst = max(_compare(lora_run, from_adapter, METRICS), _compare(hf_run, from_adapter, METRICS),
                _compare(full_run, _trl(cfg, model, model, steps, held, tmp_path / "trl-full", lora=False), METRICS))
    assert from_adapter[0][0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # TRL's reference: the starting adapter
    from adapter.data.sft.preference_orpo import render_argilla  # ORPO and SimPO (no reference) from the adapter

    ocfg = _cfg(model, orpo_data, tmp_path / "orpo", objective="orpo")
    o_rendered = [dict(zip(("prompt", "chosen", "rejected"), render_argilla(r, tok, template))) for r in argilla]
    o_train, o_held = preference.split(ocfg, len(argilla))
    o_steps = [o_rendered[int(o_train[i])] for step in _step_pairs(ocfg, len(o_train)) for i in step]
    worst = max(worst, _compare(orpo_run, _trl(ocfg, model, model, o_steps, [o_rendered[i] for i in o_held],
                                               tmp_path / "trl-orpo", orpo=True, adapter=adapter),
                                (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")),
                _compare(simpo_run, _trl(cfg, model, model, steps, held, tmp_path / "trl-simpo", simpo=True,
                                         adapter=adapter), (*METRICS, "nll_loss")))
    assert sum("the starting adapter's log-probabilities of the 16 pairs" in s for s in said) == 4, said
    print(f"DPO, ORPO, SimPO on the native engine: max |nd-adapter - TRL| / max(1, |TRL|): {worst:.2e}")
    for got, want in ((tp_run, lora_run), (cp_run, full_run)):
        flat_got = [*got[0], *(r[k] for r in got[1] for k in METRICS), *(x for _, x in got[2:] and got[2])]
        flat_want = [*want[0], *(r[k] for r in want[1] for k in METRICS), *(x for _, x in got[2:] and want[2])]
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(flat_got, flat_want)) if abs(a - b) > 1e-5 * max(1.0, abs(b))]
        assert len(flat_got) == len(flat_want) and not bad, bad
    # padding-free (no prompt shared): tp=2 (+SP), a full fine-tune at cp=2, the transformers engine with two pairs
    # a micro-batch, SimPO; a shared prompt with two pairs a micro-batch, and one through compiled layers (ZeRO-2;
    # its stream's length a symbol of the graphs): each the numbers of the run it is
    # compared with (losses, metrics, evals), itself checked against TRL above; what the model then runs is checked
    # in tests/unit/test_dpo_config.py
    assert sum(s.startswith("pairs: padding-free") for s in said) == 1, said
    # every native run at cp 1 ran each pair's prompt once (dpo.share_prompt: auto), so the comparisons with TRL
    # above check that path: LoRA, the full run, ORPO, SimPO, tp=2 (+SP), the resumes; and above, two pairs a
    # micro-batch (one stream) against one
    assert sum(s.startswith("pairs: each pair's prompt runs once") for s in said) == 6, said  # and the hf run
    for run, want in zip(free, (lora_run, full_run, hf_run, simpo_run, lora_run, lora_run), strict=True):
        names = list(want[1][0])
        flat_got = [*run[0], *(r[k] for r in run[1] for k in names), *(x for _, x in run[2])]
        flat_want = [*want[0], *(r[k] for r in want[1] for k in names), *(x for _, x in want[2])]
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(flat_got, flat_want)) if abs(a - b) > 1e-5 * max(1.0, abs(b))]
        assert len(flat_got) == len(flat_want) and not bad, bad
    assert abs(lora_run[0][-1] - full_run[0][-1]) > 1e-3  # two different runs
    # fresh native adapters (B = 0; the reference: the adapters switched off each step) against TRL from a PEFT
    # adapter holding the same initial A and B = 0 (TRL's frozen copy of it is then the base, as disabling gives)
    fresh_ref = _trl(cfg, model, model, steps, held, tmp_path / "trl-fresh", adapter=_native_init(model,
                                                                                               tmp_path / "init"))
    for loss, got, want in zip(fresh_run[0], fresh_run[1], fresh_ref[0]):
        assert abs(loss - want["loss"]) <= 1e-5 and all(abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k]))
                                                        for k in METRICS), (got, want)
    assert abs(fresh_run[1][-1]["rewards/margins"]) > 1e-3  # the adapters moved the policy off the reference
    flat_pre = [*pre_run[0], *(r[k] for r in pre_run[1] for k in METRICS)]
    flat_fresh = [*fresh_run[0], *(r[k] for r in fresh_run[1] for k in METRICS)]
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(flat_pre, flat_fresh, strict=True)), (
        flat_pre, flat_fresh)
    assert sum("reference: the base's (fresh LoRA adapters: B = 0) log-probabilities of the 16 pairs" in s
               for s in said) == 1, said
    for (start, losses, rewards), whole in zip(resumed, (fresh_run, full_run)):  # resumed at step 2: the same curve
        flat_got = [*losses, *(r[k] for r in rewards for k in METRICS)]
        flat_want = [*whole[0][2:], *(r[k] for r in whole[1][2:] for k in METRICS)]
        assert start == 2 and all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(flat_got, flat_want)), (
            flat_got, flat_want)


def _native_init(model: Path, out: Path) -> Path:
    """A PEFT adapter holding the native adapters' initial weights for this run's seed (A drawn per matrix as
    adapter/modeling/lora.init_a draws it, B zero)."""
    import torch

    from adapter.convert.peft import write_adapter
    from adapter.modeling.lora import init_a
    from adapter.models import lora
    from adapter.models.arch import load_arch

    spec = lora.resolve(load_arch(model), r=LORA["r"], alpha=LORA["alpha"], target_linear=True)
    seed = config.build({"model": {"path": str(model)}}, env={}).seed
    tensors = {}
    for t in spec.targets:
        a = init_a(t, spec.r, seed)
        tensors[lora.peft_key(t, "A")] = a
        tensors[lora.peft_key(t, "B")] = torch.zeros(t.linear.out, spec.r)
    return write_adapter(out, tensors, spec, base_model=str(model))


def _compare(run, ref, names) -> float:
    """The largest |ours - TRL's| / max(1, |TRL's|) over the steps' losses and metrics and the evals'; each ≤ 1e-5."""
    (losses, rewards, evals, eval_rewards), (want_steps, want_evals) = run, ref
    assert len(want_steps) == STEPS == len(losses)
    pairs = [(loss, want["loss"]) for loss, want in zip(losses, want_steps)]
    pairs += [(got[k], want[k]) for got, want in zip(rewards, want_steps) for k in names]
    assert [s for s, _ in want_evals] == [s for s, _ in evals] == [s for s, _ in eval_rewards] == [0, 2, 4]
    pairs += [(loss, want["eval_loss"]) for (_, loss), (_, want) in zip(evals, want_evals)]
    pairs += [(got[k], want[f"eval_{k}"]) for (_, got), (_, want) in zip(eval_rewards, want_evals) for k in names]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)
    assert worst <= 1e-5, [(a, b) for a, b in pairs if abs(a - b) > 1e-5 * max(1.0, abs(b))]
    return worst


KTO = {"beta": 0.3, "desirable_weight": 0.7, "undesirable_weight": 1.3}
KTO_MB = 2  # TRL's per-device batch: the KL rows are built inside it
KTO_FULL_LR = 1e-3  # a full fine-tune's: its KL estimate rises above 0 (at LoRA's 2e-2 it falls below and is clamped)
KTO_METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")


# the labels in training order, a round (one micro-batch on each of the 2 ranks) a group: rounds of only desirable
# or only undesirable rows (TRL then logs that side, and the margin, from the step's other micro-batch only), and
# rounds where one rank holds only desirable rows and the other only undesirable ones
KTO_LABELS = "TFFT TTTT FFFF TTFF FTTF TFTT FFTF TTFT".replace(" ", "")
# the held-out rows' labels in eval order (val_set_size 8: two eval rounds of 2 chunks of KTO_MB rows): a chunk of
# one label, rounds with both
KTO_HELD = "TFTT FFTF".replace(" ", "")


def _kto_rows(order) -> list[dict]:
    """Axolotl's chatml.prompt_pairs rows: prompt, completion, label (some with a system prompt), of different
    lengths; row order[k] is the k-th trained (then the k-th held out) and gets (KTO_LABELS + KTO_HELD)[k]."""
    words = "red green blue small large quick slow bright dark warm cold soft".split()
    rows = [{"prompt": f"Describe the {words[i % 12]} thing number {i}.",
             "completion": " ".join(words[: 2 + i % 5]) + "." if i % 3 else f"No {i}" + " idea" * (1 + i % 3)}
            for i in range(len(order))]
    for k, i in enumerate(order):
        rows[i]["label"] = (KTO_LABELS + KTO_HELD)[k] == "T"
    return [{**r, "system": "Be brief."} if i % 4 == 1 else r for i, r in enumerate(rows)]


def _kto_cfg(model: str, data: str, root: str, cp: int = 1, lora: bool = True, lr: float = LR, steps: int = STEPS,
             ckpt: str | None = None):
    raw = {"model": {"path": model, "cache_dir": f"{root}/cache", "engine": "transformers"}, "objective": "kto",
           "kto": KTO, "lora": LORA if lora else None, "parallelism": {"dp_shard_size": WORLD, "cp_size": cp},
           "batch": {"micro_batch_size": KTO_MB, "gradient_accumulation_steps": GA}, "seq_len": SEQ,
           "precision": "fp32", "optimizer": {"lr": lr, "schedule": "constant", "warmup_steps": 0, "max_steps": steps,
                                              "clip_grad": 1e12, "betas": [0.9, 0.999], "eps": EPS,
                                              "weight_decay": 0.0},
           "deepspeed": {"zero_stage": 3}, "eval": {"every": EVERY}, "checkpoint": {"dir": ckpt},
           "data": {"datasets": [{"path": data, "type": "chatml.prompt_pairs"}], "prepared_path": f"{root}/prep",
                    "val_set_size": len(KTO_HELD)}}
    return config.build(raw, env={}, world_size=WORLD * cp)


def _kto_cp_worker(rank, world, model, data, root):
    """The same rl: kto run with each row split over 2 context-parallel ranks (cp=2 × dp_shard=2: the same two
    data-parallel ranks, so the same micro-batches and KL rows as TRL's two processes)."""
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    lines: list[str] = []
    res = train(_kto_cfg(model, data, f"{root}/cp", cp=2), log=lines.append)
    return res.losses, res.rewards, [ln for ln in lines if ln.startswith("engine:")], res.eval_losses, res.eval_rewards


def _kto_worker(rank, world, model, data, root, rendered, held, lora=True):
    """nd-adapter's rl: kto run, then TRL's KTOTrainer on the same two processes (accelerate over the same gloo
    group, DDP): (nd-adapter's losses and metrics, TRL's per-micro-batch losses on this rank, TRL's logged metrics)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    cfg = _kto_cfg(model, data, root, lora=lora, lr=LR if lora else KTO_FULL_LR)
    lines: list[str] = []
    res = train(cfg, log=lines.append)
    resumed = None
    if not lora:  # saved after 2 steps, resumed to 4: the resumed run's tables from the starting weights again
        ck, lr = f"{root}/ck", KTO_FULL_LR
        train(_kto_cfg(model, data, f"{root}/cut", lora=False, lr=lr, steps=2, ckpt=ck), log=lambda s: None)
        r = train(_kto_cfg(model, data, f"{root}/cut", lora=False, lr=lr, ckpt=ck), resume=True, log=lambda s: None)
        resumed = (r.start_step, r.losses, r.rewards, r.eval_losses, r.eval_rewards)

    torch.manual_seed(cfg.seed)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.config.use_cache = False
    torch.manual_seed(cfg.seed)  # as adapter/modeling/hf_build.add_peft initialises the adapters
    if lora:  # else TRL loads the starting weights again as its frozen reference model
        hf = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    losses: list[float] = []
    logs: list[dict] = []

    class Recorded(KTOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            loss = super()._compute_loss(model, inputs, return_outputs)
            if self.model.training:  # the eval's batches come through here too
                losses.append(float(loss.detach()))
            return loss

        def log(self, logs_, start_time=None):
            super().log(logs_, start_time)
            logs.append(dict(logs_))

    tok = AutoTokenizer.from_pretrained(model)
    tok.pad_token = tok.pad_token or tok.eos_token
    args = KTOConfig(output_dir=f"{root}/trl", per_device_train_batch_size=KTO_MB, gradient_accumulation_steps=GA,
                     max_steps=STEPS, learning_rate=cfg.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=EPS, max_grad_norm=0.0,
                     max_length=SEQ, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=cfg.seed,
                     bf16=False, gradient_checkpointing=False, dataloader_num_workers=0, optim="adamw_torch",
                     remove_unused_columns=False, eval_strategy="steps", eval_steps=EVERY, eval_on_start=True,
                     per_device_eval_batch_size=KTO_MB, **KTO)
    Recorded(model=hf, args=args, train_dataset=Dataset.from_list(rendered), eval_dataset=Dataset.from_list(held),
             processing_class=tok).train()
    return (res.losses, res.rewards, losses, [g for g in logs if "kl" in g], lines,
            res.trained_tokens, (res.eval_losses, res.eval_rewards), [g for g in logs if "eval_loss" in g], resumed)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_kto_matches_trl(tmp_path, lora):
    """`rl: kto` (LoRA, and a full fine-tune against TRL's frozen reference model; dp_shard=2 under ZeRO-3,
    micro-batches of 2 rows, 2 accumulated: 8 rows a step) against TRL 1.8.0's KTOTrainer on the same two processes
    with per_device_train_batch_size 2 and the same accumulation (adapter/train/kto.py: a micro-batch on DP rank r is
    TRL's per-device batch on process r), TRL given the rows in the order Axolotl's shuffle_merged_datasets leaves
    them (nd-adapter's: the seed's permutation): each step's loss and TRL's logged kl, rewards/* and logps/* agree
    (≤ 1e-5) over 4 steps, micro-batches of one label among them (KTO_LABELS); the KL estimate is above 0 by the last
    step, so the clamp is not what makes them agree (and the KL rows' reference values count). 8 rows held out
    (val_set_size, the tail of the shuffled rows) are evaluated before step 1 and every 2 steps, as TRL's evaluate
    with eval_on_start and per_device_eval_batch_size 2 on the same processes: eval_loss, eval_kl (above its clamp)
    and every eval_rewards/* and eval_logps/* agree. The same LoRA run with each row split over 2 context-parallel
    ranks (4 processes) gives TRL's numbers too, evals included. The full fine-tune's reference is a table of the
    starting weights' values of every row and its KL row, computed before step 1 (adapter/train/kto.reference_table;
    the held-out rows': kto.eval_table), computed again by a run resumed after step 2, which stays on the curve."""
    import numpy as np

    from adapter.data.sft.preference_kto import render

    tiny_model(tmp_path, weights=True)
    data = tmp_path / "kto.jsonl"
    cfg = _kto_cfg(str(tmp_path / "model"), str(data), str(tmp_path))
    assert cfg.data.shuffle_merged_datasets  # Axolotl's default: the rows shuffled once with the seed
    assert len(KTO_LABELS) == WORLD * KTO_MB * GA * STEPS and len(KTO_HELD) == 2 * WORLD * KTO_MB
    order = np.random.default_rng(cfg.data.seed).permutation(len(KTO_LABELS) + len(KTO_HELD))
    rows = _kto_rows(order)
    write_jsonl(data, rows)
    rendered = [dict(zip(("prompt", "completion", "label"), render(rows[i], "chatml.prompt_pairs"))) for i in order]
    # Axolotl's split: the tail of the shuffled rows held out (train_test_split, shuffle=False), both in that order
    rendered, held = rendered[:len(KTO_LABELS)], rendered[len(KTO_LABELS):]
    out = run_workers(_kto_worker, WORLD, str(tmp_path / "model"), str(data), str(tmp_path), rendered, held, lora,
                      timeout=300)
    losses, metrics, trl0, logs, lines, trained, evals, trl_evals, resumed = out[0]
    trl1 = out[1][2]
    assert len(trl0) == len(trl1) == STEPS * GA and len(logs) == STEPS, (trl0, logs)
    want = [(sum(trl0[s * GA:(s + 1) * GA]) + sum(trl1[s * GA:(s + 1) * GA])) / (2 * GA) for s in range(STEPS)]
    pairs = list(zip(losses, want))
    for got, log in zip(metrics, logs):
        assert set(got) == {k for k in KTO_METRICS if k in log} == set(KTO_METRICS), (got, log)
        pairs += [(got[k], log[k]) for k in got]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)
    print(f"KTO: max |nd-adapter - TRL| / max(1, |TRL|) over {len(pairs)} losses and metrics: {worst:.2e}")
    assert worst <= 1e-5, [(a, b) for a, b in pairs if abs(a - b) > 1e-5 * max(1.0, abs(b))]
    assert [s for s, _ in evals[0]] == [0, 2, 4] and len(trl_evals) == 3, (evals, trl_evals)  # TRL's eval_on_start
    for (_, loss), (_, got), trl_eval in zip(*evals, trl_evals):
        assert set(got) == set(KTO_METRICS), got
        pairs += [(loss, trl_eval["eval_loss"])] + [(got[k], trl_eval[f"eval_{k}"]) for k in KTO_METRICS]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)
    print(f"KTO with its eval: max |nd-adapter - TRL| / max(1, |TRL|) over {len(pairs)} values: {worst:.2e}")
    assert worst <= 1e-5, [(a, b) for a, b in pairs if abs(a - b) > 1e-5 * max(1.0, abs(b))]
    assert any(" | kl " in ln for ln in lines), lines
    assert any(ln.startswith("eval after step 2 | eval_loss ") and "| 8 eval rows | kl " in ln for ln in lines), lines
    from transformers import AutoTokenizer

    from adapter.data.sft.preference import tokenize

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    per_row = [len(tokenize(tok, r["prompt"], r["completion"], r["completion"])[1]) for r in rendered]
    step = WORLD * KTO_MB * GA  # trained tokens: the rows' completions, not their KL rows'
    assert trained == [sum(per_row[s * step:(s + 1) * step]) for s in range(STEPS)], (trained, per_row)
    assert abs(logs[-1]["rewards/margins"] - logs[0]["rewards/margins"]) > 1e-3
    # the KL estimate above its clamp, so the KL rows' reference values count (a full fine-tune's: its tables)
    assert max(g["kl"] for g in logs) > 1e-4 and max(w["eval_kl"] for w in trl_evals) > 1e-4, (logs, trl_evals)
    if not lora:
        assert any(ln.startswith("KTO reference: the starting weights' log-probabilities of the 32 rows and of the "
                                 "8 held-out rows") for ln in lines), lines
        start, r_losses, r_metrics, r_evals, r_eval_metrics = resumed  # on the uninterrupted run's curve
        assert start == 2 and [s for s, _ in r_evals] == [4], (start, r_evals)
        again = list(zip(r_losses, losses[2:])) + [(g[k], w[k]) for g, w in zip(r_metrics, metrics[2:]) for k in g]
        again += [(r_evals[0][1], evals[0][-1][1])] + [(v, evals[1][-1][1][k]) for k, v in r_eval_metrics[0][1].items()]
        assert max(abs(a - b) / max(1.0, abs(b)) for a, b in again) <= 1e-5, again
        return
    cp_losses, cp_metrics, said, cp_eval, cp_eval_metrics = run_workers(
        _kto_cp_worker, 2 * WORLD, str(tmp_path / "model"), str(data), str(tmp_path), timeout=300)[0]
    pairs = list(zip(cp_losses, want)) + [(got[k], log[k]) for got, log in zip(cp_metrics, logs) for k in KTO_METRICS]
    pairs += [(loss, w["eval_loss"]) for (_, loss), w in zip(cp_eval, trl_evals)]
    pairs += [(got[k], w[f"eval_{k}"]) for (_, got), w in zip(cp_eval_metrics, trl_evals) for k in KTO_METRICS]
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in pairs)
    print(f"KTO at cp=2 x dp_shard=2: max |nd-adapter - TRL| / max(1, |TRL|): {worst:.2e}")
    assert "cp=2 through transformers' attention interface" in said[0], said
    assert len(cp_losses) == STEPS and worst <= 1e-5, [(a, b) for a, b in pairs if abs(a - b) > 1e-5 * max(1.0, abs(b))]


def _four(rank, world, model, data, root, adapter, model64):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    m, d, r = Path(model), Path(data), Path(root)

    def cfg(name: str, par: dict, **kw):
        base = Path(model64) if kw.get("quantize") else m  # NF4 quantises in blocks of 64 input features
        c = _cfg(base, d, r / name, ev=False, engine=kw.pop("engine", "megatron"), **kw)
        raw = c.model_dump(mode="json", exclude_none=True)
        raw["parallelism"] = {**raw["parallelism"], **par}
        raw["batch"] = {**raw["batch"], "gradient_accumulation_steps": 1}  # four pairs a step, as at 2 ranks × GA 2
        raw.pop("notes", None)
        return config.build(raw, env={}, world_size=world)

    out = {}
    for name, par, kw in (("zero3", {"dp_shard_size": 4}, {}),
                          ("hsdp", {"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
                          ("qlora", {"dp_shard_size": 4}, {"init_from": adapter, "quantize": True}),
                          ("qlora hf", {"dp_shard_size": 4}, {"init_from": adapter, "quantize": True,
                                                              "engine": "transformers"})):
        lines: list[str] = []
        res = train(cfg(name.replace(" ", "-"), par, **kw), log=lines.append)
        out[name] = (res.losses, res.rewards, [ln for ln in lines if ln.startswith(("engine:", "lora:"))])
    return out


def test_dpo_at_exact_hsdp_and_qlora_on_both_engines(tmp_path):
    """Four processes: DPO under exact HSDP (dp_replicate=2 × dp_shard=2) gives dp_shard=4's numbers on the native
    engine; QLoRA (the base in NF4) from a saved adapter gives the same numbers on the native engine and on the
    transformers engine (PEFT on bitsandbytes' NF4 layers), so the native NF4 path is checked against PEFT's."""
    from adapter.demo.build import make_tiny_llama
    from tests.helpers.sft import peft_adapter

    tiny_model(tmp_path, weights=True)
    model = tmp_path / "model"
    model64 = make_tiny_llama(tmp_path / "model64", tokenizer_dir=tmp_path / "tok", hidden=64, layers=1, heads=4,
                              kv_heads=2, seed=0)
    data = write_jsonl(tmp_path / "pairs.jsonl", _rows())
    adapter = peft_adapter(str(model64), {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                           tmp_path / "adapter")
    got = run_workers(_four, 4, str(model), str(data), str(tmp_path), str(adapter), str(model64), timeout=400)[0]
    for a, b in (("hsdp", "zero3"), ("qlora", "qlora hf")):
        # accuracy counts r_chosen > r_rejected: where both rewards are zero to within fp32 noise (step 1 from a
        # saved adapter, the policy still its reference) the comparison is a coin toss of the CPU's rounding
        ties = [i for i, r in enumerate(got[b][1]) if max(abs(r["rewards/chosen"]), abs(r["rewards/rejected"])) < 1e-5]
        flat_a = [*got[a][0], *(r[k] for i, r in enumerate(got[a][1]) for k in METRICS
                                if not (k == "rewards/accuracies" and i in ties))]
        flat_b = [*got[b][0], *(r[k] for i, r in enumerate(got[b][1]) for k in METRICS
                                if not (k == "rewards/accuracies" and i in ties))]
        bad = [(i, x, y) for i, (x, y) in enumerate(zip(flat_a, flat_b)) if abs(x - y) > 1e-5 * max(1.0, abs(y))]
        assert len(flat_a) == len(flat_b) and not bad, (a, b, bad)
    assert "Megatron-Core layers" in got["qlora"][2][0] and "transformers' own" in got["qlora hf"][2][0], got
    assert abs(got["qlora"][0][-1] - got["zero3"][0][-1]) > 1e-3  # the NF4 base and the adapter: another curve


def _moe_pairs(rank, world, model, data, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for share in ("auto", False):
        lines: list[str] = []
        res = train(_cfg(Path(model), Path(data), Path(root) / str(share), share=share), log=lines.append)
        out[share] = ([*res.losses, *(r[k] for r in res.rewards for k in METRICS), *(x for _, x in res.eval_losses)],
                      [ln for ln in lines if ln.startswith("pairs:")])
    return out


def test_a_mixture_of_experts_shares_its_prompts_where_no_balancing_loss_trains(tmp_path):
    """A mixture of experts without the load-balancing loss routes each token on its own, so its pairs run each
    prompt once (the transformers engine, which DPO on a mixture of experts takes) with the numbers of one sequence
    per answer: losses, reward metrics, evals."""
    from tests.helpers.sft import make_moe

    tiny_model(tmp_path, weights=True)
    moe = make_moe(tmp_path / "moe", tmp_path / "tok", router_loss=False)
    data = write_jsonl(tmp_path / "pairs.jsonl", _rows())
    got = run_workers(_moe_pairs, WORLD, str(moe), str(data), str(tmp_path), timeout=400)[0]
    (shared, said), (rows, _) = got["auto"], got[False]
    assert said and said[0].startswith("pairs: each pair's prompt runs once"), said
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(shared, rows, strict=True)) if abs(a - b) > 1e-5 * max(1, abs(b))]
    assert not bad, bad
