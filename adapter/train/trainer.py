"""The one training path: groups -> GPTModel -> converted weights -> DeepSpeed ZeRO -> steps -> checkpoints.

Runs in every process of a job (launched by `deepspeed`, `torchrun`, `nd-adapter train` or `nd-adapter rehearse`).
Loss normalisation, in one place: a step's loss is the sum of per-token losses over every trained token of the
optimizer step (all micro-batches, DP and CP ranks) divided by the number of trained tokens of the whole step, on
every layout and for every run; the logged loss is the same quantity. The step's grad-accum micro-batches are
fetched first and their loss masks counted on the host (whole samples, before the CP split), the count is summed
over DP on the device (no host wait), and each micro-batch's local loss sum is divided by it. DeepSpeed's own
averaging is undone: backward runs without its 1/grad_accum (`scale_wrt_gas=False`) and the loss is multiplied by
dp×cp, the ranks its gradient averages span (the partition group dp_shard×cp, or dp×cp with hpZ, and exact HSDP's
average over dp_replicate). Weighting each micro-batch's token mean equally instead would count a one-word answer
as much as a long one and make the result depend on grad-accum and DP size. A step without trained tokens has loss
and gradients 0, not NaN.

The host never waits for the GPU between steps: a step's numbers stay on the device until the next step's first
micro-batch is queued (`PendingStep`), step times come from CUDA events, and the optimizer update and any checkpoint
always follow the read, so a diverged step is never applied or saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from adapter.convert import cache
from adapter.data import build_batches
from adapter.errors import DivergedError, bad
from adapter.modeling import hf_qat
from adapter.models import announce, footprint, lora
from adapter.models.counts import flops_per_token, num_params
from adapter.models.resolved import ResolvedRun
from adapter.parallel import mcore_groups, shared_gpu
from adapter.parallel.layout import Axis
from adapter.patches.zero import set_hpz_group
from adapter.train import best as best_ckpt
from adapter.train import checkpoint as ckpt
from adapter.train import ckpt_info, dpo, metrics, schedule
from adapter.train.batches import load as load_data
from adapter.train.batches import place, trim
from adapter.train.best import Best
from adapter.train.engine import build_engine
from adapter.train.export import export_run
from adapter.train.preempt import Preemption, parse
from adapter.train.profile import StepProfiler
from adapter.train.steps import LOSS, NONFINITE, STOP, PendingStep, held_out_loss, masked_loss_sum, nonfinite


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)   # one per optimizer step, as logged
    grad_norms: list[float | None] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)  # a mixture of experts' load-balancing loss, per step
    trained_tokens: list[int] = field(default_factory=list)  # per step, the whole job's
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (after step, held-out loss)
    start_step: int = 0
    final_step: int = 0
    checkpoint: str | None = None
    exported: str | None = None
    preempted: str | None = None  # the signal that ended the run early (adapter/train/preempt.py)
    stopped_early: bool = False   # early stopping on the eval loss ended it
    best_step: int | None = None  # the best checkpoint, when it was reloaded for the export
    rewards: list[dict] = field(default_factory=list)  # DPO: the step's reward metrics (adapter/train/dpo.py)
    eval_rewards: list[tuple[int, dict]] = field(default_factory=list)  # DPO: (after step, the eval's metrics)


_ANNOUNCED: set[str] = set()  # config notes already said by this process (a rehearsal runs twice)


class Trainer:
    """One run on the already-initialised torch.distributed world: `setup` (sinks, groups, data, schedule, engine
    with its first weights, resume), `train_step` (one optimizer step; reports the previous one after its first
    micro-batch), `report`, `evaluate`, `save`, `fit` (the loop, evaluations, saves, final export). `close` always
    runs. `_data` may also set `val_dataset` (held-out set) and `chat_template` (for the export).

    It receives the run resolved once (adapter/models/resolved.py) and reads every decided fact from it; the one
    replacement is the record with the schedule's numbers written in, once the training set's size is known."""

    def __init__(self, run: ResolvedRun, *, synthetic_data: bool = False, log=print):
        self.run, self.log = run, log
        self.synthetic = synthetic_data or run.cfg.data.synthetic
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.result = RunResult()
        self.best: Best | None = None  # set with the schedule (its patience)
        self.finished_at: int | None = None  # a resumed run that early stopping had ended at this step
        self.sink = self.groups = self.engine = self.preempt = self.moe_aux = None
        self.val_dataset = self.chat_template = self.sft = None
        self.stopping: str | None = None  # the signal the run stops on, once every rank knows it

    # the record's facts, as the loop reads them
    cfg = property(lambda self: self.run.cfg)
    arch = property(lambda self: self.run.arch)
    layout = property(lambda self: self.run.layout)
    lora = property(lambda self: self.run.lora)

    def _flops(self, seq_len: int) -> int:
        """MFU's model FLOPs per token; a LoRA run skips the frozen weights' gradients."""
        return (flops_per_token(self.arch, seq_len) if self.lora is None else
                lora.flops_per_token(self.lora, self.arch, seq_len))

    def _where(self) -> dict:
        """This rank's place for a checkpoint load: its TP rank (and size), its expert-parallel rank (and size)."""
        lay = self.layout
        return {"tp_rank": lay.coords(self.rank)[Axis.TP], "tp": lay.tp, "ep": lay.ep,
                "ep_rank": lay.group_of("ep", self.rank).index(self.rank)}

    def _say(self, *lines: str | None) -> None:
        if self.rank == 0:
            for line in lines:
                if line:
                    self.log(line)

    # --- set-up ---------------------------------------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        """Wire the run: what it says comes from pure functions of the record (adapter/models/announce.py) and of
        what the set-up found (the data, the schedule, a checkpoint)."""
        run, cfg = self.run, self.run.cfg
        self._announce()
        self.preempt = Preemption(cfg.checkpoint.exit_signals)
        if resume and not cfg.checkpoint.dir:
            raise bad("checkpoint.dir", None, "--resume needs a checkpoint directory", "set checkpoint.dir")
        resuming = resume and ckpt.latest_tag(cfg.checkpoint.dir)
        moved = resuming and self._saved_elsewhere(cfg.checkpoint.dir)
        self._say(announce.weights(run, resuming and f"{cfg.checkpoint.dir}/{resuming}", moved))
        # the sinks first: one that is asked for but not installed fails here, before any GPU time is spent
        lg = cfg.logging
        self.sink = metrics.MetricsSink(self.rank, tensorboard_dir=lg.tensorboard, wandb_project=lg.wandb_project,
                                        run_name=lg.wandb_name, wandb_entity=lg.wandb_entity, wandb_mode=lg.wandb_mode,
                                        config=cfg.model_dump(mode="json"))
        self.groups = mcore_groups.initialize(self.layout)
        # converted and checked before the data is prepared; not at all when a checkpoint replaces them anyway. A
        # LoRA checkpoint holds only what is trained, and one resharded brings only that: the frozen part comes from
        # the converted weights again. A DPO reference table is the starting weights' (adapter/train/dpo.py), computed
        # before the checkpoint replaces them: a resumed run needs them too.
        needs_base = (not resuming or self.lora is not None or moved or cfg.fixed_reference()) and run.arch.native
        weights_dir = cache.ready(run.weights, cfg, rank=self.rank, log=self._say) if needs_base else None
        # before the engine: the LR schedule's length needs the data's size
        self.dataset, self.sampler = self._data()
        sched = schedule.resolve(cfg, None if self.synthetic else len(self.dataset),
                                 has_val=self.val_dataset is not None and len(self.val_dataset) > 0)
        self._say(*schedule.describe(cfg, sched))  # before apply: it names the keys the numbers came from
        self.schedule, self.best = sched, Best(sched.patience)
        self.run = run.with_length(schedule.apply(cfg, sched))
        self._check_disk()
        self.engine = build_engine(self.run, self.groups, self.device,
                                   load_weights=lambda model: cache.load(model, weights_dir))
        recomputed = self.engine.recomputed_layers
        if recomputed:  # the transformers engine (the native one says its recompute in the config's lines)
            self._say(f"recompute: transformers' gradient checkpointing on its {recomputed} decoder layers (each "
                      "layer's activations recomputed in backward)")
        self.cp_rank = self.layout.coords(self.rank)[Axis.CP]
        self.ref_table, self.val_ref = dpo.reference_for(self)  # DPO of every weight: its reference, before a resume
        pairs = dpo.sharing_line(self.run)  # padded rows, padding-free, or each prompt once
        if pairs:
            self._say(pairs)
        # what is trained: transformers adds the load-balancing loss when the config says so (either engine's)
        aux = getattr(self.engine.ds.module, "moe_aux", None)
        self.moe_aux = aux if aux is not None and aux.enabled else None
        self.result.start_step = self._resume() if resume else 0
        self.tokens_per_step = self.cfg.global_batch * self.cfg.seq_len
        self.flops_per_token = self._flops(self.cfg.seq_len)
        self.peak_flops = metrics.peak_flops()
        self.profiler = StepProfiler(lg.profile_steps, lg.profile_dir, self.rank, tuple(lg.profile_ranks))
        self.clock = metrics.StepClock(self.device.type == "cuda")

    def _announce(self) -> None:
        """The run's first lines: the record's announcements (what `plan` printed as its notes), then its warnings.
        The dialect's notes are said once per process (a rehearsal runs twice)."""
        first = [line for line in announce.announce(self.run, gpu=self.device.type == "cuda") if line not in _ANNOUNCED]
        _ANNOUNCED.update(self.cfg.notes)
        if self.device.type == "cpu":  # a GPU run started where no GPU is visible must not pass unnoticed
            first.insert(len([n for n in first if n in self.cfg.notes]),
                         "device: CPU (no GPU is visible to this process): training on the CPU with gloo")
        elif shared_gpu.on():  # every rank on one GPU: a correctness mode (adapter/parallel/shared_gpu.py)
            first.insert(len([n for n in first if n in self.cfg.notes]), shared_gpu.note(self.world))
        self._say(*first, *(f"warning: {w}" for w in self.run.warnings))

    def _resume(self) -> int:
        """Load the newest checkpoint of checkpoint.dir (weights, optimizer, sampler, best); its step, or 0."""
        cfg = self.cfg
        ckpt_info.check_resumable(cfg, self.arch.architecture)  # in-process runs skip the preflight
        loaded = ckpt.load(self.engine.ds, cfg.checkpoint.dir, trained_only=self.run.adapters, arch=self.arch,
                           **self._where())
        if loaded is None:
            self._say(f"no checkpoint in {cfg.checkpoint.dir}: starting from step 0")
            return 0
        start, state = loaded
        self.sampler.load_state_dict(state["sampler"])
        self.best.load_state_dict(state.get("best", {}))
        self.finished_at = ckpt.stopped_early(cfg.checkpoint.dir, getattr(self.engine.ds, "_nd_lineage", None),
                                              cfg.eval.early_stopping_patience)
        old, new = self.engine.follow_schedule(cfg)
        self._say(*announce.resumed(self.run, start, old, new))
        return start

    def _saved_elsewhere(self, directory: str) -> str | None:
        """How the newest checkpoint's layout differs from this run's (None: the same, or not recorded)."""
        record = ckpt_info.read(directory).record
        if not record:
            return None
        diff = ckpt_info.layout_diff(record["layout"], ckpt_info.layout_of(self.cfg))
        return ", ".join(f"{k} {there}" for k, there, _ in diff) or None

    def _check_disk(self) -> None:
        """Before the model is built: the checkpoints this run will keep must fit where they go (one line if not)."""
        run, every = self.run, self.schedule.save_every
        d = run.cfg.checkpoint.dir
        existing = len(list(Path(d).glob("global_step*"))) if d else 0
        saves = footprint.saves(run.cfg.optimizer.max_steps, every) if d else 0
        often = footprint.cadence_warning(run, stage=run.zero_stage, every=every)
        self._say(footprint.check_disk(run, stage=run.zero_stage, existing=existing, saves=saves),
                  often and f"warning: {often}")

    def _data(self):
        """This rank's training set and its sampler (adapter/train/batches.py); sets the held-out set, the chat
        template and the prepared SFT data beside them."""
        d = load_data(self.run, self.rank, synthetic=self.synthetic, log=self._say)
        self.val_dataset, self.chat_template, self.sft = d.val, d.chat_template, d.sft
        return d.dataset, d.sampler

    def _trim(self, b, eval: bool = False):
        return trim(self.run, self.sft is not None, b, eval)

    def _on_device(self, b):
        return place(self.run, self.cp_rank, self.device, b)

    def _loss_sum(self, batch):
        """Σ per-token loss × loss_mask over this rank's slice of the micro-batch (fp32)."""
        return masked_loss_sum(self.engine.ds, batch, moe=self.arch.moe or self.moe_aux is not None)

    # --- one step -------------------------------------------------------------------------------------------------
    def train_step(self, step: int, batches, previous: PendingStep | None) -> PendingStep:
        """One optimizer step over grad-accum micro-batches from `batches`. The previous step's numbers are read
        (`report`) after this step's first micro-batch is queued, before its optimizer update."""
        engine, ds, device, layout = self.engine, self.engine.ds, self.device, self.layout
        lr = ds.optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves on inside its last ds.step()
        hf_qat.at_step(self.engine.ds.module, self.cfg.qat, step)  # QAT's fake quantisation from its step on
        self.profiler.begin(step)
        self.clock.begin()
        pairs = self.cfg.objective != "sft"  # preference pairs: each micro-batch's rows chosen, then rejected
        micro = [self._trim(dpo.flat(next(batches)) if pairs else next(batches)) for _ in range(self.cfg.grad_accum)]
        norm = dpo.step_norm(self, micro) if pairs else None  # the step's pairs (and chosen NLL tokens)
        rewards = 0
        tokens = torch.tensor([sum(float(dpo.trained(b).double().sum()) for b in micro),  # waits for nothing
                               sum(dpo.computed(self.run, b) for b in micro)], dtype=torch.float64).to(device,
                                                                                                     non_blocking=True)
        dist.all_reduce(tokens, group=self.groups.dp)  # whole samples: tp/cp ranks of a dp rank count the same
        denom = torch.clamp(tokens, min=1.0)[0]  # a step without trained tokens: loss and gradients 0, not NaN
        # undo DeepSpeed's gradient averages over dp_shard×cp (or dp×cp) and exact HSDP's over dp_replicate
        undo_average = layout.dp * layout.cp
        # the step's loss, grad norm inf/NaN, a mixture of experts' load-balancing loss (Σ over micro-batches)
        summed = torch.zeros(3, dtype=torch.float64, device=device)
        aux = self.moe_aux
        if aux is not None:  # transformers adds coef·aux to every micro-batch's loss of every DP process, unaveraged:
            aux.scale = undo_average  # its gradient survives DeepSpeed's average over dp×cp as the CE's does
        for b in micro:
            batch = self._on_device(b)
            with record_function("nd.forward"):
                if pairs:  # Σ per-pair loss / the step's pairs (adapter/train/dpo.py)
                    local, sums = dpo.step_terms(self, batch, norm)
                    rewards = rewards + sums
                else:
                    local = self._loss_sum(batch) / denom.float()
                if aux is not None:  # the same on every CP and TP rank of the micro-batch: counted once over CP
                    summed[2] += aux.value().double() / layout.cp
            with record_function("nd.backward"):  # the transformers engine's load-balancing term: with its graph
                attached = aux.attached() if aux is not None else 0.0
                ds.backward((local + attached) * undo_average, scale_wrt_gas=False)
                engine.after_backward()
            if previous is not None:
                self.report(previous)
                previous = None
            with record_function("nd.step"):
                ds.step()
            # a preference loss is the same on every CP rank (adapter/train/dpo.py), SFT's sums are disjoint
            summed[LOSS] += local.detach().double() / (layout.cp if pairs else 1)
        gn = ds.get_global_grad_norm()
        if engine.guard_grads:
            summed[NONFINITE] = nonfinite(gn, device)
        dist.all_reduce(summed, group=self.groups.dp_cp)  # dp and cp ranks hold disjoint tokens: their sum is it
        if isinstance(gn, torch.Tensor):  # already global: it joins the vector after the sum
            tail, gn = torch.cat([gn.detach().double().reshape(1), torch.ones(1, dtype=torch.float64,
                                                                              device=device)]), None
        else:
            tail = torch.zeros(2, dtype=torch.float64, device=device)
        # a preemption signal noted on any rank reaches all of them here, with the step's numbers
        stop = torch.tensor([1.0 if self.preempt.received else 0.0], dtype=torch.float64).to(device,
                                                                                            non_blocking=True)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        aux_mean = summed[2:] / (layout.dp * self.cfg.grad_accum)
        pending = PendingStep(step, metrics.HostReadback(torch.cat([summed[:2], tokens, tail, stop, aux_mean])), gn,
                              lr, self.clock.end())
        if pairs:  # TRL's metrics, as sums over the step's pairs (dpo.step_metrics divides)
            dist.all_reduce(rewards, group=self.groups.dp)
            pending.extra = metrics.HostReadback(rewards)
        if self.profiler.finish(step):
            self.clock.reset()  # writing the trace is not training time
        return pending

    def report(self, pending: PendingStep) -> None:
        """Read a step's numbers on the host: divergence check, loss, log line. Runs while the next step's first
        micro-batch is already queued (so the GPU never drains), always before that step's optimizer update and
        before any checkpoint."""
        s = pending.read()
        if pending.values.values()[STOP] > 0 and self.stopping is None:
            self.stopping = self.preempt.received or "a signal to another rank"
        if not math.isfinite(s.loss):
            raise DivergedError(f"the loss is {s.loss} at step {s.step}; stopping before the next step or checkpoint. "
                                "Lower optimizer.lr or raise optimizer.warmup_steps")
        if s.nonfinite_grad:
            raise DivergedError(f"the gradient norm is inf/NaN at step {s.step} (loss {s.loss:.4f}); stopping before "
                                "the next step or checkpoint. Lower optimizer.lr or raise optimizer.warmup_steps; "
                                "deepspeed.overrides: {bf16: {check_grad_overflow: true}} skips such steps instead")
        self.result.losses.append(s.loss)
        if self.moe_aux is not None:
            self.result.aux_losses.append(s.aux_loss)
        self.result.grad_norms.append(s.grad_norm)
        self.result.trained_tokens.append(s.trained_tokens)
        rewards = dpo.step_metrics(self.cfg, pending.extra.values()) if pending.extra is not None else {}
        self.result.rewards += [rewards] if rewards else []
        max_steps = self.cfg.optimizer.max_steps
        if s.step % self.cfg.logging.every == 0 or s.step == max_steps:
            tps = metrics.tokens_per_s_per_gpu(s.computed_tokens, s.seconds, self.world)
            trained = metrics.tokens_per_s_per_gpu(s.trained_tokens, s.seconds, self.world)
            flops = self.flops_per_token
            if s.computed_tokens != self.tokens_per_step:  # trimmed: attention's share follows the length run
                flops = self._flops(max(1, s.computed_tokens // self.cfg.global_batch))
            m = metrics.mfu(tps, flops, self.peak_flops)
            self._say(metrics.format_step(s.step, loss=s.loss, lr=s.lr, grad_norm=s.grad_norm, tokens_per_s_gpu=tps,
                                          mfu=m, peak_mem=metrics.peak_memory_bytes(), total_steps=max_steps,
                                          trained_tokens_per_s_gpu=trained)
                      + (f" | {dpo.line(rewards)}" if rewards else ""))
            extra = {"aux_loss": s.aux_loss} if self.moe_aux is not None else {}
            if extra:
                self._say(f"step {s.step}: load-balancing aux_loss {s.aux_loss:.4f} (× router_aux_loss_coef "
                          f"{self.moe_aux.coef:g} added to every micro-batch's loss)")
            self.sink.log(s.step, {"loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm, "tokens_per_s_per_gpu": tps,
                                   "trained_tokens_per_s_per_gpu": trained, "trained_tokens": s.trained_tokens,
                                   "mfu": m, **extra, **rewards})

    def _eval(self, step: int) -> bool:
        """Evaluate after `step`; True when early stopping ends the run here."""
        pairs = self.cfg.objective != "sft"  # TRL's eval of preference pairs (adapter/train/dpo.py)
        loss, count, extra = dpo.evaluate(self) if pairs else held_out_loss(self)
        if loss is None:
            self._say(f"eval after step {step}: the held-out set has no trained tokens")
            return False
        self.result.eval_losses.append((step, loss))
        what = (f"{count} eval {'rows' if self.cfg.objective == 'kto' else 'pairs'} | {dpo.line(extra)}" if pairs else
                f"{len(self.val_dataset)} eval samples, {count:,} trained tokens" + "".join(
                    f" | eval_{k} {v:.4f}" for k, v in extra.items()))
        self._say(f"eval after step {step} | eval_loss {loss:.4f} | {what}")
        self.result.eval_rewards += [(step, extra)] if extra else []  # (a token classifier's: its accuracy)
        self.sink.log(step, {"eval_loss": loss, **{f"eval_{k}": v for k, v in extra.items()}})
        return self.best.observe(step, loss)

    def save(self, step: int) -> str:
        layout = self.layout
        # exact HSDP's replicas hold the same shards under the same file names: one replica writes. hpZ's ranks
        # each hold their own (its partition is all of dp×cp), so all of them write.
        hsdp = layout.dp_replicate > 1 and self.cfg.deepspeed.replicate_mode == "hsdp"
        save_ranks = (lambda r: layout.coords(r)[Axis.DP_REPLICATE] == 0) if hsdp else None
        record = {"layout": ckpt_info.layout_of(self.cfg), "world_size": self.world,
                  "zero_stage": self.run.zero_stage,
                  "model": {"architecture": self.arch.architecture, "params": num_params(self.arch)},
                  "holds": "adapters" if self.run.adapters else "all trained parameters",
                  "optimizer": self.cfg.optimizer.name}
        self.best.on_save(step)
        state = {"sampler": self.sampler.state_dict(), "best": self.best.state_dict()}
        path = str(ckpt.save(self.engine.ds, self.cfg.checkpoint.dir, step, state,
                             keep_last=self.cfg.checkpoint.keep_last, save_ranks=save_ranks,
                             trained_only=self.run.adapters, record=record,
                             protect=self.best.saved if self.schedule.load_best else None))
        self.clock.reset()  # the save is not training time
        return path

    # --- the loop -------------------------------------------------------------------------------------------------
    def fit(self, export: bool = True) -> RunResult:
        cfg, result, sched = self.cfg, self.result, self.schedule
        start, max_steps = result.start_step, cfg.optimizer.max_steps
        save_every, eval_every = cfg.checkpoint.save_every, sched.eval_every
        # image-text rows are rendered by their processor at collate time: on a GPU, ahead in a worker process (on
        # CPU processes a worker would take the cores the model runs on)
        d, cuda = cfg.data, self.device.type == "cuda"
        workers = d.num_workers if d.num_workers is not None else int(cuda and hasattr(self.dataset, "collate"))
        batches = build_batches(self.dataset, self.sampler, workers=workers, prefetch=d.prefetch_factor,
                                pin=d.pin_memory and cuda, stop_signals=tuple(parse(cfg.checkpoint.exit_signals)))
        self.preempt.stop_at_step_boundaries()  # until here a signal ended the job at once: nothing to save yet
        pending: PendingStep | None = None  # the last step, until its numbers are read on the host
        if self.finished_at is not None:  # the resumed run had ended by early stopping: nothing more to train
            self._say(f"finished: early stopping ended this run after step {self.finished_at} (eval.early_stopping_"
                      f"patience {sched.patience}); nothing to train. To train on, raise or remove the patience")
            result.final_step, result.stopped_early = start, True
            return result
        self.engine.ds.train()
        if sched.eval_at_start and start == 0 and max_steps > 0:
            self._eval(0)
        evaluated, last = None, max_steps
        for step in range(start + 1, max_steps + 1):
            pending = self.train_step(step, batches, pending)
            do_eval = bool(eval_every) and step % eval_every == 0
            do_save = bool(cfg.checkpoint.dir and save_every) and step % save_every == 0
            if do_eval or do_save:
                self.report(pending)
                pending = None
            stop = False
            if do_eval:
                stop = self._eval(step)
                evaluated = step
            if do_save:
                result.checkpoint = self.save(step)
            if stop and step < max_steps:  # as HF: no save at this step beyond the cadence's
                self._say(f"early stopping after step {step}: {self.best.stale} evaluations in a row without an "
                          f"eval loss below {self.best.loss:.4f} (step {self.best.step})")
                last, result.stopped_early = step, True
                if cfg.checkpoint.dir:  # a --resume of this run then says it has finished
                    lineage = ckpt.run_lineage(self.engine.ds)
                    if self.rank == 0:
                        ckpt.write_stopped_early(cfg.checkpoint.dir, step, lineage, sched.patience)
                break
            if self.stopping is not None and step < max_steps:  # every rank sees it at the same step
                if pending is not None:
                    self.report(pending)
                if cfg.checkpoint.dir and not do_save:
                    result.checkpoint = self.save(step)
                result.final_step, result.preempted = step, self.stopping
                return result
        if pending is not None:
            self.report(pending)
        if sched.eval_at_end and last > start and evaluated != last:
            self._eval(last)
        if self.device.type == "cuda" and self.rank == 0:
            self.log(metrics.memory_summary())
        result.final_step = max(start, last)
        if cfg.checkpoint.dir and last == max_steps > start and (not save_every or max_steps % save_every):
            result.checkpoint = self.save(max_steps)
        if sched.load_best:
            best_ckpt.load(self, result.final_step)
        best_ckpt.keep_only(self)
        if export and cfg.checkpoint.export_hf:
            result.exported = str(export_run(self))
        return result

    def close(self) -> None:
        if self.preempt is not None:
            self.preempt.restore()
        if self.sink is not None:
            self.sink.close()  # also when training stops early: the events written so far are flushed
        if self.groups is not None:
            mcore_groups.destroy()
        set_hpz_group(None)


def run(resolved: ResolvedRun, *, resume: bool = False, synthetic_data: bool = False, log=print,
        export: bool = True) -> RunResult:
    """Train the resolved run (adapter/train/worker.py resolves it once per process) on the already-initialised
    torch.distributed world. Returns what rank 0 logged."""
    trainer = Trainer(resolved, synthetic_data=synthetic_data, log=log)
    try:
        trainer.setup(resume)
        return trainer.fit(export)
    finally:
        trainer.close()


__all__ = ["run", "Trainer", "RunResult"]
