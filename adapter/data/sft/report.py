"""`nd-adapter preprocess`: build (or reuse) the prepared SFT data the run will use, print what it holds, and with
`--debug` the (token, label) pairs of a few samples, as Axolotl's `preprocess --debug` shows them: the label is
the token itself where it is a trained target (a process reward model's: its class), -100 where it is not (the
first token of an example never is)."""
from __future__ import annotations

import numpy as np

from adapter import config
from adapter.data.sft.prepare import load_tokenizer, prepare
from adapter.errors import bad
from adapter.models import source

IGNORE = -100


def stats_lines(data) -> list[str]:
    s = data.stats
    out = [f"prepared data: {data.path} ({'reused' if data.reused else 'built'})"]
    for d in s["datasets"]:
        over = (f"{d['dropped_too_long']} over-long dropped" if "dropped_too_long" in d
                else f"{d['truncated']} over-long truncated")
        out.append(f"  {d['dataset']} {d['type']:<13} {d['path']}: {d['rows']} rows -> {d['examples']} examples, "
                   f"{over}, " + (f"{d['too_short']} too short dropped, " if d.get("too_short") else "")
                   + f"{d['no_trained_token']} without a trained token skipped, {d['kept']} kept "
                   f"({d['trained_tokens']:,} trained of {d['tokens']:,} tokens)")
    for name in ("train", "val"):
        if name in s:
            t = s[name]
            out.append(f"  {name}: {t['examples']} examples in {t['bins']} samples of {data.train.seq_len} tokens "
                       f"({'packed' if t['packed'] else 'one example each'}), packing efficiency "
                       f"{100 * t['packing_efficiency']:.1f}%, {t['trained_tokens']:,} trained tokens of "
                       f"{t['tokens']:,}")
    out += [f"  note: {n}" for n in data.notes]
    return out


def debug_lines(data, tok, samples: int = 3) -> list[str]:
    """(token, label) per token of the first examples of the first samples (unshifted, HF/Axolotl convention)."""
    out = []
    for i in range(min(samples, len(data.train))):
        item, bounds = data.train[i], data.train.examples(i)
        for k in range(len(bounds) - 1):
            a, b = int(bounds[k]), int(bounds[k + 1])
            ids = item["tokens"][a:b]
            trained = np.r_[False, item["loss_mask"][a:b - 1] > 0]  # position j-1 predicts token j
            target = np.r_[IGNORE, item["labels"][a:b - 1]]  # its label: the token (a token classifier's: its class)
            pairs = [f"({tok.decode([int(t)])!r}, {int(c) if m else IGNORE})" for t, c, m in zip(ids, target, trained)]
            out.append(f"sample {i} example {k} ({b - a} tokens, {int(trained.sum())} trained): " + " ".join(pairs))
    return out


def main(args) -> int:
    cfg = source.load_config(args.config, overrides=config.parse_sets(args.set), layout=False)  # no layout
    if not cfg.data.datasets:
        raise bad("datasets", [], "preprocess prepares SFT datasets and the config has none",
                  "list them under datasets: (Axolotl) or data.datasets (native)")
    tok_dir, vocab = source.tokenizer_dir(cfg), source.vocab_rows(cfg)
    if cfg.data.processor_type:  # image-text rows: nothing is prepared ahead (adapter/data/sft/multimodal.py)
        from adapter.data.sft import multimodal

        train, val, _ = multimodal.load(cfg, source.model_dir(cfg.model.path), tok_dir, vocab)
        for part in (train, val) if val is not None else (train,):  # a row the chat template refuses: said now
            part.check_template()
        print(f"image-text rows: {len(train)} to train" + (f", {len(val)} held out" if val is not None else "") +
              f" ({train.strategy_label()}); nothing is prepared ahead: each micro-batch is rendered by the "
              "processor when it trains (Axolotl's skip_prepare_dataset)")
        if args.debug:
            print("\n".join(multimodal.debug_lines(train, args.samples)))
        return 0
    if cfg.objective != "sft":  # preference pairs
        from adapter.data.sft import preference, preference_kto

        pairs = preference_kto.prepare_rows(cfg, tok_dir, vocab, builder=True, barrier=None, progress=True)
        print("\n".join(preference.stats_lines(pairs)))
        if args.debug:
            tok = load_tokenizer(cfg, tok_dir, vocab)
            print("\n".join(preference_kto.any_debug_lines(pairs, tok, args.samples)))
        return 0
    data = prepare(cfg, tok_dir, vocab, builder=True, barrier=None, progress=True)
    print("\n".join(stats_lines(data)))
    if args.debug:
        tok = load_tokenizer(cfg, tok_dir, vocab)
        print("\n".join(debug_lines(data, tok, args.samples)))
    return 0


__all__ = ["stats_lines", "debug_lines", "main"]
