"""The one training path: groups -> GPTModel -> converted weights -> DeepSpeed ZeRO -> steps -> checkpoints.

Runs in every process of a job (launched by `deepspeed`, `torchrun`, `nd-adapter train` or `nd-adapter rehearse`).
Loss scaling, in one place: each micro-batch's loss is its token mean; DeepSpeed divides by grad-accum steps and
averages gradients over its partition group (dp_shard×cp, or dp×cp with hpZ), so the loss is multiplied by cp
(cp ranks hold disjoint token slices of one sample), and exact HSDP averages the gradient partitions over
dp_replicate. The result is the mean over samples of the per-sample token-mean loss, on every layout.

The host never waits for the GPU between steps: a step's numbers stay on the device until the next step's first
micro-batch is queued (`PendingStep`), step times come from CUDA events, and the optimizer update and any checkpoint
always follow the read, so a diverged step is never applied or saved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from adapter.config import RunConfig
from adapter.errors import DivergedError, UserError, bad
from adapter.models import checks
from adapter.models.arch import ModelArch, load_arch
from adapter.parallel import mcore_groups
from adapter.parallel.layout import Axis, Layout


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)   # one per optimizer step, as logged
    start_step: int = 0
    final_step: int = 0
    checkpoint: str | None = None
    exported: str | None = None


@dataclass(frozen=True)
class StepStats:
    """One optimizer step's numbers, on the host."""
    step: int
    loss: float                  # the step's loss, as logged
    nonfinite_grad: bool         # the global grad norm was inf/NaN
    grad_norm: float | None      # None when DeepSpeed computed none (no clipping)
    lr: float
    seconds: float


# The device-side vector a step's numbers travel in: one all-reduce and one host copy, read one micro-batch late.
LOSS_SUM, MICRO_BATCHES, NONFINITE, GRAD_NORM, GRAD_NORM_ON_DEVICE = range(5)


@dataclass
class PendingStep:
    """A finished step whose numbers are still on their way to the host (metrics.HostReadback)."""
    step: int
    values: object               # HostReadback of the float64 vector indexed above
    host_grad_norm: float | None  # DeepSpeed's global grad norm when it is a host float (or None), else unused
    lr: float
    clock: tuple                 # metrics.StepClock handle

    def read(self, cp: int) -> StepStats:
        from adapter.train.metrics import StepClock

        v = self.values.values()
        grad_norm = v[GRAD_NORM] if v[GRAD_NORM_ON_DEVICE] else (
            None if self.host_grad_norm is None else float(self.host_grad_norm))
        return StepStats(self.step, v[LOSS_SUM] / (v[MICRO_BATCHES] / cp), v[NONFINITE] > 0, grad_norm, self.lr,
                         StepClock.seconds(self.clock))


def arch_for(cfg: RunConfig) -> ModelArch:
    ckpt = cfg.model.checkpoint
    if ckpt and (Path(ckpt) / "hf" / "config.json").is_file():
        return load_arch(Path(ckpt) / "hf")
    return load_arch(cfg.model.path)


def tokenizer_dir(cfg: RunConfig) -> Path:
    for cand in (Path(cfg.model.checkpoint) / "hf" if cfg.model.checkpoint else None, Path(cfg.model.path)):
        if cand is not None and cand.is_dir() and any(cand.glob("tokenizer*")):
            return cand
    raise bad("model.path", cfg.model.path, "no tokenizer files found there (or in the checkpoint's hf/)",
              "point model.path at the HF checkpoint directory that holds the tokenizer")


def masked_loss_sum(model, batch):
    """Σ loss_mask · per-token loss of one micro-batch (fp32 scalar). A model built with the fused linear
    cross-entropy returns that sum itself when handed the loss_mask (no [tokens × vocab] logits); others return
    per-token losses, summed here. Packed documents travel as `packed_seq_params` (adapter/models/packed.py)."""
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"],
                packed_seq_params=batch.get("packed_seq_params"))
    return out.float() if out.dim() == 0 else (out.float() * batch["loss_mask"]).sum()


def _nonfinite(grad_norm, device):
    """1.0 on the device when DeepSpeed's grad norm is inf/NaN (ZeRO-1/2 mask it to -1), else 0.0; no host sync."""
    import torch

    if grad_norm is None:  # no clipping: DeepSpeed computed no norm
        return torch.zeros((), dtype=torch.float64, device=device)
    g = torch.as_tensor(grad_norm, dtype=torch.float64, device=device)
    return (~torch.isfinite(g) | (g < 0)).double()


class Trainer:
    """One run on the already-initialised torch.distributed world: `setup` (sinks, groups, engine, data, resume),
    `train_step` (one optimizer step; reports the previous one after its first micro-batch), `report`, `save`,
    `fit` (the loop, final save and export). `close` always runs."""

    def __init__(self, cfg: RunConfig, *, arch: ModelArch | None = None, synthetic_data: bool = False, log=print):
        import torch
        import torch.distributed as dist

        self.cfg, self.log = cfg, log
        self.synthetic = synthetic_data or cfg.data.synthetic
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.arch = arch or arch_for(cfg)
        self.layout = Layout.from_config(cfg.parallelism)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.result = RunResult()
        self.sink = self.groups = self.engine = None

    # --- set-up ---------------------------------------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        from adapter.train import checkpoint as ckpt
        from adapter.train import metrics
        from adapter.train.engine import build_engine
        from adapter.train.profile import StepProfiler

        cfg, rank = self.cfg, self.rank
        for w in checks.check(cfg, self.arch):
            if rank == 0:
                self.log(f"warning: {w}")
        # the sinks first: one that is asked for but not installed fails here, before any GPU time is spent
        self.sink = metrics.MetricsSink(rank, tensorboard_dir=cfg.logging.tensorboard,
                                        wandb_project=cfg.logging.wandb_project, config=cfg.model_dump(mode="json"))
        self.groups = mcore_groups.initialize(self.layout)
        self.engine = build_engine(cfg, self.arch, self.layout, self.groups, self.device)
        self.dataset, self.sampler = self._data()
        start = 0
        if resume:
            if not cfg.checkpoint.dir:
                raise bad("checkpoint.dir", None, "--resume needs a checkpoint directory", "set checkpoint.dir")
            loaded = ckpt.load(self.engine.ds, cfg.checkpoint.dir)
            if loaded is not None:
                start, state = loaded
                self.sampler.load_state_dict(state["sampler"])
            elif rank == 0:
                self.log(f"no checkpoint in {cfg.checkpoint.dir}: starting from step 0")
        self.result.start_step = start
        self.cp_rank = self.layout.coords(rank)[Axis.CP]
        self.tokens_per_step = cfg.global_batch * cfg.seq_len
        self.flops_per_token = metrics.flops_per_token_for(self.arch, cfg.seq_len)
        self.peak_flops = metrics.peak_flops()
        lg = cfg.logging
        self.profiler = StepProfiler(lg.profile_steps, lg.profile_dir, rank, tuple(lg.profile_ranks))
        self.clock = metrics.StepClock(self.device.type == "cuda")

    def _data(self):
        """Packed, resumable batches for this rank's data shard: SFT datasets (masked examples, `self.val_dataset`
        held out), pretraining text, or synthetic tokens when the run has no data."""
        import torch.distributed as dist

        from adapter.data import DPSampler, PackedDataset, SyntheticData, build_token_cache

        cfg = self.cfg
        self.val_dataset = self.sft = None
        if cfg.data.datasets and not self.synthetic:
            from adapter.data.sft import prepare
            from adapter.data.sft.report import stats_lines

            self.sft = prepare(cfg, tokenizer_dir(cfg), builder=self.rank == 0, barrier=dist.barrier,
                               progress=self.rank == 0)
            dataset, self.val_dataset = self.sft.train, self.sft.val
            if self.rank == 0:
                for line in stats_lines(self.sft):
                    self.log(line.strip())
        elif self.synthetic:
            dataset = SyntheticData(self.arch.vocab_size, cfg.seq_len, cfg.seed, doc_len=cfg.data.synthetic_doc_len)
        else:
            if not cfg.data.files:
                raise bad("data.files", [], "no training data given", "list jsonl/txt/parquet files under data.files")
            cache = cfg.data.cache_dir or str(Path(cfg.checkpoint.dir or ".") / "token-cache")
            tok = build_token_cache(cfg.data.files, tokenizer_dir(cfg), cache, text_key=cfg.data.text_key,
                                    builder=self.rank == 0, barrier=dist.barrier, progress=self.rank == 0)
            dataset = PackedDataset(tok, cfg.seq_len)
        sampler = DPSampler(len(dataset), dp_rank=self.layout.data_rank(self.rank), dp_size=self.layout.dp,
                            micro_batch=cfg.batch.micro_batch_size, seed=cfg.data.seed)
        return dataset, sampler

    def _next_batch(self, it):
        """This rank's part of the next micro-batch and the FULL micro-batch's trained-token count. Documents
        (cfg.document_attention) become one packed stream with its PackedDocs under "packed_seq_params"."""
        import torch

        from adapter.models.attention import split_for_cp
        from adapter.models.packed import local_multiple, pack_batch

        b = next(it)
        tokens_total = b["loss_mask"].sum()
        packed = None
        if self.cfg.document_attention:
            sp_tp = self.layout.tp if self.cfg.use_sequence_parallel else 1
            b, packed = pack_batch(b, cp_size=self.layout.cp, cp_rank=self.cp_rank,
                                   multiple=local_multiple(self.cfg.seq_len, self.layout.cp, sp_tp))
        elif self.layout.cp > 1:
            b = {k: split_for_cp(v, self.layout.cp, self.cp_rank, seq_dim=1) for k, v in b.items()}
        b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
        # non_blocking: a blocking host->device copy would wait for every kernel queued so far (the previous step)
        if packed is not None:
            b["packed_seq_params"] = packed.to(self.device)
        return b, torch.clamp(tokens_total, min=1).to(self.device, non_blocking=True)

    # --- one step -------------------------------------------------------------------------------------------------
    def train_step(self, step: int, batches, previous: PendingStep | None) -> PendingStep:
        """One optimizer step over grad-accum micro-batches from `batches`. The previous step's numbers are read
        (`report`) after this step's first micro-batch is queued, before its optimizer update."""
        import torch
        import torch.distributed as dist
        from torch.profiler import record_function

        from adapter.train import metrics

        engine, ds, device, cp = self.engine, self.engine.ds, self.device, self.layout.cp
        self.profiler.begin(step)
        self.clock.begin()
        # sum of micro-batch mean losses, their count, and whether the step's grad norm was inf/NaN
        summed = torch.zeros(3, dtype=torch.float64, device=device)
        for _ in range(self.cfg.grad_accum):
            batch, ntok = self._next_batch(batches)
            with record_function("nd.forward"):
                local = masked_loss_sum(ds, batch) / ntok
            with record_function("nd.backward"):
                ds.backward(local * cp)
                engine.after_backward()
            if previous is not None:
                self.report(previous)
                previous = None
            with record_function("nd.step"):
                ds.step()
            summed[:2] += torch.stack([local.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        gn = ds.get_global_grad_norm()
        if engine.guard_grads:
            summed[NONFINITE] = _nonfinite(gn, device)
        dist.all_reduce(summed, group=self.groups.dp_cp)  # cp ranks hold slices of one sample's mean: their sum is it
        if isinstance(gn, torch.Tensor):  # already global: it joins the vector after the sum
            tail, gn = torch.cat([gn.detach().double().reshape(1), torch.ones(1, dtype=torch.float64,
                                                                              device=device)]), None
        else:
            tail = torch.zeros(2, dtype=torch.float64, device=device)
        pending = PendingStep(step, metrics.HostReadback(torch.cat([summed, tail])), gn,
                              ds.optimizer.param_groups[0]["lr"], self.clock.end())
        if self.profiler.finish(step):
            self.clock.reset()  # writing the trace is not training time
        return pending

    def report(self, pending: PendingStep) -> None:
        """Read a step's numbers on the host: divergence check, loss, log line. Runs while the next step's first
        micro-batch is already queued (so the GPU never drains), always before that step's optimizer update and
        before any checkpoint."""
        from adapter.train import metrics

        s = pending.read(self.layout.cp)
        if not math.isfinite(s.loss):
            raise DivergedError(f"the loss is {s.loss} at step {s.step}; stopping before the next step or checkpoint. "
                                "Lower optimizer.lr or raise optimizer.warmup_steps")
        if s.nonfinite_grad:
            raise DivergedError(f"the gradient norm is inf/NaN at step {s.step} (loss {s.loss:.4f}); stopping before "
                                "the next step or checkpoint. Lower optimizer.lr or raise optimizer.warmup_steps; "
                                "deepspeed.overrides: {bf16: {check_grad_overflow: true}} skips such steps instead")
        self.result.losses.append(s.loss)
        max_steps = self.cfg.optimizer.max_steps
        if s.step % self.cfg.logging.every == 0 or s.step == max_steps:
            tps = metrics.tokens_per_s_per_gpu(self.tokens_per_step, s.seconds, self.world)
            m = metrics.mfu(tps, self.flops_per_token, self.peak_flops)
            if self.rank == 0:
                self.log(metrics.format_step(s.step, loss=s.loss, lr=s.lr, grad_norm=s.grad_norm, tokens_per_s_gpu=tps,
                                             mfu=m, peak_mem=metrics.peak_memory_bytes(), total_steps=max_steps))
            self.sink.log(s.step, {"loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm, "tokens_per_s_per_gpu": tps,
                                   "mfu": m})

    def save(self, step: int) -> str:
        from adapter.train import checkpoint as ckpt

        layout = self.layout
        save_ranks = (lambda r: layout.coords(r)[Axis.DP_REPLICATE] == 0) if layout.dp_replicate > 1 else None
        path = str(ckpt.save(self.engine.ds, self.cfg.checkpoint.dir, step, {"sampler": self.sampler.state_dict()},
                             keep_last=self.cfg.checkpoint.keep_last, save_ranks=save_ranks))
        self.clock.reset()  # the save is not training time
        return path

    # --- the loop -------------------------------------------------------------------------------------------------
    def fit(self, export: bool = True) -> RunResult:
        from adapter.data import build_batches
        from adapter.train import metrics

        cfg, result = self.cfg, self.result
        start, max_steps = result.start_step, cfg.optimizer.max_steps
        batches = build_batches(self.dataset, self.sampler)
        pending: PendingStep | None = None  # the last step, until its numbers are read on the host
        self.engine.ds.train()
        for step in range(start + 1, max_steps + 1):
            pending = self.train_step(step, batches, pending)
            if cfg.checkpoint.dir and cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0:
                self.report(pending)
                pending = None
                result.checkpoint = self.save(step)
        if pending is not None:
            self.report(pending)
        if self.device.type == "cuda" and self.rank == 0:
            self.log(metrics.memory_summary())
        result.final_step = max(start, max_steps)
        if cfg.checkpoint.dir and max_steps > start and (not cfg.checkpoint.save_every
                                                         or max_steps % cfg.checkpoint.save_every):
            result.checkpoint = self.save(max_steps)
        if export and cfg.checkpoint.export_hf:
            from adapter.train.export import export_hf

            result.exported = str(export_hf(self.engine.ds, self.arch, cfg, cfg.checkpoint.export_hf, rank=self.rank))
            if self.rank == 0:
                self.log(f"exported HF checkpoint to {result.exported}")
        return result

    def close(self) -> None:
        from adapter.patches.zero import set_hpz_group

        if self.sink is not None:
            self.sink.close()  # also when training stops early: the events written so far are flushed
        if self.groups is not None:
            mcore_groups.destroy()
        set_hpz_group(None)


def run(cfg: RunConfig, *, resume: bool = False, synthetic_data: bool = False, arch: ModelArch | None = None,
        log=print, export: bool = True) -> RunResult:
    """Train on the already-initialised torch.distributed world. Returns what rank 0 logged."""
    trainer = Trainer(cfg, arch=arch, synthetic_data=synthetic_data, log=log)
    try:
        trainer.setup(resume)
        return trainer.fit(export)
    finally:
        trainer.close()


__all__ = ["run", "Trainer", "RunResult", "StepStats", "PendingStep", "UserError"]
